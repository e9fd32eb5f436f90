"""Memory flat in batch x negatives (issue 54, item 6): the peak RSS of a whole `vltrain train`
process at global batch 16, 64 and 256, each query with 5 page hard negatives, at a fixed
GradCache chunk, on a tiny random Qwen3-VL; the same without GradCache as the control.

Each run is `python -m vltrain train configs/qwen3vl_embed_pages.yaml` in a fresh process (the
preset: LoRA, text query -> page image, 5 image negatives per query; here fp32, 1 thread, no
loader workers so the whole pipeline lives in the process measured, no eval) on synthetic
pages (`vltrain data synth pages`, 32 px, 4 visual tokens per page), `--steps` steps. Peak
RSS is the process's ru_maxrss from `os.wait4` (everything: interpreter, torch, the model,
the data, the collated batch, the step). Reported: the median of `--repeats` runs and its
growth over batch 16.

    PYTHONPATH=. python bench/bench_memory_flat.py [--chunk 4] [--steps 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures import make_tiny_qwen3vl
from vltrain.data.synth_pages import pages_command

REPO = Path(__file__).resolve().parents[1]
NEGATIVES = 5
BATCHES = (16, 64, 256)


def peak_rss(model: str, pages: Path, out: Path, batch: int, chunk: int, steps: int) -> tuple:
    """(peak RSS MiB, wall seconds) of one training run in a fresh process."""
    over = {
        "run.out_dir": out,
        "run.precision": "fp32",
        "run.threads": 1,
        "model.path": model,
        "model.lora_r": 4,
        "model.lora_alpha": 8,
        "data.train": pages / "train.jsonl",
        "data.eval": "",
        "data.test": "",
        "data.batch_size": batch,
        "data.num_workers": 0,
        "data.max_visual_tokens": 4,
        "data.max_text_len": 16,
        "objective.hard_negatives": NEGATIVES,
        "objective.grad_cache_chunk": chunk,
        "train.max_steps": steps,
        "train.save_every": 0,
        "train.eval_every": 0,
        "train.best_metric": "",
        "optim.warmup_steps": 0,
        "log.progress": False,
        "log.tensorboard": False,
    }
    cmd = [sys.executable, "-m", "vltrain", "train", "configs/qwen3vl_embed_pages.yaml"]
    cmd += [f"{k}={v}" for k, v in over.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"run failed (batch {batch}, chunk {chunk}):\n{err[-3000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - t  # Linux: KiB


def run(chunk: int, steps: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = make_tiny_qwen3vl(root / "model")
        pages = root / "pages"
        pages_command(
            str(pages),
            n_train=max(BATCHES) * steps,
            n_val=0,
            n_test=0,
            seed=0,
            image_size=32,
            negatives=NEGATIVES,
            distractors=0,
        )
        results: dict[tuple[int, int], list[tuple[float, float]]] = {}
        plan = [(b, chunk) for b in BATCHES] + [(b, 0) for b in (BATCHES[0], BATCHES[-1])]
        for i in range(repeats):  # alternated: a drifting machine hits every setting alike
            for b, c in plan:
                r = peak_rss(model, pages, root / f"run_{b}_{c}_{i}", b, c, steps)
                results.setdefault((b, c), []).append(r)
                print(f"batch {b} chunk {c}: {r[0]:.1f} MiB, {r[1]:.1f} s", file=sys.stderr)
    cpu = _cpu()
    load = os.getloadavg()[0]
    print(
        f"\nmachine: {cpu}, 1 thread; load average at the end {load:.1f}; "
        f"{datetime.date.today()}; {platform.python_version()}; tiny random Qwen3-VL (hidden 32), "
        f"LoRA r4, {NEGATIVES} page negatives per query, {steps} steps, fp32\n"
        f"command: PYTHONPATH=. python bench/bench_memory_flat.py --chunk {chunk} "
        f"--steps {steps} --repeats {repeats}\n"
    )
    print("| global batch | pages per step | GradCache chunk | peak RSS (median) | vs batch 16 |")
    print("|---|---|---|---|---|")
    for c in (chunk, 0):
        base = statistics.median(m for m, _ in results[(BATCHES[0], c)])
        for b in BATCHES:
            if (b, c) not in results:
                continue
            mib = statistics.median(m for m, _ in results[(b, c)])
            secs = statistics.median(s for _, s in results[(b, c)])
            print(
                f"| {b} | {b * (1 + NEGATIVES)} | {c or 'none (control)'} | {mib:.1f} MiB "
                f"({secs:.0f} s run) | {100 * (mib / base - 1):+.1f}% |"
            )


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.machine()
    names = [x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("Model name")]
    return names[0] if names else platform.machine()


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=4, help="GradCache chunk (sequences)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    run(args.chunk, args.steps, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
