"""A plain-torch reference for the pages workload: can a small CNN learn to read these pages?

    python bench/pages_reference.py --data D --steps 800                 # fixed pages from D
    python bench/pages_reference.py --data D --steps 600 --fresh         # a new batch every step
    python bench/pages_reference.py --data D --steps 600 --fresh --title-only
    python bench/pages_reference.py --data D --steps 600 --fresh --pool max \
        --arch 32s2,64s2,128s2,128s1,256s2,256s1 --presence 1.0
    python bench/pages_reference.py --data D --steps 1000 --fresh --pool max \
        --arch 32s2,64s2,128s2,128s1,256s1 --spot 1.0

The model is the issue's quick check: a BatchNorm CNN on the grey page (``--arch`` lists
``<channels>s<stride>`` per 3x3 conv), a flatten or global-max head, and a bag-of-words query
tower (one embedding per vocabulary word plus a position, summed, then an MLP), trained with
in-batch InfoNCE (query -> page, learned temperature from 0.07), AdamW, warmup 50 and cosine.

Training pages: fixed (``D/train.jsonl``), or with ``--fresh`` a new batch rendered every step by
`vltrain.data.synth_pages` (training-side titles only), so no page is seen twice. Knobs of the
fresh pages: ``--title-only F`` draws that fraction of each batch without body lines, queried by
title; ``--font-scale S`` scales the fonts (of the title-only pages when 0 < F < 1, else of every
page); ``--font-scale-end E`` moves S linearly to E over the first 80% of the steps.
``--hard-negatives`` adds each page's hard negative (one queried word swapped) to the batch's
pages. ``--presence W`` adds a per-word presence loss (400-way sigmoid on the max-pooled
features). ``--spot W`` adds a dense reading loss: on the last feature map, the cell under each
drawn word's centre (boxes from `synth_pages.render`) classifies the word, 401-way with a
background class weighted 0.1 for the other cells. Every ``--eval-every`` steps: held-out
R@1 on ``D/val`` (the queries, corpus and qrels of `vltrain data synth --kind pages`) and
hard-negative accuracy (the page scores above every page qrels judge 0 for its query).
Prints one line per 50 steps (loss, in-batch accuracy, spotted-word accuracy, seconds) and the
eval lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from vltrain.data import synth_pages as sp
from vltrain.diagnostics.card import cpu_model


def grey(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("L"))


class PageTower(nn.Module):
    def __init__(self, arch: str, size: int, pool: str, dim: int = 128) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c, side = 1, size
        for spec in arch.split(","):
            out, stride = (int(x) for x in spec.split("s"))
            layers += [nn.Conv2d(c, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out), nn.GELU()]
            c, side = out, side // stride
        self.convs, self.pool, self.channels = nn.Sequential(*layers), pool, c
        self.head = nn.Linear(c * side * side if pool == "flatten" else c, dim)
        self.feature_map = torch.empty(0)

    def forward(self, pages: torch.Tensor) -> torch.Tensor:
        h = self.convs((pages.float() / 255.0 - 0.5)[:, None])
        self.feature_map = h
        h = h.flatten(1) if self.pool == "flatten" else h.amax((2, 3))
        return F.normalize(self.head(h), dim=-1)


class QueryTower(nn.Module):
    def __init__(self, vocab: int, words: int = 2, dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(words, dim))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.mlp((self.embed(ids) + self.position).sum(1)), dim=-1)


class FreshPages:
    """Training-side pages drawn and rendered on demand (no page is ever repeated)."""

    def __init__(self, seed: int, size: int, title_only: float, font_scale: float) -> None:
        self.rng, self.size = random.Random(f"reference-{seed}"), size
        self.title_only, self.font_scale = title_only, font_scale
        self.vocab = sp.vocabulary()

    def batch(
        self, n: int, index: dict[str, int], hard_negatives: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list]:
        """n pages (then, with `hard_negatives`, each page's hard negative), queries, and each
        page's drawn words as (word id, x0, y0, x1, y1) boxes."""
        pages, negatives, queries, words = [], [], [], []
        for i in range(n):
            page = sp.make_page(self.rng, self.vocab, self.size, held_out=False)
            title_only = i < round(self.title_only * n)
            scale = self.font_scale if title_only or self.title_only == 0 else 1.0
            style = dict(page.style)
            style["title_px"] = max(6, round(style["title_px"] * scale))
            style["body_px"] = max(6, round(style["body_px"] * scale))
            page = dataclasses.replace(page, style=style, lines=[] if title_only else page.lines)
            query, span = (
                (" ".join(page.title), (-1, 0)) if title_only else sp.make_query(self.rng, page)
            )
            boxes: list = []
            pages.append(grey(sp.render(page, self.size, boxes)))
            queries.append([index[w] for w in query.split()])
            words.append([(index[w], *box) for w, *box in boxes])
            if hard_negatives:
                if title_only:  # swap one title word (there is no body word to swap)
                    title = list(page.title)
                    title[self.rng.randrange(2)] = self.rng.choice(
                        [w for w in self.vocab if w not in page.title]
                    )
                    neg = dataclasses.replace(page, title=title)
                else:
                    neg = sp.hard_negative(self.rng, page, span, self.vocab)
                negatives.append(grey(sp.render(neg, self.size)))
        return torch.from_numpy(np.stack(pages + negatives)), torch.tensor(queries), words


def held_out(
    data: Path, pages: PageTower, queries: QueryTower, index: dict[str, int]
) -> tuple[float, float]:
    """R@1 over the split's whole corpus, and hard-negative accuracy (the page scores above
    every page that qrels judge 0 for its query)."""
    qs = [json.loads(line) for line in open(data / "queries.jsonl")]
    docs = [json.loads(line) for line in open(data / "corpus.jsonl")]
    row = {d["_id"]: i for i, d in enumerate(docs)}
    positive: dict[str, int] = {}
    judged_0: dict[str, list[int]] = {}
    for line in (data / "qrels.tsv").read_text().splitlines()[1:]:
        q, d, score = line.split("\t")
        if int(score) > 0:
            positive[q] = row[d]
        else:
            judged_0.setdefault(q, []).append(row[d])
    pages.eval()
    queries.eval()
    with torch.no_grad():
        chunks = []
        for i in range(0, len(docs), 512):
            imgs = [grey(Image.open(data / d["image"])) for d in docs[i : i + 512]]
            chunks.append(pages(torch.from_numpy(np.stack(imgs))))
        ids = torch.tensor([[index[w] for w in q["text"].split()] for q in qs])
        scores = queries(ids) @ torch.cat(chunks).T
    pages.train()
    queries.train()
    top = scores.argmax(1)
    r1 = np.mean([int(top[i]) == positive[q["_id"]] for i, q in enumerate(qs)])
    hn = [
        bool(scores[i, positive[q["_id"]]] > scores[i, judged_0[q["_id"]]].max())
        for i, q in enumerate(qs)
        if q["_id"] in judged_0
    ]
    return float(r1), float(np.mean(hn)) if hn else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", required=True, help="a `vltrain data synth --kind pages` folder")
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--arch", default="32s2,64s2,128s2,256s2")
    p.add_argument("--pool", choices=("flatten", "max"), default="flatten")
    p.add_argument("--size", type=int, default=96, help="page side (fresh pages)")
    p.add_argument("--fresh", action="store_true")
    p.add_argument(
        "--title-only",
        type=float,
        default=0.0,
        help="fraction of each batch drawn as title-only pages (at --font-scale; the rest at 1)",
    )
    p.add_argument("--font-scale", type=float, default=1.0)
    p.add_argument(
        "--font-scale-end", type=float, default=0.0, help="anneal linearly to this scale"
    )
    p.add_argument("--presence", type=float, default=0.0)
    p.add_argument(
        "--spot",
        type=float,
        default=0.0,
        help="weight of a dense reading loss: each word's centre cell of the last feature map "
        "classifies the word (401-way with background), from the renderer's word boxes",
    )
    p.add_argument("--hard-negatives", action="store_true", help="one image hard negative each")
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    root = Path(a.data)
    vocab = sp.vocabulary()
    index = {w: i for i, w in enumerate(vocab)}
    print(
        f"# {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; {vars(a)}"
    )

    pages, queries = PageTower(a.arch, a.size, a.pool), QueryTower(len(vocab))
    presence = nn.Linear(pages.channels, len(vocab))
    spotter = nn.Conv2d(pages.channels, len(vocab) + 1, 1)
    spot_weight = torch.ones(len(vocab) + 1)
    spot_weight[-1] = 0.1  # the background class (cells under no word's centre)
    log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    params = [
        *pages.parameters(),
        *queries.parameters(),
        *presence.parameters(),
        *spotter.parameters(),
        log_scale,
    ]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps))
        ),
    )
    if a.fresh:
        source = FreshPages(a.seed, a.size, a.title_only, a.font_scale)
    else:
        recs = [json.loads(line) for line in open(root / "train.jsonl")]
        fixed = torch.from_numpy(
            np.stack([grey(Image.open(root / r["positive"]["image"])) for r in recs])
        )
        fixed_neg = torch.from_numpy(
            np.stack([grey(Image.open(root / r["negatives"][0]["image"])) for r in recs])
            if a.hard_negatives
            else np.zeros((1, 1, 1), np.uint8)
        )
        fixed_q = torch.tensor([[index[w] for w in r["query"]["text"].split()] for r in recs])
        print(f"# {len(recs)} fixed training pages")
    g = torch.Generator().manual_seed(a.seed)
    labels = torch.arange(a.batch_size)
    t0 = time.perf_counter()
    for step in range(a.steps):
        words: list = []
        if a.fresh:
            if a.font_scale_end:
                frac = min(1.0, step / max(1, int(0.8 * a.steps)))
                source.font_scale = a.font_scale + frac * (a.font_scale_end - a.font_scale)
            x, q, words = source.batch(a.batch_size, index, a.hard_negatives)
        else:
            idx = torch.randint(0, len(recs), (a.batch_size,), generator=g)
            x, q = fixed[idx], fixed_q[idx]
            if a.hard_negatives:
                x = torch.cat([x, fixed_neg[idx]])
        logits = log_scale.exp().clamp(max=100) * queries(q) @ pages(x).T
        loss = F.cross_entropy(logits, labels)
        if a.presence and words:
            target = torch.zeros(a.batch_size, len(vocab))
            for i, ws in enumerate(words):
                target[i, [w[0] for w in ws]] = 1.0
            loss = loss + a.presence * F.binary_cross_entropy_with_logits(
                presence(pages.feature_map[: a.batch_size].amax((2, 3))), target
            ) * (len(vocab) / 12)
        spot_acc = float("nan")
        if a.spot and words:
            fmap = pages.feature_map[: a.batch_size]
            side = fmap.shape[-1]
            cell = a.size / side
            target = torch.full((a.batch_size, side, side), len(vocab), dtype=torch.long)
            for i, ws in enumerate(words):
                for w, x0, y0, x1, y1 in ws:
                    cx = min(side - 1, max(0, int((x0 + x1) / 2 / cell)))
                    cy = min(side - 1, max(0, int((y0 + y1) / 2 / cell)))
                    target[i, cy, cx] = w
            spot_logits = spotter(fmap)
            loss = loss + a.spot * F.cross_entropy(spot_logits, target, weight=spot_weight)
            is_word = target < len(vocab)
            spot_acc = (spot_logits.argmax(1)[is_word] == target[is_word]).float().mean().item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == a.steps - 1:
            acc = (logits.argmax(1) == labels).float().mean().item()
            print(
                f"step {step} loss {loss.item():.3f} acc {acc:.2f} spot acc {spot_acc:.2f} "
                f"t {time.perf_counter() - t0:.0f}",
                flush=True,
            )
        if ((step + 1) % a.eval_every == 0 or step == a.steps - 1) and a.size == 96:
            r1, hn = held_out(root / "val", pages, queries, index)
            print(f"step {step + 1} held-out R@1 {r1:.3f} hard-negative acc {hn:.3f}", flush=True)


if __name__ == "__main__":
    main()
