"""`vltrain scaling sweep`: an isoFLOP grid of ordinary vltrain runs, one folder each.

Per budget C (`train.max_flops`) and per size (`vltrain.scaling.sizes`), one run in
``OUT/C<budget>_<LxW>/`` through :func:`vltrain.runs.train`. Resumable: a run with a
``summary.json`` is finished and skipped, a run with a checkpoint that loads is continued with
``train.resume=true``, a folder with only leftovers (killed before its first checkpoint)
starts over with ``train.overwrite=true``. The results table is ``OUT/runs.csv`` (columns
budget, size, params, tokens, flops, loss, steps, run) and ``OUT/sweep.json`` records how the
runs were made (for `vltrain scaling fit --predict`).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vltrain.config.core import ConfigError
from vltrain.core import checkpoint
from vltrain.scaling.budget import config_flops, resolve_budget, samples_per_step
from vltrain.scaling.sizes import Size
from vltrain.stages import load_run_config

#: stage -> the dotted keys one Size sets (the part of the model the sweep scales)
SIZE_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "caption": (("model.text_layers", "layers"), ("model.text_width", "width")),
    "contrastive": (
        ("model.vision_layers", "layers"),
        ("model.vision_width", "width"),
        ("model.text_layers", "layers"),
        ("model.text_width", "width"),
    ),
}
COLUMNS = ("budget", "size", "params", "tokens", "flops", "loss", "steps", "seed", "run")


@dataclass
class SweepRun:
    budget: float
    size: Size
    folder: Path
    seed: int | None = None  # None: the config's run.seed


def run_folder(out: Path, budget: float, size: Size, seed: int | None = None) -> Path:
    tail = "" if seed is None else f"_s{seed}"
    return out / f"C{budget:.3g}_{size.label}{tail}".replace("+", "")


def size_overrides(stage: str, size: Size) -> list[str]:
    if stage not in SIZE_KEYS:
        raise ConfigError(f"scaling sweep trains stages {sorted(SIZE_KEYS)}, not {stage!r}")
    return [f"{key}={getattr(size, attr)}" for key, attr in SIZE_KEYS[stage]]


def run_overrides(base: list[str], stage: str, run: SweepRun) -> list[str]:
    seed = [] if run.seed is None else [f"run.seed={run.seed}"]
    return [
        *base,
        *size_overrides(stage, run.size),
        f"train.max_flops={run.budget!r}",
        f"run.out_dir={run.folder}",
        *seed,
    ]


def folder_state(folder: Path) -> str:
    """'finished', 'resume' (a checkpoint loads), 'fresh' (empty) or 'restart' (leftovers)."""
    if (folder / "summary.json").is_file():
        return "finished"
    ckpt, _ = checkpoint.newest_loadable(folder / "checkpoints")
    if ckpt is not None and (folder / "config.yaml").is_file():
        return "resume"
    return "restart" if folder.is_dir() and any(folder.iterdir()) else "fresh"


def result_row(cfg: Any, run: SweepRun, summary: dict[str, Any]) -> dict[str, Any]:
    """One line of runs.csv: N (trainable non-embedding), D (text tokens), counted FLOPs."""
    acct = config_flops(cfg)
    samples = summary["steps"] * samples_per_step(cfg)
    val = summary.get("val") or {}
    if "eval_loss" not in val:
        raise ConfigError(f"{run.folder}: its summary has no eval_loss (set data.eval)")
    return {
        "budget": run.budget,
        "size": run.size.label,
        "params": acct.trainable_nonembed_params,
        "tokens": samples * acct.text_tokens,
        "flops": samples * acct.per_sample,
        "loss": val["eval_loss"],
        "steps": summary["steps"],
        "seed": cfg.run.seed,
        "run": str(run.folder),
    }


def sweep(
    config: str,
    overrides: list[str],
    budgets: list[float],
    sizes: list[Size],
    out: Path,
    train_fn: Callable[[Any], dict[str, Any]] | None = None,
    log: Callable[[str], None] = print,
    jobs: int = 1,
    seeds: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Train (or pick up) every budget x size run; write OUT/runs.csv; return its rows.
    `jobs` > 1 trains the runs as that many concurrent processes (set `run.threads` so
    jobs x threads fits the cores); the rows are the same as one at a time. `seeds`: every
    point once per seed (`run.seed`, folders `..._s<seed>`), to measure seed-to-seed noise."""
    from vltrain.runs import train

    train_fn = train_fn or train
    out.mkdir(parents=True, exist_ok=True)
    stage = load_run_config(config, overrides).stage
    (out / "sweep.json").write_text(
        json.dumps(
            {
                "config": str(Path(config).resolve()),
                "overrides": overrides,
                "stage": stage,
                "budgets": budgets,
                "sizes": [s.label for s in sizes],
                "seeds": None if seeds is None else list(seeds),
            },
            indent=2,
        )
    )
    runs = [
        SweepRun(c, s, run_folder(out, c, s, seed), seed)
        for c in budgets
        for s in sizes
        for seed in (seeds if seeds is not None else [None])
    ]
    checked = []
    for run in runs:  # every config checked (and its step count resolved) before any compute
        cfg = load_run_config(config, run_overrides(overrides, stage, run))
        checked.append(resolve_budget(cfg))
    if jobs > 1:
        _train_in_processes(config, overrides, stage, runs, checked, jobs, log)
    rows = []
    for run, cfg in zip(runs, checked, strict=True):
        state = folder_state(run.folder)
        log(f"scaling sweep: {run.folder.name}: {state} ({cfg.train.max_steps} steps)")
        if state == "finished":
            summary = json.loads((run.folder / "summary.json").read_text())
        else:
            args = run_overrides(overrides, stage, run) + _flags(state)
            summary = train_fn(load_run_config(config, args))
        rows.append(result_row(cfg, run, summary))
        write_csv(out / "runs.csv", rows)
    return rows


def _flags(state: str) -> list[str]:
    return {"resume": ["train.resume=true"], "restart": ["train.overwrite=true"]}.get(state, [])


def _train_in_processes(
    config: str,
    overrides: list[str],
    stage: str,
    runs: list[SweepRun],
    checked: list[Any],
    jobs: int,
    log: Callable[[str], None],
) -> None:
    """Train the unfinished runs as `vltrain train` processes, `jobs` at a time, largest
    budget first (the longest runs start first, so the last ones to finish are short). Each
    run is the same deterministic run as in-process (its own process, its own seed and
    `run.threads`); a failed run stops the sweep after the running ones finish."""
    pending = [
        (run, cfg)
        for run, cfg in zip(runs, checked, strict=True)
        if folder_state(run.folder) != "finished"
    ]
    pending.sort(key=lambda rc: -rc[0].budget)  # stable: sizes keep their order
    running: list[tuple[SweepRun, subprocess.Popen]] = []
    failed: list[str] = []
    while pending or running:
        while pending and len(running) < jobs and not failed:
            run, cfg = pending.pop(0)
            state = folder_state(run.folder)
            log(f"scaling sweep: {run.folder.name}: {state} ({cfg.train.max_steps} steps), "
                f"in a process")  # fmt: skip
            run.folder.mkdir(parents=True, exist_ok=True)
            args = [sys.executable, "-m", "vltrain", "train", config,
                    *run_overrides(overrides, stage, run), *_flags(state)]  # fmt: skip
            with open(run.folder / "sweep_process.log", "ab") as logf:
                running.append((run, subprocess.Popen(args, stdout=logf, stderr=logf)))
        if not pending or failed or len(running) >= jobs:
            time.sleep(0.2)
        for run, proc in list(running):
            if proc.poll() is not None:
                running.remove((run, proc))
                if proc.returncode != 0:
                    failed.append(f"{run.folder} (exit {proc.returncode}; see its "
                                  "sweep_process.log)")  # fmt: skip
        if failed and not running:
            pending.clear()
    if failed:
        raise ConfigError("scaling sweep: runs failed: " + "; ".join(failed))


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def predicted_config(sweep_dir: Path, n_opt: float, budget: float, target: Path) -> Size:
    """Write the config of the size nearest `n_opt` at `budget` (same base as the sweep).

    N counts what the sweep varies plus what it holds fixed (the connector): that fixed part
    is the median of (N - the blocks' params) over the sweep's runs and is subtracted before
    a size is picked. The size stays in the family the sweep measured: when every swept size
    has the same depth, the width (a multiple of 16) nearest in log N at that depth; else the
    size rule (vltrain.scaling.sizes) picks depth and width.
    """
    from statistics import median

    from vltrain.config.schema import dump_config
    from vltrain.scaling.sizes import parse_size, size_for_params, width_for_params

    meta = json.loads((sweep_dir / "sweep.json").read_text())
    with open(sweep_dir / "runs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    swept = [parse_size(r["size"]) for r in rows]
    fixed = median(float(r["params"]) - s.block_params for r, s in zip(rows, swept, strict=True))
    want = max(n_opt - fixed, 1.0)
    depths = {s.layers for s in swept}
    size = width_for_params(want, depths.pop()) if len(depths) == 1 else size_for_params(want)
    run = SweepRun(budget, size, run_folder(sweep_dir, budget, size))
    cfg = load_run_config(meta["config"], run_overrides(meta["overrides"], meta["stage"], run))
    target.parent.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, target)
    return size
