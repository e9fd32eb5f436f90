"""End to end: test metrics of a CLIP run on leaked data, on the curated data, and on the clean
data (the same train set without its planted records).

`vltrain data synth --leak-rate L` copies test records (exact, JPEG, resized or flipped image;
caption kept or edited) into train. A model trained on that train set has seen test pairs, so
its test retrieval is inflated; `vltrain data curate --against val test` removes the copies and
the curated run should report what the clean run reports.

    PYTHONPATH=. python bench/bench_curation_e2e.py [--steps 300] [--n-train 1200] [--leak 1.0]
        [--batch 64] [--runs leaked,curated,clean]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from vltrain.config import load_config
from vltrain.curation.curate import curate
from vltrain.data.synth import write_shapes_dataset
from vltrain.runs import train

_METRICS = ("i2t_R@1", "t2i_R@1", "i2t_R@5", "t2i_R@5", "hardneg_acc")


def _overrides(d: Path, train_file: Path, out: Path, steps: int, batch: int) -> list[str]:
    base = {
        "run.out_dir": out,
        "data.train": train_file,
        "data.eval": d / "val.jsonl",
        "data.test": d / "test.jsonl",
        "data.batch_size": batch,
        "data.num_workers": 0,
        "data.image_size": 64,
        "train.max_steps": steps,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.log_every": 50,
        "optim.warmup_steps": min(30, steps),
        "optim.lr": 2e-3,
        "log.progress": False,
        "log.tensorboard": False,
    }
    return [f"{k}={v}" for k, v in base.items()]


def _run(d: Path, train_file: Path, out: Path, steps: int, batch: int) -> dict:
    t0 = time.perf_counter()
    summary = train(
        load_config("configs/quickstart.yaml", _overrides(d, train_file, out, steps, batch))
    )
    test = summary.get("test", {})
    return {k: test.get(k) for k in test} | {"seconds": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--n-train", type=int, default=1200)
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--leak", type=float, default=1.0, help="--leak-rate of the synth data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--runs", default="leaked,curated,clean", help="which train sets to train on")
    a = p.parse_args()
    torch.set_num_threads(2)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln), "?"
    )
    print(f"CPU: {cpu}; Python {platform.python_version()}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "data"
        write_shapes_dataset(
            d, n_train=a.n_train, n_val=100, n_test=a.n_test, seed=a.seed, leak_rate=a.leak
        )
        lines = (d / "train.jsonl").read_text().splitlines(keepends=True)
        clean = d / "train_clean.jsonl"
        clean.write_text("".join(x for x in lines if '"planted"' not in x))
        cur = d / "train_curated.jsonl"
        s = curate(d / "train.jsonl", cur, [d / "val.jsonl", d / "test.jsonl"])
        removed = [json.loads(x) for x in (d / "train_curated.removed.jsonl").open()]
        leaks_left = sum('"planted"' in x for x in cur.read_text().splitlines())
        print(
            f"train {len(lines)} records ({len(lines) - len(clean.read_text().splitlines())} "
            f"planted test copies); curate removed {s['removed']} "
            f"({sum('planted' in r['record'] for r in removed)} planted), "
            f"planted left in curated: {leaks_left}; reasons {s['removed_by_reason']}"
        )
        rows = {}
        sets = {"leaked": d / "train.jsonl", "curated": cur, "clean": clean}
        for name in a.runs.split(","):
            f = sets[name]
            rows[name] = _run(d, f, Path(tmp) / name, a.steps, a.batch)
            print(name, json.dumps(rows[name]))
    first = next(iter(rows.values()))
    keys = [k for k in _METRICS if k in first]
    print(f"\n| train set ({a.steps} steps, tiny CLIP) | " + " | ".join(f"test {k}" for k in keys)
          + " | s |")  # fmt: skip
    print("|---" * (len(keys) + 2) + "|")
    for name, r in rows.items():
        vals = " | ".join(f"{r[k]:.3f}" for k in keys)
        print(f"| {name} | {vals} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
