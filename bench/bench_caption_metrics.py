"""Benchmark vltrain's BLEU / CIDEr-D against pycocoevalcap on the same synthetic captions.

Run: ``python bench/bench_caption_metrics.py [--images 5000] [--refs 5] [--repeats 3]``.
Checks that both libraries give the same scores (fails loudly otherwise), then prints a
markdown table of median wall times.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pycocoevalcap.bleu.bleu import Bleu as CocoBleu
from pycocoevalcap.cider.cider import Cider as CocoCider

from vltrain.eval.caption_metrics import Bleu, CiderD, sentence_bleu

TOL = 1e-9


def synth_captions(
    n_images: int, n_refs: int, vocab: int = 2000, seed: int = 0
) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """Zipf-ish captions of 8-14 words; each candidate is a reference with ~30% words changed."""
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(vocab)])
    p = 1.0 / np.arange(1, vocab + 1) ** 1.1
    p /= p.sum()

    def caption() -> list[str]:
        return list(rng.choice(words, size=int(rng.integers(8, 15)), p=p))

    gts, res = {}, {}
    for i in range(n_images):
        refs = [caption() for _ in range(n_refs)]
        cand = list(refs[int(rng.integers(n_refs))])
        for j in np.nonzero(rng.random(len(cand)) < 0.3)[0]:
            cand[j] = str(rng.choice(words, p=p))
        gts[i] = [" ".join(r) for r in refs]
        res[i] = [" ".join(cand)]
    return gts, res


def paired_times(
    ours: Callable[[], Any], ref: Callable[[], Any], repeats: int
) -> tuple[float, Any, float, Any]:
    """Median wall times of two functions run alternately (shared-machine noise hits both)."""
    t_ours, t_ref, out_ours, out_ref = [], [], None, None
    for _ in range(repeats):
        t, out_ours = median_time(ours, 1)
        t_ours.append(t)
        t, out_ref = median_time(ref, 1)
        t_ref.append(t)
    return statistics.median(t_ours), out_ours, statistics.median(t_ref), out_ref


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median wall time of ``fn()`` over ``repeats`` runs, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def check_same(name: str, ours: Any, ref: Any) -> float:
    """Max abs difference between two score structures; raises if above TOL."""
    diff = float(np.max(np.abs(np.asarray(ours, dtype=float) - np.asarray(ref, dtype=float))))
    if not diff <= TOL:
        raise SystemExit(f"{name}: vltrain and pycocoevalcap differ by {diff:.3g} > {TOL}")
    return diff


def main() -> None:
    """Run the benchmark and print the markdown table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--refs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    gts, res = synth_captions(args.images, args.refs)
    rows = []

    t_ours, (b_ours, bi_ours), t_ref, (b_ref, bi_ref) = paired_times(
        lambda: Bleu(4).compute_score(gts, res),
        lambda: CocoBleu(4).compute_score(gts, res, verbose=0),
        args.repeats,
    )
    d = max(check_same("BLEU corpus", b_ours, b_ref), check_same("BLEU items", bi_ours, bi_ref))
    rows.append(("BLEU-1..4 (`compute_score`)", t_ours, t_ref, d))

    t_ours, (c_ours, ci_ours), t_ref, (c_ref, ci_ref) = paired_times(
        lambda: CiderD().compute_score(gts, res),
        lambda: CocoCider().compute_score(gts, res),
        args.repeats,
    )
    d = max(check_same("CIDEr corpus", c_ours, c_ref), check_same("CIDEr items", ci_ours, ci_ref))
    rows.append(("CIDEr-D (`compute_score`)", t_ours, t_ref, d))

    keys = list(gts)
    cands, refs_list = [res[k][0] for k in keys], [gts[k] for k in keys]
    t_build, scorer = median_time(lambda: CiderD(refs_corpus=gts), args.repeats)
    t_many, many = median_time(lambda: scorer.score_many(cands, refs_list), args.repeats)
    # df from the same corpus as gts: score_many must equal pycocoevalcap's per-item scores
    check_same("CiderD.score_many", many, ci_ref)
    t_sb, sb = median_time(lambda: sentence_bleu(cands, refs_list, n=4), args.repeats)
    check_same("sentence_bleu", sb, bi_ref[3])

    print(f"{args.images} images x {args.refs} refs, captions 8-14 words, Zipf vocab 2,000;")
    print(f"median of {args.repeats} alternating runs, one process, same data for both.\n")
    print(
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"Python {platform.python_version()}, numpy {np.__version__}, "
        f"pycocoevalcap {version('pycocoevalcap')}\n"
    )
    print("| metric | vltrain (s) | pycocoevalcap (s) | speedup | max abs diff |")
    print("|---|---:|---:|---:|---:|")
    for name, ours, ref, diff in rows:
        print(f"| {name} | {ours:.3f} | {ref:.3f} | {ref / ours:.1f}x | {diff:.1e} |")
    print("\nStored-df path (no pycocoevalcap equivalent; scores checked equal to the above):\n")
    print("| operation | vltrain (s) |")
    print("|---|---:|")
    print(f"| `CiderD(refs_corpus=gts)` (df built once) | {t_build:.3f} |")
    print(f"| `CiderD.score_many` ({len(cands)} captions) | {t_many:.3f} |")
    print(f"| `sentence_bleu` ({len(cands)} captions) | {t_sb:.3f} |")


if __name__ == "__main__":
    main()
