"""A run folder belongs to one run: what starting, resuming or starting over may do to it.

Decided before anything is written (every rank reads, rank 0 writes afterwards):

- a fresh run refuses a folder that already holds a run, unless ``train.overwrite=true``, which
  deletes that run's checkpoints, tokenizer, metrics and summary first;
- ``train.resume=true`` needs a checkpoint that loads (newer ones that do not are skipped and
  named), and a config equal to the run's saved config.yaml except for harmless keys and the
  keys listed in ``train.allow_changes`` (each change is logged); another global batch needs
  ``global_batch`` in that list; resuming a finished run is a no-op that says so.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vltrain.config.core import ConfigError, to_dict
from vltrain.config.schema import Config
from vltrain.core import checkpoint
from vltrain.engine import trackers

#: keys that may differ on resume without permission: they change neither the model, nor the
#: data order, nor the schedule (prefix match on the dotted key)
HARMLESS = (
    "log.",
    "tune.",
    "run.threads",
    "run.device",
    "data.num_workers",
    "data.eval_batch_size",
    "data.max_bad_fraction",
    "train.eval_every",
    "train.save_every",
    "train.keep_last",
    "train.log_every",
    "train.resume",
    "train.overwrite",
    "train.allow_changes",
    "train.max_consecutive_skips",
)
#: what a previous run leaves in its folder (train.overwrite deletes these)
RUN_FILES = (
    "checkpoints",
    "tokenizer",
    "metrics.jsonl",
    "summary.json",
    "tensorboard",
    trackers.IDS_FILE,
)


@dataclass
class RunPlan:
    """What Trainer.run will do with the folder."""

    resume_from: Path | None = None
    finished: bool = False
    messages: list[str] = field(default_factory=list)
    clear: list[Path] = field(default_factory=list)  # deleted by rank 0 before anything else


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = prefix + str(k)
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            sub = _flat(v, key + ".")
            out.update(sub if sub else {key: v})
        else:
            out[key] = v
    return out


def config_changes(saved: dict, new: dict) -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose value differs between two config trees: {key: (saved, new)}."""
    a, b = _flat(saved), _flat(new)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _holds_run(out: Path) -> list[str]:
    return [name for name in RUN_FILES if (out / name).exists()]


def check_data_files(cfg: Config) -> None:
    """Every data file the run reads (train, eval, test) exists and is not empty (hub ids:
    `vltrain.core.hub.check_sources`, at load)."""
    if not cfg.data.train:
        raise ConfigError("'data.train' is empty: name the training records (JSONL, ...)")
    for key in ("train", "eval", "test"):
        value = getattr(cfg.data, key)
        if not value:
            continue
        p = Path(value)
        if not p.exists() and ("://" in value and not value.startswith("file://")):
            continue  # tar shards or a hub dataset by URL: their reader and check_sources check
        if not p.exists():
            raise ConfigError(f"'data.{key}': {p} does not exist")
        if p.is_file() and not p.read_bytes()[:4096].strip():
            raise ConfigError(f"'data.{key}': {p} is empty")
        if p.is_dir() and not any(p.iterdir()):
            raise ConfigError(f"'data.{key}': {p} is an empty folder")


def plan_run(cfg: Config, world_size: int) -> RunPlan:
    """Check the folder and data against the config; raise ConfigError before anything is
    written."""
    check_data_files(cfg)
    out = Path(cfg.run.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run.out_dir={out} is a file, not a folder")
    if not cfg.train.resume:
        used = _holds_run(out)
        if used and not cfg.train.overwrite:
            raise ConfigError(
                f"run.out_dir={out} already holds a run ({', '.join(used)}); continue it with "
                f"`vltrain train {out / 'config.yaml'} train.resume=true`, or start over with "
                "train.overwrite=true (deletes its checkpoints, tokenizer and metrics), or pick "
                "another run.out_dir"
            )
        return RunPlan(clear=[out / name for name in used])
    return _plan_resume(cfg, out, world_size)


def _plan_resume(cfg: Config, out: Path, world_size: int) -> RunPlan:
    saved_path = out / "config.yaml"
    ckpt, skipped = checkpoint.newest_loadable(out / "checkpoints")
    if ckpt is None or not saved_path.is_file():
        what = "no checkpoint that loads" if saved_path.is_file() else "no config.yaml"
        raise ConfigError(
            f"train.resume=true but {out} holds {what} (wrong run.out_dir?); "
            + (" ".join(skipped) + "; " if skipped else "")
            + "drop train.resume to start a new run there"
        )
    saved = yaml.safe_load(saved_path.read_text()) or {}
    changes = config_changes(saved, to_dict(cfg))
    allowed = set(cfg.train.allow_changes)
    blocked = {
        k: v
        for k, v in changes.items()
        if not k.startswith(HARMLESS) and k not in allowed and k != "run.out_dir"
    }
    if blocked:
        lines = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in blocked.items())
        raise ConfigError(
            f"resuming {out} with a config that differs from its config.yaml: {lines}. Resume "
            f"with `vltrain train {saved_path} train.resume=true`, or allow the change "
            f"explicitly with train.allow_changes=[{', '.join(blocked)}]"
        )
    state = checkpoint.load_trainer_state(ckpt)
    old_global = saved.get("data", {}).get("batch_size", 0) * int(state.get("world_size", 1))
    new_global = cfg.data.batch_size * world_size
    if old_global != new_global and "global_batch" not in allowed:
        raise ConfigError(
            f"resuming {out} with a global batch of {new_global} (data.batch_size "
            f"{cfg.data.batch_size} x {world_size} processes) but it trained with {old_global}: "
            "the data order would skip or repeat samples. Keep data.batch_size x world size "
            "equal, or allow it with train.allow_changes=[global_batch]"
        )
    plan = RunPlan(resume_from=ckpt, messages=list(skipped))
    plan.messages += [
        f"resume: {k} changed {a!r} -> {b!r}"
        for k, (a, b) in changes.items()
        if k not in ("train.resume", "train.allow_changes", "train.overwrite")
    ]
    step = int(state.get("loop", {}).get("step", 0))
    plan.finished = step >= cfg.train.max_steps and (out / "summary.json").is_file()
    return plan


def apply_plan(plan: RunPlan) -> None:
    """Rank 0: delete what train.overwrite replaces."""
    for path in plan.clear:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
