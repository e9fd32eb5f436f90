"""A run folder belongs to one run: what starting, resuming or starting over may do to it.

Decided before anything is written (every rank reads, rank 0 writes afterwards):

- a fresh run refuses a folder that already holds a run, unless ``train.overwrite=true``, which
  deletes that run's checkpoints, tokenizer, metrics and summary first;
- ``train.resume=true`` needs a checkpoint that loads (newer ones that do not are skipped and
  named), and a config equal to the run's saved config.yaml except for harmless keys and the
  keys listed in ``train.allow_changes`` (each change is logged; ``data.batch_size`` may change
  freely when the world size changes with it and the global batch stays); another global batch
  needs ``global_batch`` in that list; resuming a finished run is a no-op that says so;
- a folder a live process trains in (its ``train.lock`` names the host and pid) is refused;
  the lock of a dead process on this host is taken over, with a message.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from vltrain.config.core import ConfigError, to_dict
from vltrain.config.schema import Config
from vltrain.core import checkpoint
from vltrain.core.files import atomic_write_text
from vltrain.data.readers import DataError
from vltrain.data.shards import check_shard_source, is_shard_source, is_url
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
    "train.checkpoint_on",
    "train.log_every",
    "train.resume",
    "train.overwrite",
    "train.allow_changes",
    "train.max_consecutive_skips",
)
#: what a previous run leaves in its folder (train.overwrite deletes these)
DATA_RECORD = "data_version.json"
"""The training data file as the run first read it (`data_version`), checked on resume."""
RUN_FILES = (
    "checkpoints",
    "tokenizer",
    "metrics.jsonl",
    "summary.json",
    "tensorboard",
    trackers.IDS_FILE,
    DATA_RECORD,
)


def data_version(cfg: Config) -> dict[str, Any] | None:
    """The local training records file (a folder's captions file) as a run reads it: its
    size and the sha256 of its first and last MiB; None for shards (their resume checks the
    shard list), datasets folders and hub ids."""
    from vltrain.data.sources import captions_file

    p = Path(cfg.data.train)
    if p.is_dir():
        p = captions_file(p) or p
    if not p.is_file() or p.suffix.lower() not in (".jsonl", ".json", ".csv", ".parquet"):
        return None
    size = p.stat().st_size
    digest = hashlib.sha256()
    with p.open("rb") as f:
        digest.update(f.read(2**20))
        if size > 2**20:
            f.seek(max(size - 2**20, 2**20))
            digest.update(f.read())
    return {"file": str(p.resolve()), "size": size, "sha256_ends": digest.hexdigest()}


def record_data_version(cfg: Config, out: Path) -> None:
    """Rank 0 at a fresh start (and a resume allowed to change the data): `data_version`."""
    version = data_version(cfg)
    if version is not None:
        atomic_write_text(out / DATA_RECORD, json.dumps(version, indent=1) + "\n")


def _check_data_version(cfg: Config, out: Path) -> None:
    """A resume reads the records the run started with: a map-style sampler's positions are
    indices into them (an appended or edited file resumed silently into another run)."""
    record = out / DATA_RECORD
    now = data_version(cfg)
    if not record.is_file() or now is None or "data.train" in cfg.train.allow_changes:
        return
    was = json.loads(record.read_text())
    if was.get("size") != now["size"] or was.get("sha256_ends") != now["sha256_ends"]:
        raise ConfigError(
            f"resuming {out}, but data.train ({now['file']}) changed since the run started "
            f"({was.get('size')} -> {now['size']} bytes): the data order resumes by record "
            "index, so the run would go on over other records. Put the file back, start a new "
            "run, or allow it with train.allow_changes=[data.train]"
        )


@dataclass
class RunPlan:
    """What Trainer.run will do with the folder."""

    resume_from: Path | None = None
    finished: bool = False
    messages: list[str] = field(default_factory=list)
    clear: list[Path] = field(default_factory=list)  # deleted by rank 0 before anything else
    lock: Path | None = None  # created by rank 0 in apply_plan, removed by release_lock
    stale_lock: str | None = None  # the message apply_plan prints when it takes a lock over
    changed: list[str] = field(default_factory=list)  # keys train.allow_changes let change
    fresh: bool = False  # a new run: a refusal before its first step undoes what it wrote
    kept: frozenset[str] | None = None  # a fresh run's folder before it wrote (None: new)


#: the file that marks a run folder as in use: {"host", "pid"} of the training process
LOCK = "train.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def check_lock(out: Path) -> str | None:
    """Refuse a folder another live process trains in; a message when the lock is stale (a
    dead process on this host, or this process's own from an earlier run), else None."""
    path = out / LOCK
    try:
        holder = json.loads(path.read_text())
        host, pid = str(holder["host"]), int(holder["pid"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return f"{path} is unreadable; taking it over"
    if host == socket.gethostname() and (pid == os.getpid() or not _alive(pid)):
        return None if pid == os.getpid() else f"taking over {path}: process {pid} has ended"
    where = "on this host" if host == socket.gethostname() else f"on host {host}"
    raise ConfigError(
        f"{out} is in use: process {pid} {where} is training in it ({path}). Wait for it to "
        f"finish or stop it; if that process is gone, delete {path}"
    )


def release_lock(out: Path) -> None:
    """Remove this process's lock on `out` (called at the end of a run, also on errors)."""
    path = out / LOCK
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


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
        remote = is_url(value) or "{" in value or value.startswith("file://")
        if (remote or Path(value).is_dir()) and is_shard_source(value):
            # tar shards (a folder, a URL or a pattern): listed, the first one opened and read
            try:
                check_shard_source(value)
            except DataError as e:
                raise ConfigError(f"'data.{key}': {e}") from None
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
        if (why := holds_no_records(p)) is not None:
            raise ConfigError(f"'data.{key}': {p} holds no records ({why})")
        if (why := first_images_missing(p)) is not None:
            raise ConfigError(f"'data.{key}': {p}: {why}")
    check_step_fits(cfg)


def first_images_missing(p: Path, n: int = 8) -> str | None:
    """Why no image of a JSONL file's (or captions folder's) first `n` image-text records
    exists, else None: paths relative to the wrong folder are found before anything trains
    (an evaluation set of such records failed at its first evaluation, the steps before it
    lost). Reads `n` lines; other formats are left to their readers."""
    from vltrain.data.images import BadSample
    from vltrain.data.readers import resolve_image_path
    from vltrain.data.sources import captions_file

    if p.is_dir():
        p = captions_file(p) if not (p / "state.json").is_file() else None  # type: ignore[assignment]
    if p is None or p.suffix.lower() != ".jsonl":
        return None
    images = []
    with p.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                return None  # a structural error: the reader names its line
            if not isinstance(rec, dict) or not isinstance(rec.get("image"), str):
                return None
            images.append(rec["image"])
            if len(images) == n:
                break
    found = []
    for rel in images:
        with contextlib.suppress(BadSample):
            found.append(resolve_image_path(p, rel).is_file())
    if not images or any(found) or len(found) < len(images):  # a path_escape: counted later
        return None
    return (
        f"none of the images of its first {len(images)} records exists (the first, "
        f"{images[0]!r}, is not at {resolve_image_path(p, images[0])}); image paths are read "
        "relative to the file's folder"
    )


def holds_no_records(p: Path) -> str | None:
    """Why a CSV, COCO json, parquet file or captions folder that is not empty holds no
    record (a header alone, empty 'images', zero rows), else None; cheap reads only (a COCO
    file over 64 MB is left to its reader). An empty eval set trained the whole run and then
    failed at its first evaluation."""
    from vltrain.data.sources import captions_file

    if p.is_dir():
        captions = captions_file(p) if not (p / "state.json").is_file() else None
        return holds_no_records(captions) if captions is not None else None
    suffix = p.suffix.lower()
    if suffix == ".csv":
        with p.open("rb") as f:
            lines = (line for line in f if line.strip())
            return (
                "a header and no rows" if next(lines, None) and next(lines, None) is None else None
            )
    if suffix == ".parquet":
        with contextlib.suppress(Exception):  # not readable here: its reader says why
            import pyarrow.parquet as pq

            return "zero rows" if pq.ParquetFile(p).metadata.num_rows == 0 else None
        return None
    if suffix == ".json" and p.stat().st_size < 64 * 2**20:
        with contextlib.suppress(ValueError, OSError):
            coco = json.loads(p.read_text(encoding="utf-8"))
            if isinstance(coco, dict) and isinstance(coco.get("images"), list):
                if not coco["images"]:
                    return "an empty 'images' list"
                if not coco.get("annotations"):
                    return "no 'annotations' (captions)"
    return None


def check_step_fits(cfg: Config) -> None:
    """Refuse an optimizer step that would hold more micro-batches than the training records
    (a local JSONL file) fill: the loop keeps a step's micro-batches in memory, so
    `optim.accum_steps=100000` grew without bound instead of failing."""
    need = cfg.optim.accum_steps * cfg.data.batch_size
    p = Path(cfg.data.train)
    if cfg.optim.accum_steps == 1 or p.suffix != ".jsonl" or not p.is_file():
        return
    with open(p, "rb") as f:
        n = 0
        for line in f:
            n += bool(line.strip())
            if n >= need:
                return  # counted only as far as one step needs
    most = max(1, n // cfg.data.batch_size)
    raise ConfigError(
        f"optim.accum_steps={cfg.optim.accum_steps} x data.batch_size={cfg.data.batch_size} = "
        f"{need} samples per optimizer step, more than the {n} records in {p}: one step would "
        f"hold records more than once. Lower optim.accum_steps to at most {most}"
    )


def plan_run(cfg: Config, world_size: int) -> RunPlan:
    """Check the folder and data against the config; raise ConfigError before anything is
    written."""
    out = Path(cfg.run.out_dir)
    plan = _plan(cfg, out, world_size)
    plan.lock = out / LOCK
    return plan


def _plan(cfg: Config, out: Path, world_size: int) -> RunPlan:
    check_data_files(cfg)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run.out_dir={out} is a file, not a folder")
    stale = check_lock(out)
    plan = _plan_resume(cfg, out, world_size) if cfg.train.resume else _plan_fresh(cfg, out)
    plan.stale_lock = stale
    return plan


def _plan_fresh(cfg: Config, out: Path) -> RunPlan:
    used = _holds_run(out)
    if used and not cfg.train.overwrite:
        if checkpoint.newest_loadable(out / "checkpoints")[0] is None:  # nothing to resume
            raise ConfigError(
                f"run.out_dir={out} already holds a run that saved no checkpoint "
                f"({', '.join(used)}); start over with train.overwrite=true (deletes its "
                "metrics and tokenizer), or pick another run.out_dir"
            )
        raise ConfigError(
            f"run.out_dir={out} already holds a run ({', '.join(used)}); continue it with "
            f"`vltrain train {out / 'config.yaml'} train.resume=true`, or start over with "
            "train.overwrite=true (deletes its checkpoints, tokenizer and metrics), or pick "
            "another run.out_dir"
        )
    return RunPlan(clear=[out / name for name in used], fresh=True)


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
    state = checkpoint.load_trainer_state(ckpt)
    old_global = saved.get("data", {}).get("batch_size", 0) * int(state.get("world_size", 1))
    new_global = cfg.data.batch_size * world_size
    if "data.batch_size" in changes and old_global == new_global:
        allowed.add("data.batch_size")  # another world size, the same global batch and order
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
    _check_data_version(cfg, out)
    if old_global != new_global and "global_batch" not in allowed:
        raise ConfigError(
            f"resuming {out} with a global batch of {new_global} (data.batch_size "
            f"{cfg.data.batch_size} x {world_size} processes) but it trained with {old_global}: "
            "the data order would skip or repeat samples. Keep data.batch_size x world size "
            "equal, or allow it with train.allow_changes=[global_batch]"
        )
    plan = RunPlan(resume_from=ckpt, messages=list(skipped))
    plan.changed = sorted(k for k in changes if k in allowed)
    plan.messages += [
        f"resume: {k} changed {a!r} -> {b!r}"
        for k, (a, b) in changes.items()
        if k not in ("train.resume", "train.allow_changes", "train.overwrite")
    ]
    step = int(state.get("loop", {}).get("step", 0))
    plan.finished = step >= cfg.train.max_steps and (out / "summary.json").is_file()
    return plan


def check_changed_model(model: torch.nn.Module, plan: RunPlan) -> None:
    """Refuse a resume whose allowed changes (`plan.changed`) give a model the checkpoint
    cannot fill (other parameter names or shapes), before config.yaml records them."""
    assert plan.resume_from is not None
    diffs = checkpoint.mismatched_keys(model, plan.resume_from)
    if diffs:
        keys = ", ".join(plan.changed)
        raise ConfigError(
            f"train.allow_changes=[{keys}] changes the model, and the checkpoint "
            f"{plan.resume_from} does not fit it: {'; '.join(diffs[:4])}"
            + (f" (and {len(diffs) - 4} more)" if len(diffs) > 4 else "")
            + ". Resume without changing those keys, or start a new run in another "
            f"run.out_dir with model.init_from={plan.resume_from.parent.parent}"
        )


def _create_lock(path: Path) -> None:
    """Create `path` exclusively (O_EXCL): of two processes starting on one folder at once,
    one creates it and the other is refused by `check_lock`."""
    holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n"
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        check_lock(path.parent)  # another live process won the race: refused here
        path.unlink(missing_ok=True)  # this process's own, or a dead process's
        fd = os.open(path, flags, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(holder)


def apply_plan(plan: RunPlan) -> None:
    """Rank 0: lock the folder, then delete what train.overwrite replaces."""
    if plan.fresh and plan.lock is not None and plan.lock.parent.is_dir():
        kept = set(os.listdir(plan.lock.parent)) - {p.name for p in plan.clear} - {LOCK}
        plan.kept = frozenset(kept)
    if plan.lock is not None:
        plan.lock.parent.mkdir(parents=True, exist_ok=True)
        if plan.stale_lock:
            print(f"vltrain: {plan.stale_lock}", flush=True)
            plan.lock.unlink(missing_ok=True)  # a dead process's, checked in plan_run
        _create_lock(plan.lock)
        atexit.register(release_lock, plan.lock.parent)  # a process that dies of an error
    for path in plan.clear:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    if plan.lock is not None:  # ours now: what a killed process left half-written goes
        plan.messages += clean_stale(plan.lock.parent)


def clean_stale(out: Path) -> list[str]:
    """Remove the temp folders and files a killed or failed write left in the run folder
    `out` (checkpoint and best temp copies, `.metrics.jsonl.*.tmp`, `config.yaml.tmp`), so
    they do not keep the disk full; returns what it did."""
    done = checkpoint.clean_stale(out / "checkpoints")
    for p in [*out.glob(".*.tmp"), out / "config.yaml.tmp"]:
        if p.is_file():
            p.unlink()
            done.append(f"removed {p}, left by a killed or failed write")
    return done


def undo_fresh(plan: RunPlan) -> None:
    """Rank 0, a new run refused before its first step (a data file, a model option, a
    backbone that does not fit the config): remove what it wrote (config.yaml, the tokenizer,
    the lock; the folder itself when it made it), so that the corrected command starts there
    without ``train.overwrite``. A resumed run's folder is never touched."""
    if not plan.fresh or plan.lock is None or not plan.lock.parent.is_dir():
        return
    out = plan.lock.parent
    for path in out.iterdir():
        if plan.kept is not None and path.name in plan.kept:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if plan.kept is None:
        with contextlib.suppress(OSError):
            out.rmdir()
