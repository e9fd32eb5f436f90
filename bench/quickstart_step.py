"""Where the quickstart's CLIP step goes, and what the text grouping and the token memo save.

    python bench/quickstart_step.py --run runs/quickstart [--batches 12] [--threads 2]

`--run` is a finished `vltrain quickstart --out DIR` (its data and the CLIP run's tokenizer and
config). On training batches of the quickstart's data (batch 128, one hard negative, a second
caption per image) it times, alternating the variants batch by batch (medians):

- the model's forward + backward: the whole step, the image tower alone, and the three text
  sets (captions, second captions, hard negatives) one call per set against one length-sorted
  pass (`encode_text_sets`);
- the loader's work per batch in a later epoch (decoded images cached): samples + collate, with
  the tokenizer's memo and with a tokenizer that has none.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from vltrain.config.schema import load_config
from vltrain.data.collate import ImageTextCollate
from vltrain.data.images import DecodedImages
from vltrain.data.records import ImageTextDataset
from vltrain.data.tokenizer import TextTokenizer
from vltrain.models.backbones import build_encoder
from vltrain.models.contrastive import TEXT_SIDES, ContrastiveModel, encode_text_sets
from vltrain.objectives.contrastive import build_loss_from_config


class NoMemo(TextTokenizer):
    """The tokenizer as it was: every text through the Rust call, every batch."""

    def _memo_ids(self, texts):  # type: ignore[override]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True, help="a finished quickstart's --out")
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = load_config(args.run / "clip" / "config.yaml")
    tok = TextTokenizer.load(args.run / "clip" / "tokenizer")
    ds = ImageTextDataset(
        cfg.data.train, cfg.data.image_size, 0, hard_negatives=1, train=True, second_caption=True
    )
    ds.source.decoded = DecodedImages.shared(cfg.data.train, cfg.data.image_size * 4)
    for i in range(len(ds)):  # decode once, as the first epoch does
        ds[i]
    bs = cfg.data.batch_size
    keys = [[(1, 0, (b * bs + j) % len(ds)) for j in range(bs)] for b in range(args.batches)]
    memo = ImageTextCollate(tok, cfg.data.max_text_len)
    plain = ImageTextCollate(NoMemo(tok._tok), cfg.data.max_text_len)
    for k in keys:  # the memo's first epoch
        memo([ds[key] for key in k])
    batches = [memo([ds[key] for key in k]) for k in keys]

    enc = build_encoder(cfg, tok)
    model = ContrastiveModel(enc, build_loss_from_config(cfg.objective)).train()

    def step(b):
        model.zero_grad(set_to_none=True)
        model(b)[0].backward()

    def image(b):
        model.zero_grad(set_to_none=True)
        enc.encode_image(b["images"]).sum().backward()

    def texts_per_set(b):
        model.zero_grad(set_to_none=True)
        sum(enc.encode_text(b[i], b[m]).sum() for i, m in TEXT_SIDES).backward()

    def texts_grouped(b):
        model.zero_grad(set_to_none=True)
        sets = [(b[i], b[m]) for i, m in TEXT_SIDES]
        sum(e.sum() for e in encode_text_sets(enc, sets)).backward()

    variants = {
        "step (forward + backward)": step,
        "image tower": image,
        "3 text sets, one call each": texts_per_set,
        "3 text sets, grouped": texts_grouped,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    times |= {"loader, token memo": [], "loader, no memo": []}
    for n, b in enumerate(batches):
        for name, fn in variants.items():
            t = timed(lambda fn=fn, b=b: fn(b))
            if n >= 2:  # warm-up
                times[name].append(t)
        for name, coll in (("loader, token memo", memo), ("loader, no memo", plain)):
            times[name].append(timed(lambda c=coll, ks=keys[n]: c([ds[k] for k in ks])))
    tokens = [int(b[m].sum()) for b in batches for _, m in TEXT_SIDES]
    padded = [b[m].numel() for b in batches for _, m in TEXT_SIDES]
    print(
        f"threads {args.threads}, batch {bs}; real text tokens {sum(tokens) / sum(padded):.2f} "
        "of the per-set padded positions"
    )
    print("| part | ms per batch (median) |\n|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
