"""Evidence for hard-negative training: hard-negative accuracy with and without negatives.

    python bench/hn_evidence.py --out runs/hn_evidence [--seeds 0 1 2] [--steps 1500] [--k 5]

The quickstart's CLIP stage (configs/quickstart.yaml as it ships: tiny_cnn image tower, one
causal text block pooled as the mean of its tokens, caption-caption InfoNCE 1.0, batch 128,
lr 1e-3; round 3 pooled the last token without the caption-caption term, and sessions before
it ran lr 2e-3, the 32-64-128 stem and two text blocks) on the quickstart's
synthetic data (`--n-train` train images, default the quickstart's 12,000; 300 val, 300 test),
trained from scratch for `--steps` steps per seed twice: without hard negatives and with
`objective.hard_negatives=k` (the synthetic records' attribute-swapped captions). Both arms then
evaluate their final weights on val and on the compositional test split: hard-negative accuracy
overall and per kind of swap (`hardneg_acc_<kind>`), and R@1. Prints a markdown table, per seed
and the mean over seeds. `--threads 1 --jobs 2` trains the two arms of a seed side by side (one
core each).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from vltrain.data.synth import synth_command
from vltrain.runs.quickstart import CONFIGS
from vltrain.tools.loading import load_trained

KINDS = ("color", "shape", "size", "relation")


def arm_args(data: Path, out: Path, seed: int, steps: int, k: int, threads: int) -> list[str]:
    """`vltrain train` arguments of one arm."""
    over = {
        "run.out_dir": out,
        "run.seed": seed,
        "run.threads": threads,
        "data.train": data / "train.jsonl",
        "data.eval": data / "val.jsonl",
        "data.test": data / "test.jsonl",
        "train.max_steps": steps,
        "optim.warmup_steps": min(50, steps // 2),  # the quickstart's 50 unless steps < 100
        "train.eval_every": steps,
        "train.save_every": steps,
        "objective.hard_negatives": k,
        "data.image_cache_mb": 256,  # decoded once per arm, as the quickstart does
        "log.progress": False,
    }
    cfg = CONFIGS / "quickstart.yaml"
    return ["train", str(cfg), *(f"{key}={v}" for key, v in over.items())]


def evaluate(run: Path, steps: int) -> dict[str, dict[str, float]]:
    """Metrics of the run's final weights on val and test."""
    _, stage, model = load_trained(run / "checkpoints" / f"step_{steps}")
    with torch.no_grad():
        return {split: stage.evaluate(model, split) for split in ("val", "test")}


def row(name: str, m: dict[str, dict[str, float]]) -> str:
    t, v = m["test"], m["val"]
    cells = [name, 100 * t["hardneg_acc"], *(100 * t[f"hardneg_acc_{k}"] for k in KINDS)]
    cells += [100 * v["hardneg_acc"], *(100 * v[f"hardneg_acc_{k}"] for k in KINDS)]
    cells += [100 * t["R@1_mean"], 100 * v["R@1_mean"]]
    return "| " + " | ".join(c if isinstance(c, str) else f"{c:.1f}" for c in cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/hn_evidence")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--n-train", type=int, default=12000, help="synthetic training images")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: default)")
    p.add_argument("--jobs", type=int, default=1, help="arms trained at once (1 or 2)")
    a = p.parse_args()
    out = Path(a.out)
    data = out / "data"
    if not (data / "test.jsonl").is_file():
        synth_command(str(data), a.n_train, 300, 300, 0, workers=2)
    results: dict[tuple[int, int], dict] = {}
    for seed in a.seeds:
        runs = {k: out / f"seed{seed}_hn{k}" for k in (0, a.k)}
        todo = [k for k, r in runs.items() if not (r / "summary.json").is_file()]
        cmds = [
            [sys.executable, "-m", "vltrain", *arm_args(data, runs[k], seed, a.steps, k, a.threads)]
            for k in todo
        ]
        for i in range(0, len(cmds), a.jobs):
            procs = [subprocess.Popen(c) for c in cmds[i : i + a.jobs]]
            if any(pr.wait() for pr in procs):
                raise SystemExit("a training run failed")
        for k, r in runs.items():
            results[(seed, k)] = evaluate(r, a.steps)
            (r / "hn_eval.json").write_text(json.dumps(results[(seed, k)], indent=1))
    head = ["run", "test overall", *KINDS, "val overall", *KINDS, "test R@1", "val R@1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (seed, k), m in sorted(results.items()):
        lines.append(row(f"seed {seed}, hard_negatives={k}", m))
    for k in (0, a.k):
        ms = [m for (_, kk), m in results.items() if kk == k]
        mean = {
            s: {key: statistics.mean(m[s][key] for m in ms) for key in ms[0][s]}
            for s in ("val", "test")
        }
        lines.append(row(f"**mean of {len(ms)} seed(s), hard_negatives={k}**", mean))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
