"""A plain-torch reference of the quickstart's CLIP stage: recipe search and relation probes.

    vltrain data synth --out data/shapes2k --n-train 12000 --n-val 2000 --n-test 2000 --seed 0
    python bench/quickstart_reference.py --data data/shapes2k --tokenizer RUN/clip/tokenizer \\
        [--chans 16,32,64,128] [--text-layers 1] [--lr 1e-3] [--steps 600] [--hard-negatives 1] \\
        [--text-causal 1] [--text-pool mean] [--text-text 1.0] [--text-mlp swiglu] \\
        [--text-rel-pos 4] [--inverse-negatives 1.0] [--mirror-negatives 1.0] \\
        [--oracle-text 1] [--text-only 1] [--seed 0] [--out results.jsonl]

Why it exists: a full `vltrain train` of the quickstart takes minutes, and single runs on the
quickstart's 300 val images differ by 0.03-0.07 R@1 between seeds, so recipe choices need a
faster loop and a less noisy evaluation. This script trains the same towers (vltrain's
`TextTower`, a conv stem + flatten head like `tiny_cnn`, vltrain's `InfoNCELoss`, AdamW with
warmup + cosine to 0.1x) on images decoded once into memory, and evaluates on 2,000 val and
2,000 test images of the same generator (the first 300 of each ARE the quickstart's splits, since
a record depends only on (seed, split, index)):

- R@1 as the quickstart measures it (300-image galleries), averaged over the six disjoint
  300-image chunks (`i2t`, `t2i`; about 2.5x less evaluation noise) and on chunk 0 alone
  (`i2t0`, `t2i0`: the quickstart's own val/test);
- hard-negative accuracy per kind on all 2,000 images, with the relation swaps split into
  *inverse* swaps ("A left of B" -> "A right of B": needs word order bound to the objects) and
  *orthogonal* ones ("A left of B" -> "A above B": a bag of words tells them apart).

Text-tower options mirror `TextTowerConfig` (`--text-causal`, `--text-pool`, `--text-rel-pos`);
`--text-mlp swiglu` swaps its MLPs for gated ones; `--text-text W` adds the caption-caption
InfoNCE of `objective.caption_contrast` at weight W. Probes of why relation swaps stay near
65%: `--inverse-negatives P` makes a sample's hard negative its own caption with the relation
inverted (with probability P), NegCLIP-style; `--mirror-negatives P` adds the image flipped
along its relation's axis as a hard-negative image for the text->image side; `--oracle-text 1`
replaces the text tower by an embedding of the parsed statement with the roles given
(first object, relation, second object, "A right of B" read as "B left of A"), which shows
whether the image tower can learn the relation when the text side binds it. Every evaluation
also probes the text tower alone (`text_binding`: a first caption closer to its paraphrase in
the other word order than to itself with the relation inverted), and `--text-only 1` trains
only the text tower on caption-caption InfoNCE with inverted captions as negatives. Results:
bench/RESULTS.md ("Quickstart CLIP recipe", rounds 3 and 4).
"""

from __future__ import annotations

import argparse
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

from vltrain.data.synth import COLORS, SHAPES
from vltrain.data.tokenizer import TextTokenizer
from vltrain.eval.retrieval import image_text_retrieval
from vltrain.models.layers import init_weights
from vltrain.models.text import TextTower, TextTowerConfig
from vltrain.models.vit import CLIP_MEAN, CLIP_STD
from vltrain.objectives.contrastive import InfoNCELoss

KINDS = ("color", "shape", "size", "relation")
#: relation words -> their inverse (captions use these synonyms)
INVERSE = {
    "left": "right",
    "right": "left",
    "above": "below",
    "below": "above",
    "over": "under",
    "under": "over",
    "beneath": "above",
}
HORIZONTAL = {"left", "right"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True, help="vltrain data synth folder")
    p.add_argument("--tokenizer", type=Path, required=True, help="a quickstart run's tokenizer/")
    p.add_argument("--out", type=Path, default=Path("quickstart_reference.jsonl"))
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--beta2", type=float, default=0.98)
    p.add_argument("--temperature", type=float, default=0.07)
    p.add_argument("--hard-negatives", type=int, default=1)
    p.add_argument("--inverse-negatives", type=float, default=0.0)
    p.add_argument("--mirror-negatives", type=float, default=0.0)
    p.add_argument("--chans", default="16,32,64,128", help="stride-2 stem convs, then the last")
    p.add_argument("--text-layers", type=int, default=1)
    p.add_argument("--text-width", type=int, default=128)
    p.add_argument("--text-causal", type=int, default=1, help="0: bidirectional text encoder")
    p.add_argument("--text-pool", choices=("last", "mean"), default="last")
    p.add_argument("--text-mlp", choices=("gelu", "swiglu"), default="gelu")
    p.add_argument("--text-rel-pos", type=int, default=0, help="TextTowerConfig.rel_pos")
    p.add_argument(
        "--text-text",
        type=float,
        default=0.0,
        help="weight of a caption-caption InfoNCE: a second caption of the same image is the "
        "positive, the other images' captions and the hard negatives the negatives",
    )
    p.add_argument(
        "--text-only",
        type=int,
        default=0,
        help="1: train only the text tower (caption-caption, inverted negatives); binding probe",
    )
    p.add_argument(
        "--oracle-text",
        type=int,
        default=0,
        help="1: replace the text tower by an embedding of the parsed statement (diagnostic)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="")
    return p.parse_args()


def load_split(data: Path, name: str) -> tuple[list[dict], torch.Tensor]:
    """Records and their images as one uint8 tensor (N, 3, S, S), decoded once."""
    recs = [json.loads(line) for line in open(data / f"{name}.jsonl")]
    imgs = np.stack([np.asarray(Image.open(data / r["image"]).convert("RGB")) for r in recs])
    return recs, torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous()


class ConvTower(nn.Module):
    """`tiny_cnn`'s shape: 3x3 stride-2 convs (BatchNorm, GELU), a 3x3 conv to the last width,
    a linear map of the whole grid (the flatten head), LayerNorm."""

    def __init__(self, chans: list[int], image_size: int = 64, width: int = 128) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c, side = 3, image_size
        for i, out in enumerate(chans):
            stride = 2 if i < len(chans) - 1 else 1
            layers += [nn.Conv2d(c, out, 3, stride, 1, bias=False), nn.BatchNorm2d(out), nn.GELU()]
            c, side = out, side // stride
        self.stem = nn.Sequential(*layers)
        self.head = nn.Linear(side * side * c, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), False)
        self.register_buffer("std", torch.tensor(CLIP_STD).view(1, 3, 1, 1), False)
        self.apply(init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem((x - self.mean) / self.std)  # (B, C, s, s)
        return self.norm(self.head(x.flatten(1)))  # (B, W)


class SwiGLU(nn.Module):
    """Gated feed-forward (Llama's): a product of two projections, hidden 8/3 x width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        hidden = int(width * 8 / 3)
        self.gate, self.up = nn.Linear(width, hidden), nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.apply(init_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


SIZE_OF = {"small": 0, "little": 0, "large": 1, "big": 1}
COLOR_IDS = {c: i for i, c in enumerate(COLORS)}
SHAPE_IDS = {s: i for i, s in enumerate(SHAPES)}
REL_OF = {"left": 0, "right": 1, "above": 2, "over": 2, "below": 3, "under": 3, "beneath": 3}


def parse_statement(text: str) -> tuple[int, int, int]:
    """A caption as (first object, relation, second object) ids with the roles canonical:
    "A right of B" -> (B, left, A), "A below B" -> (B, above, A); a one-shape caption is
    (A, 2 + 2, none). Objects are size * 30 + colour * 5 + shape; 60 = none."""
    words = text.replace(",", "").split()
    objs = [
        SIZE_OF[words[i - 1]] * 30 + COLOR_IDS[w] * 5 + SHAPE_IDS[words[i + 1]]
        for i, w in enumerate(words)
        if w in COLOR_IDS
    ]
    rels = [REL_OF[w] for w in words if w in REL_OF]
    if not rels:
        return objs[0], 4, 60
    a, b = (objs[1], objs[0]) if "with" in words else (objs[0], objs[1])
    rel = rels[0]
    return (a, rel, b) if rel in (0, 2) else (b, rel - 1, a)


class OracleText(nn.Module):
    """Text with the binding given: role-specific object embeddings + relation, then an MLP."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first, self.second = nn.Embedding(61, width), nn.Embedding(61, width)
        self.rel = nn.Embedding(5, width)
        self.mlp = nn.Sequential(nn.GELU(), nn.Linear(width, width))
        self.apply(init_weights)

    def forward(self, texts: list[str]) -> torch.Tensor:
        st = torch.tensor([parse_statement(t) for t in texts])
        return self.mlp(self.first(st[:, 0]) + self.rel(st[:, 1]) + self.second(st[:, 2]))


class DualEncoder(nn.Module):
    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        super().__init__()
        self.vision = ConvTower([int(c) for c in args.chans.split(",")])
        cfg = TextTowerConfig(
            vocab_size=vocab_size,
            context_length=32,
            width=args.text_width,
            layers=args.text_layers,
            heads=4,
            causal=bool(args.text_causal),
            pool=args.text_pool,
            rel_pos=args.text_rel_pos,
        )
        self.text = TextTower(cfg)
        self.oracle = OracleText(args.text_width) if args.oracle_text else None
        if args.text_mlp == "swiglu":
            for block in self.text.blocks:
                block.mlp = SwiGLU(args.text_width)
        self.vision_proj = nn.Linear(128, 128, bias=False)
        self.text_proj = nn.Linear(args.text_width, 128, bias=False)
        init_weights(self.vision_proj)
        init_weights(self.text_proj)

    def image(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.vision_proj(self.vision(x)), dim=-1)

    def texts(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.text_proj(self.text.pooled(ids, mask)), dim=-1)


def inverse_caption(text: str) -> str | None:
    """The caption with its relation word inverted (None for a one-shape caption)."""
    words = text.split()
    out = [INVERSE.get(w, w) for w in words]
    return " ".join(out) if out != words else None


def is_inverse_swap(caption: str, negative: str) -> bool:
    """A relation negative that keeps the axis (left <-> right, above <-> below)."""
    a, b = set(caption.split()), set(negative.split())
    return bool((a - b) & HORIZONTAL) == bool((b - a) & HORIZONTAL)


class Reference:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tok = TextTokenizer.load(args.tokenizer)
        self.train_recs, self.train_imgs = load_split(args.data, "train")
        self.splits = {s: load_split(args.data, s) for s in ("val", "test")}
        self.model = DualEncoder(args, self.tok.vocab_size)
        self.loss = InfoNCELoss(temperature=args.temperature)
        no_decay = [p for p in self.model.parameters() if p.ndim < 2] + [self.loss.logit_scale]
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        groups = [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, args.beta2), eps=1e-6)
        self.rng = random.Random(args.seed)

    def encode(self, texts: list[str]) -> torch.Tensor:
        if self.model.oracle is not None:
            return F.normalize(self.model.text_proj(self.model.oracle(texts)), dim=-1)
        return self.model.texts(*self.tok.encode_batch(texts, 32))

    def lr_at(self, step: int) -> float:
        a = self.args
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = (step - a.warmup) / max(1, a.steps - a.warmup)
        return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, list[str], list[str], list]:
        a, rng = self.args, self.rng
        imgs = self.train_imgs[idx].float() / 255.0  # (B, 3, S, S)
        caps, caps2, negs, flipped = [], [], [], []
        for j, i in enumerate(idx.tolist()):
            r = self.train_recs[i]
            k = rng.randrange(len(r["text"]))
            caps.append(r["text"][k])
            if a.text_text > 0:  # another caption of the image (the same if it has one)
                k2 = rng.randrange(len(r["text"]) - 1) if len(r["text"]) > 1 else -1
                caps2.append(r["text"][k2 + (k2 >= k)] if k2 >= 0 else r["text"][k])
            chosen = rng.sample(r["negatives"], min(a.hard_negatives, len(r["negatives"])))
            if chosen and rng.random() < a.inverse_negatives:
                chosen[0] = inverse_caption(caps[-1]) or chosen[0]
            negs += chosen
            if r.get("relation") and rng.random() < a.mirror_negatives:
                axis = 2 if r["relation"] in ("left of", "right of") else 1  # (3, H, W)
                flipped.append(torch.flip(imgs[j], dims=[axis]))
        return imgs, caps + caps2, negs, flipped

    def step(self, step: int, idx: torch.Tensor) -> float:
        imgs, caps, negs, flipped = self.batch(idx)
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(step)
        img = self.model.image(imgs)
        txt_all = self.encode(caps + negs)
        b = len(imgs)
        txt, neg = txt_all[:b], (txt_all[len(caps) :] if negs else None)
        txt2 = txt_all[b : len(caps)]
        if not flipped:
            loss, _ = self.loss(img, txt, neg)
        else:  # text->image also against the mirrored images
            scale, labels = self.loss.scale(), torch.arange(len(caps))
            cols = txt if neg is None else torch.cat([txt, neg])
            mirrored = self.model.image(torch.stack(flipped))
            i2t = F.cross_entropy(scale * img @ cols.T, labels)
            t2i = F.cross_entropy(scale * txt @ torch.cat([img, mirrored]).T, labels)
            loss = 0.5 * (i2t + t2i)
        if len(txt2):  # caption-caption: each caption against the image's other caption
            scale, labels = self.loss.scale(), torch.arange(b)
            cols = txt2 if neg is None else torch.cat([txt2, neg])
            tt = F.cross_entropy(scale * txt @ cols.T, labels)
            tt = 0.5 * (tt + F.cross_entropy(scale * txt2 @ torch.cat([txt, cols[b:]]).T, labels))
            loss = loss + self.args.text_text * tt
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())

    @torch.no_grad()
    def evaluate(self, split: str, chunk: int = 300) -> dict[str, float]:
        recs, imgs = self.splits[split]
        self.model.eval()
        img = torch.cat(
            [self.model.image(imgs[i : i + 500].float() / 255.0) for i in range(0, len(recs), 500)]
        )
        out = {"i2t": 0.0, "t2i": 0.0}
        n_chunks = max(1, len(recs) // chunk)
        for c in range(n_chunks):
            part = recs[c * chunk : (c + 1) * chunk]
            texts = [t for r in part for t in r["text"]]
            owner = torch.tensor([i for i, r in enumerate(part) for _ in r["text"]])
            m = image_text_retrieval(img[c * chunk : (c + 1) * chunk], self.encode(texts), owner)
            out["i2t"] += m["i2t_R@1"] / n_chunks
            out["t2i"] += m["t2i_R@1"] / n_chunks
            if c == 0:
                out["i2t0"], out["t2i0"] = m["i2t_R@1"], m["t2i_R@1"]
        first = self.encode([r["text"][0] for r in recs])
        negs = [n for r in recs for n in r["negatives"]]
        kinds = [k for r in recs for k in r["negative_kinds"]]
        owner = torch.tensor([i for i, r in enumerate(recs) for _ in r["negatives"]])
        neg = torch.cat([self.encode(negs[i : i + 2000]) for i in range(0, len(negs), 2000)])
        hit = (img * first).sum(-1)[owner] > (img[owner] * neg).sum(-1)
        out["hardneg"] = hit.float().mean().item()
        for kind in KINDS:
            out[kind] = hit[torch.tensor([k == kind for k in kinds])].float().mean().item()
        rel = torch.tensor([k == "relation" for k in kinds])
        pairs = [(r["text"][0], n) for r in recs for n in r["negatives"]]
        inv = torch.tensor(
            [k == "relation" and is_inverse_swap(*p) for p, k in zip(pairs, kinds, strict=True)]
        )
        out["relation_inverse"] = hit[rel & inv].float().mean().item()
        out["relation_orthogonal"] = hit[rel & ~inv].float().mean().item()
        out.update(self.text_binding(recs))
        self.model.train()
        return out

    @torch.no_grad()
    def text_binding(self, recs: list[dict]) -> dict[str, float]:
        """The text tower alone: how often a record's first caption is closer to a paraphrase in
        the other word order ("B right of A" for "A left of B") than to its own caption with
        the relation inverted ("A right of B"), and the two mean cosines."""
        a, p, n = [], [], []
        for r in recs:
            first = r["text"][0]
            other = [c for c in r["text"][1:] if c.split()[1:3] != first.split()[1:3]]
            inv = inverse_caption(first)
            if r.get("relation") and inv and other:
                a.append(first)
                p.append(other[0])
                n.append(inv)
        ea, ep, en = self.encode(a), self.encode(p), self.encode(n)
        pos, neg = (ea * ep).sum(-1), (ea * en).sum(-1)
        return {
            "text_binding": (pos > neg).float().mean().item(),
            "text_cos_paraphrase": pos.mean().item(),
            "text_cos_inverse": neg.mean().item(),
        }

    def run_text_only(self) -> dict:
        """`--text-only`: train the text tower alone on caption-caption InfoNCE, every negative
        the caption with its relation inverted; can one block learn the binding at all?"""
        a, rng = self.args, self.rng
        recs = [r for r in self.train_recs if r.get("relation") and len(r["text"]) > 1]
        curve = []
        for step in range(a.steps):
            c1, c2, neg = [], [], []
            for r in rng.sample(recs, a.batch_size):
                i, j = rng.sample(range(len(r["text"])), 2)
                c1.append(r["text"][i])
                c2.append(r["text"][j])
                neg.append(inverse_caption(r["text"][i]) or r["text"][i])
            e = self.encode(c1 + c2 + neg)
            b = a.batch_size
            logits = self.loss.scale() * e[:b] @ torch.cat([e[b : 2 * b], e[2 * b :]]).T
            loss = F.cross_entropy(logits, torch.arange(b))
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if (step + 1) % a.eval_every == 0:
                self.model.eval()
                curve.append([step + 1, self.text_binding(self.splits["val"][0])])
                self.model.train()
                print(f"step {step + 1} loss {loss.item():.3f} text {curve[-1][1]}")
        return {"args": {k: str(v) for k, v in vars(a).items()}, "text_only": curve}

    def run(self) -> dict:
        a = self.args
        g = torch.Generator().manual_seed(a.seed)
        n, perm, pos = len(self.train_recs), None, 0
        t0, compute, curve = time.time(), 0.0, []
        for step in range(a.steps):
            if perm is None or pos + a.batch_size > n:
                perm, pos = torch.randperm(n, generator=g), 0
            idx, pos = perm[pos : pos + a.batch_size], pos + a.batch_size
            tc = time.time()
            loss = self.step(step, idx)
            compute += time.time() - tc
            if (step + 1) % a.eval_every == 0 and step + 1 < a.steps:
                v = self.evaluate("val")
                curve.append(
                    [step + 1, round(v["i2t"], 3), round(v["t2i"], 3)]
                    + [round(v[k], 3) for k in ("relation_inverse", "text_binding")]
                )
                print(f"step {step + 1} loss {loss:.3f} val {curve[-1][1:]}")
        return {
            "args": {k: str(v) for k, v in vars(a).items()},
            "seconds": time.time() - t0,
            "step_seconds": compute / max(1, a.steps),
            "curve": curve,
            "val": self.evaluate("val"),
            "test": self.evaluate("test"),
        }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ref = Reference(args)
    result = ref.run_text_only() if args.text_only else ref.run()
    print(json.dumps(result))
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
