"""A plain-torch reference for the pages workload: can a small CNN learn to read these pages?

    python bench/pages_reference.py --data D --steps 800                 # fixed pages from D
    python bench/pages_reference.py --data D --steps 600 --fresh         # a new batch every step
    python bench/pages_reference.py --data D --steps 600 --fresh --title-only
    python bench/pages_reference.py --data D --steps 600 --fresh --pool max \
        --arch 32s2,64s2,128s2,128s1,256s2,256s1 --presence 1.0
    python bench/pages_reference.py --data D --steps 1000 --fresh --pool max \
        --arch 32s2,64s2,128s2,128s1,256s1 --spot 1.0
    python bench/pages_reference.py --data D --steps 800 --fresh --pool bigram \
        --arch 32s2,64s2,128s2,128s1,256s1 --spot 1.0 --spot-cells box

The model is the issue's quick check: a BatchNorm CNN on the grey page (``--arch`` lists
``<channels>s<stride>`` per 3x3 conv), a flatten or global-max head, and a bag-of-words query
tower (one embedding per vocabulary word plus a position, summed, then an MLP), trained with
in-batch InfoNCE (query -> page, learned temperature from 0.07), AdamW, warmup 50 and cosine.

Training pages: fixed (``D/train.jsonl``), or with ``--fresh`` a new batch rendered every step by
`vltrain.data.synth_pages` (training-side titles only), so no page is seen twice. Knobs of the
fresh pages: ``--title-only F`` draws that fraction of each batch without body lines, queried by
title; ``--font-scale S`` scales the fonts (of the title-only pages when 0 < F < 1, else of every
page); ``--font-scale-end E`` moves S linearly to E over the first 80% of the steps. ``--workers
N``: N processes render the batches ahead of the step (each step's batch from its own seed).
``--hard-negatives`` adds each page's hard negative (one queried word swapped) to the batch's
pages. ``--presence W`` adds a per-word presence loss (400-way sigmoid on the max-pooled features).
``--spot W`` adds a dense reading loss: on the last feature map, the cell under each drawn word's
centre (boxes from `synth_pages.render`) classifies the word, 401-way with a background class
weighted 0.1 for the other cells. ``--spot-cells box`` labels every cell whose centre lies in the
word's box. ``--pool bigram`` (needs ``--spot``): the labelled cells also classify the next word on
their line (through a 1x5 row convolution; a last class for the end of a line), and both towers
emit a shared ``--dim``-wide bigram code (`BigramCode`): a query is its two words' code, a page the
max over its most word-like cells of their soft codes. Every ``--eval-every`` steps: held-out R@1
on ``D/val`` (the queries, corpus and qrels of `vltrain data synth --kind pages`) and hard-negative
accuracy (the page scores above every page qrels judge 0 for its query). Prints one line per 50
steps (loss, in-batch accuracy, spotted-word accuracy, seconds) and the eval lines.
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


class BigramCode(nn.Module):
    """The bigram code both towers share: a (word, next word) pair -> relu(P[w] + Q[next] + c),
    D wide. A query is its two words' code; a page cell is the code of its spotted word and
    spotted next word (soft, through the spotters' softmax), and the page is the max over cells,
    so a page keeps which words sit together rather than a bag of words."""

    def __init__(self, vocab: int, dim: int, keep: int = 24) -> None:
        super().__init__()
        self.keep = keep
        self.first = nn.Parameter(torch.randn(vocab + 1, dim) / math.sqrt(dim))
        self.second = nn.Parameter(torch.randn(vocab + 1, dim) / math.sqrt(dim))
        self.bias = nn.Parameter(torch.full((dim,), -0.5 / math.sqrt(dim)))

    def words(self, ids: torch.Tensor) -> torch.Tensor:
        return F.relu(self.first[ids[:, 0]] + self.second[ids[:, 1]] + self.bias)

    def cells(self, cur: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """cur, nxt: [B, V+1, H, W] logits -> [B, D], the max over the `keep` cells most likely
        to hold a word (a page has ~11 words; coding every cell costs 3x the CNN's step)."""
        a = cur.softmax(1).flatten(2).transpose(1, 2)  # [B, cells, V+1]
        b = nxt.softmax(1).flatten(2).transpose(1, 2)
        keep = a[..., -1].topk(min(self.keep, a.shape[1]), dim=1, largest=False).indices
        a = a.gather(1, keep[..., None].expand(-1, -1, a.shape[-1]))
        b = b.gather(1, keep[..., None].expand(-1, -1, b.shape[-1]))
        return F.relu(a @ self.first + b @ self.second + self.bias).amax(1)


class PageTower(nn.Module):
    def __init__(
        self,
        arch: str,
        size: int,
        pool: str,
        dim: int = 128,
        vocab: int = 0,
        code: BigramCode | None = None,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c, side = 1, size
        for spec in arch.split(","):
            out, stride = (int(x) for x in spec.split("s"))
            layers += [nn.Conv2d(c, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out), nn.GELU()]
            c, side = out, side // stride
        self.convs, self.pool, self.channels = nn.Sequential(*layers), pool, c
        self.head = nn.Linear(c * side * side if pool == "flatten" else c, dim)
        self.spotter = nn.Conv2d(c, vocab + 1, 1) if vocab else None  # vocab = background
        if pool == "bigram":  # the next word on the line needs context along the row
            self.line = nn.Sequential(
                nn.Conv2d(c, 128, (1, 5), padding=(0, 2), bias=False),
                nn.BatchNorm2d(128),
                nn.GELU(),
            )
            self.next_spotter = nn.Conv2d(c + 128, vocab + 1, 1)  # vocab = end of line
        self.code = code
        self.feature_map = self.spots = self.next_spots = torch.empty(0)

    def forward(self, pages: torch.Tensor) -> torch.Tensor:
        h = self.convs((pages.float() / 255.0 - 0.5)[:, None])
        self.feature_map = h
        if self.spotter is not None:
            self.spots = self.spotter(h)
        if self.pool == "bigram":
            assert self.code is not None
            self.next_spots = self.next_spotter(torch.cat([h, self.line(h)], 1))
            return F.normalize(self.code.cells(self.spots, self.next_spots), dim=-1)
        h = h.flatten(1) if self.pool == "flatten" else h.amax((2, 3))
        return F.normalize(self.head(h), dim=-1)


class QueryTower(nn.Module):
    def __init__(
        self, vocab: int, words: int = 2, dim: int = 128, code: BigramCode | None = None
    ) -> None:
        super().__init__()
        self.code = code
        if code is None:
            self.embed = nn.Embedding(vocab, dim)
            self.position = nn.Parameter(torch.zeros(words, dim))
            self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.code is not None:
            return F.normalize(self.code.words(ids), dim=-1)
        return F.normalize(self.mlp((self.embed(ids) + self.position).sum(1)), dim=-1)


class FreshPages:
    """Training-side pages drawn and rendered on demand (no page is ever repeated)."""

    def __init__(self, seed: int | str, size: int, title_only: float, font_scale: float) -> None:
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


def font_scale_at(a: argparse.Namespace, step: int) -> float:
    """``--font-scale`` moved linearly to ``--font-scale-end`` over the first 80% of the steps."""
    if not a.font_scale_end:
        return a.font_scale
    frac = min(1.0, step / max(1, int(0.8 * a.steps)))
    return a.font_scale + frac * (a.font_scale_end - a.font_scale)


class FreshBatches(torch.utils.data.Dataset):
    """Step i's fresh batch from its own seed, so DataLoader workers can render the next
    batches while the main process trains (``--workers``); a different page stream from the
    sequential one, equally deterministic."""

    def __init__(self, a: argparse.Namespace, index: dict[str, int]) -> None:
        self.a, self.index = a, index

    def __len__(self) -> int:
        return self.a.steps

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, list]:
        a = self.a
        source = FreshPages(f"{a.seed}-{step}", a.size, a.title_only, font_scale_at(a, step))
        return source.batch(a.batch_size, self.index, a.hard_negatives)


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
    p.add_argument("--pool", choices=("flatten", "max", "bigram"), default="flatten")
    p.add_argument("--dim", type=int, default=1024, help="width of the bigram code")
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
    p.add_argument(
        "--spot-cells",
        choices=("centre", "box"),
        default="centre",
        help="which cells a word labels: the one under its centre, or every cell in its box",
    )
    p.add_argument("--hard-negatives", action="store_true", help="one image hard negative each")
    p.add_argument("--eval-every", type=int, default=400)
    p.add_argument("--workers", type=int, default=0, help="processes rendering fresh batches ahead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if a.pool == "bigram" and not (a.spot and a.fresh):
        p.error("--pool bigram reads the spotted words: it needs --fresh and --spot")
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    root = Path(a.data)
    vocab = sp.vocabulary()
    index = {w: i for i, w in enumerate(vocab)}
    print(
        f"# {cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; {vars(a)}"
    )

    code = BigramCode(len(vocab), a.dim) if a.pool == "bigram" else None
    pages = PageTower(a.arch, a.size, a.pool, vocab=len(vocab) if a.spot else 0, code=code)
    queries = QueryTower(len(vocab), code=code)
    presence = nn.Linear(pages.channels, len(vocab))
    spot_weight = torch.ones(len(vocab) + 1)
    spot_weight[-1] = 0.1  # the background class (cells under no word's centre)
    log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    # one ModuleList so the bigram code, which sits in both towers, is listed once
    params = [*nn.ModuleList([pages, queries, presence]).parameters(), log_scale]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, a.steps) / a.steps))
        ),
    )
    if a.fresh:
        source = FreshPages(a.seed, a.size, a.title_only, a.font_scale)
        ahead = iter(
            torch.utils.data.DataLoader(
                FreshBatches(a, index), batch_size=None, num_workers=a.workers, prefetch_factor=2
            )
            if a.workers
            else ()
        )
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
        if a.fresh and a.workers:
            x, q, words = next(ahead)
        elif a.fresh:
            source.font_scale = font_scale_at(a, step)
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
            spot_logits = pages.spots[: a.batch_size]
            side = spot_logits.shape[-1]
            cell = a.size / side
            target = torch.full((a.batch_size, side, side), len(vocab), dtype=torch.long)
            following = torch.full_like(target, -100)  # the next word on the line (bigram head)
            for i, ws in enumerate(words):
                for k, (w, x0, y0, x1, y1) in enumerate(ws):
                    cx = min(side - 1, max(0, int((x0 + x1) / 2 / cell)))
                    cy = min(side - 1, max(0, int((y0 + y1) / 2 / cell)))
                    xs, ys = slice(cx, cx + 1), slice(cy, cy + 1)
                    if a.spot_cells == "box":  # every cell whose centre lies in the word's box
                        lo_x, hi_x = math.ceil(x0 / cell - 0.5), math.floor(x1 / cell - 0.5)
                        lo_y, hi_y = math.ceil(y0 / cell - 0.5), math.floor(y1 / cell - 0.5)
                        lo_x, lo_y = max(0, min(lo_x, cx)), max(0, min(lo_y, cy))
                        xs = slice(lo_x, min(side, max(hi_x, cx) + 1))
                        ys = slice(lo_y, min(side, max(hi_y, cy) + 1))
                    target[i, ys, xs] = w
                    same_line = k + 1 < len(ws) and ws[k + 1][2] == y0
                    following[i, ys, xs] = ws[k + 1][0] if same_line else len(vocab)
            loss = loss + a.spot * F.cross_entropy(spot_logits, target, weight=spot_weight)
            if a.pool == "bigram":
                loss = loss + a.spot * F.cross_entropy(
                    pages.next_spots[: a.batch_size], following, ignore_index=-100
                )
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
