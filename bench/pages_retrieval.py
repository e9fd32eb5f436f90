"""Synthetic page-screenshot retrieval: text query -> page image, image hard negatives vs none.

    python bench/pages_retrieval.py --out bench/out/pages --seeds 0 1 2
        # the preset as shipped (the word-pair head, batch 32, lr 4e-3, 3,200 steps) on 50,000
        # training records (one hard-negative page each) and 10,600-page held-out corpora:
        # ~14 min per run without hard negatives, ~1.9x that with (AMD EPYC, 2 cores)
    python bench/pages_retrieval.py --out bench/out/pages_small --n-train 3000 --distractors 1000 \
        --steps 300 --seeds 0   # a quick look

Writes the data once (`vltrain data synth --kind pages`), then per seed trains configs/pages.yaml
with objective.hard_negatives=0 and =1 and prints the test metrics as a markdown table (R@1, R@5,
R@1 of title and of body-phrase queries, chance R@1, held-out hard-negative accuracy), with the
validation learning curve, then R@1 by query group and font size (what limits the reader).
Options left unset keep the preset's values.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from vltrain.config import load_config
from vltrain.diagnostics.card import cpu_model

ROOT = Path(__file__).resolve().parents[1]


def vltrain(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "vltrain", *args], check=True, cwd=ROOT)


def by_font(ranks: Path, queries: Path) -> dict[tuple[str, int], list[int]]:
    """Per-query ranks (`eval_ranks_*.jsonl`) grouped by the query's group and font size."""
    meta = {q["_id"]: q for q in map(json.loads, queries.read_text().splitlines())}
    out: dict[tuple[str, int], list[int]] = defaultdict(list)
    for row in map(json.loads, ranks.read_text().splitlines()):
        q = meta[row["query"]]
        out[(q.get("group", "-"), int(q.get("font_px", 0)))].append(row["rank"])
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/out/pages")
    p.add_argument("--n-train", type=int, default=50000)
    p.add_argument("--n-eval", type=int, default=300)
    p.add_argument("--distractors", type=int, default=10000)
    p.add_argument("--steps", type=int, default=0, help="0: the preset's")
    p.add_argument("--batch-size", type=int, default=0, help="0: the preset's")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--evals", type=int, default=2, help="validation points on the curve")
    p.add_argument("--lr", type=float, default=0.0, help="0: the preset's")
    a = p.parse_args()
    out = (ROOT / a.out).resolve()
    data = out / "data"
    t0 = time.perf_counter()
    if not (data / "train.jsonl").is_file():
        vltrain(
            "data",
            "synth",
            "--kind",
            "pages",
            "--out",
            str(data),
            "--n-train",
            str(a.n_train),
            "--n-val",
            str(a.n_eval),
            "--n-test",
            str(a.n_eval),
            "--distractors",
            str(a.distractors),
            "--negatives",
            "1",
        )
    synth_s = time.perf_counter() - t0
    optional = [f"optim.lr={a.lr}"] if a.lr else []
    optional += [f"data.batch_size={a.batch_size}"] if a.batch_size else []
    if a.steps:  # a shorter schedule warms up for a tenth of it at most
        optional += [f"train.max_steps={a.steps}"]
        optional += [f"optim.warmup_steps={min(200, a.steps // 10)}"]
    steps = a.steps or load_config(ROOT / "configs" / "pages.yaml").train.max_steps
    rows = []
    for seed in a.seeds:
        for hn in (0, 1):
            run = out / f"seed{seed}_hn{hn}"
            t = time.perf_counter()
            vltrain(
                "train",
                "configs/pages.yaml",
                f"run.out_dir={run}",
                f"run.seed={seed}",
                f"data.train={data}/train.jsonl",
                f"data.eval={data}/val",
                f"data.test={data}/test",
                f"objective.hard_negatives={hn}",
                f"train.eval_every={max(steps // a.evals, 1)}",
                f"train.save_every={steps}",
                f"run.threads={a.threads}",
                "log.progress=false",
                "log.tensorboard=false",
                *optional,
            )
            wall = time.perf_counter() - t
            hist = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            evals = [r for r in hist if "eval_R@1" in r]
            test = [r for r in hist if "test_R@1" in r]
            final = {k[5:]: v for k, v in (test[-1] if test else evals[-1]).items() if "_" in k}
            curve = " ".join(f"{r['step']}:{r['eval_R@1']:.3f}" for r in evals)
            split = "test" if test else "val"
            fonts = by_font(run / f"eval_ranks_{split}.jsonl", data / split / "queries.jsonl")
            rows.append((seed, hn, final, curve, wall, fonts))
    cpu = cpu_model()
    print(
        f"\nCPU: {cpu}; torch {torch.__version__}; synth {synth_s:.0f} s; "
        f"{a.n_train} train pages, corpus {int(rows[0][2].get('n_docs', 0))} docs"
    )
    print(
        "| seed | hard negatives | R@1 | R@5 | R@1 title | R@1 body | chance R@1 | hard-neg acc "
        "| train s | val R@1 curve |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed, hn, m, curve, wall, _ in rows:
        print(
            f"| {seed} | {hn} | {m.get('R@1', 0):.3f} | {m.get('R@5', 0):.3f} | "
            f"{m.get('R@1_title', 0):.3f} | {m.get('R@1_body', 0):.3f} | "
            f"{m.get('chance_R@1', 0):.4f} | {m.get('hardneg_acc', 0):.3f} | {wall:.0f} | {curve} |"
        )
    keys = sorted({k for *_, fonts in rows for k in fonts})
    print("\nR@1 by query group and font size (px), pooled over the runs above:")
    print("| group | font px | queries per run | R@1 |")
    print("|---|---|---|---|")
    for key in keys:
        ranks = [r for *_, fonts in rows for r in fonts.get(key, [])]
        r1 = sum(r == 1 for r in ranks) / len(ranks)
        print(f"| {key[0]} | {key[1]} | {len(ranks) // len(rows)} | {r1:.3f} |")


if __name__ == "__main__":
    main()
