"""Atomic checkpoints: weights in safetensors, trainer state loadable with weights_only=True.

Layout: `<out>/checkpoints/step_<N>/{model.safetensors, trainer_state.pt, COMPLETE}` (a
sharded checkpoint, train.parallel=fsdp, holds `shards/`, torch.distributed.checkpoint files of
weights and optimizer state, instead of `model.safetensors`; `vltrain export` consolidates) and
`<out>/checkpoints/best/` (a copy, with `best.json`). A checkpoint is written into a temp
folder, fsynced, then renamed into place, so a kill at any moment leaves every previously
complete checkpoint intact; the loader only considers folders holding the COMPLETE marker.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from vltrain.core import distributed
from vltrain.core.files import is_write_failure, write_failure

STEP_DIR = re.compile(r"^step_(\d+)$")
MARKER = "COMPLETE"
SHARDS = "shards"  # torch.distributed.checkpoint folder of a sharded checkpoint


def shards_of(ckpt: Path) -> Path:
    return ckpt / SHARDS


def is_sharded(ckpt: Path) -> bool:
    """True for a sharded (torch.distributed.checkpoint) checkpoint folder."""
    return (ckpt / SHARDS / ".metadata").is_file()


def has_weights(ckpt: Path) -> bool:
    return (ckpt / "model.safetensors").is_file() or is_sharded(ckpt)


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read; the message names the file and why."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as tensors/ints (weights_only-loadable)."""
    version, py_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "py_version": version,
        "py_state": torch.tensor(py_state, dtype=torch.int64),
        "py_gauss": gauss,
        "np_name": np_name,
        "np_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "np_pos": int(np_pos),
        "np_has_gauss": int(np_has_gauss),
        "np_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `rng_state`."""
    py = tuple(int(v) for v in state["py_state"].tolist())
    random.setstate((state["py_version"], py, state["py_gauss"]))
    keys = state["np_keys"].numpy().astype(np.uint32)
    np.random.set_state(
        (state["np_name"], keys, state["np_pos"], state["np_has_gauss"], state["np_gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_checkpoint(
    ckpt_root: Path,
    step: int,
    model: torch.nn.Module,
    trainer_state: dict[str, Any],
    extra_files: dict[str, Path] | None = None,
    writer: Callable[[Path], None] | None = None,
) -> Path:
    """Write `step_<step>` atomically and return its path. Rank 0 only."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_root / f".tmp_step_{step}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    with _cleaned_on_failure(tmp, ckpt_root / f"step_{step}"):
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(trainer_state, tmp / "trainer_state.pt")
        copy_files(extra_files or {}, tmp)
        if writer is not None:  # e.g. an HF save_pretrained export beside the weights
            writer(tmp)
        return commit(ckpt_root, tmp, step)


@contextlib.contextmanager
def _cleaned_on_failure(tmp: Path, final: Path) -> Iterator[None]:
    """Writing `final` through `tmp`: on any failure (a full disk above all: safetensors,
    torch and copytree each say it their own way) remove `tmp` at once, so the next save has
    the space back, and raise one CheckpointError naming `final` and the free space. Anything
    that is not a write failure (a bug in what is being saved) is re-raised as it is."""
    try:
        yield
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_write_failure(e):
            raise
        raise CheckpointError(
            f"{write_failure(final, e)}; the previous checkpoints are intact: free space, then "
            "resume with train.resume=true"
        ) from None


def copy_files(files: dict[str, Path], folder: Path) -> None:
    for name, src in files.items():
        if src.is_dir():
            shutil.copytree(src, folder / name)
        else:
            shutil.copy2(src, folder / name)


def commit(ckpt_root: Path, tmp: Path, step: int) -> Path:
    """Mark `tmp` complete, fsync it and rename it to `step_<step>` (replacing a re-save)."""
    final = ckpt_root / f"step_{step}"
    (tmp / MARKER).write_text(json.dumps({"step": step}))
    _fsync_tree(tmp)
    if final.exists():  # a re-save of the same step (e.g. final save == periodic save)
        old = ckpt_root / f".old_step_{step}_{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(ckpt_root)
    return final


def shared_tmp(ckpt_root: Path, step: int) -> Path:
    """EVERY rank: rank 0's fresh temp folder for `step_<step>` (made by rank 0, its path
    broadcast), where every rank writes its shards."""
    tmp = None
    if distributed.is_main():
        ckpt_root.mkdir(parents=True, exist_ok=True)
        tmp = ckpt_root / f".tmp_step_{step}_{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    return Path(distributed.broadcast_object(str(tmp)))


def write_sharded_checkpoint(
    ckpt_root: Path,
    step: int,
    save_shards: Callable[[Path], None],
    trainer_state: dict[str, Any],
    extra_files: dict[str, Path] | None = None,
) -> Path | None:
    """Write a sharded `step_<step>` atomically; EVERY rank calls (all write their shards into
    rank 0's temp folder, then rank 0 adds the trainer state, marker and rename). Returns the
    path on rank 0, None elsewhere."""
    tmp = shared_tmp(ckpt_root, step)
    save_shards(tmp / SHARDS)  # collective
    distributed.barrier()
    if not distributed.is_main():
        return None
    with _cleaned_on_failure(tmp, ckpt_root / f"step_{step}"):
        torch.save(trainer_state, tmp / "trainer_state.pt")
        copy_files(extra_files or {}, tmp)
        return commit(ckpt_root, tmp, step)


def complete_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete step checkpoint, oldest first."""
    if not ckpt_root.is_dir():
        return []
    found = []
    for p in ckpt_root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / MARKER).is_file() and has_weights(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(ckpt_root)
    return found[-1][1] if found else None


def prune(ckpt_root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step checkpoints and any stale temp folders."""
    for _, p in complete_checkpoints(ckpt_root)[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_root.glob(".tmp_step_*"):
        if not p.name.endswith(f"_{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)


_STALE = re.compile(r"^\.(tmp|old)_(step_\d+|best)_(\d+)$")


def clean_stale(ckpt_root: Path) -> list[str]:
    """Remove the temp and old folders a killed save left in `ckpt_root` (rank 0, under the
    run's lock: no other process writes there); returns what it did, for the log.

    A kill between the two renames of `update_best` leaves no `best`: the complete new copy
    (its `best.json` is written last) becomes `best`, else the old one is put back.
    """
    if not ckpt_root.is_dir():
        return []
    mine = str(os.getpid())
    stale = [p for p in ckpt_root.iterdir() if (m := _STALE.match(p.name)) and m[3] != mine]
    done = []
    best = ckpt_root / "best"
    if not best.exists():
        for p in sorted(stale, key=lambda p: p.name.startswith(".old")):  # new copies first
            if p.name.startswith((".tmp_best_", ".old_best_")) and (p / "best.json").is_file():
                p.rename(best)
                stale.remove(p)
                done.append(f"checkpoints/best restored from {p.name} (a save was killed)")
                break
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
        done.append(f"removed {p}, left by a killed or failed save")
    return done


def update_best(ckpt_root: Path, src: Path, metric: str, value: float, step: int) -> None:
    """Replace `checkpoints/best` with a copy of `src`, atomically."""
    tmp = ckpt_root / f".tmp_best_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    best = ckpt_root / "best"
    with _cleaned_on_failure(tmp, best):
        shutil.copytree(src, tmp)
        info = {"metric": metric, "value": value, "step": step}
        (tmp / "best.json").write_text(json.dumps(info))
        _fsync_tree(tmp)
    if best.exists():
        old = ckpt_root / f".old_best_{os.getpid()}"
        best.rename(old)
        tmp.rename(best)
        shutil.rmtree(old)
    else:
        tmp.rename(best)
    _fsync_dir(ckpt_root)


def load_weights(model: torch.nn.Module, ckpt: Path, strict: bool = True) -> None:
    """Load `model.safetensors` (or a sharded checkpoint's weights, resharded to `model`'s
    layout; then every rank calls) from a checkpoint folder into `model`."""
    if is_sharded(ckpt):
        try:
            load_shards(model, None, shards_of(ckpt))
        except (RuntimeError, ValueError, KeyError) as e:
            raise RuntimeError(f"{ckpt}: {_short(e)}") from None
        return
    path = ckpt / "model.safetensors"
    try:
        missing, unexpected = load_model(model, str(path), strict=strict)
    except Exception as e:
        if "Missing key" in str(e) or "Unexpected key" in str(e) or "size mismatch" in str(e):
            raise CheckpointMismatch(ckpt, mismatched_keys(model, ckpt)) from None
        raise CheckpointError(f"cannot read {path}: {_short(e)} (truncated or corrupt?)") from None
    if strict and (missing or unexpected):
        diffs = [f"{k}: not in the checkpoint" for k in missing]
        raise CheckpointMismatch(ckpt, diffs + [f"{k}: not in the model" for k in unexpected])


class CheckpointMismatch(CheckpointError):
    """Weights of another architecture or size: the message names the first differing keys
    and shapes, on one line (callers add the config keys that decide them)."""

    def __init__(self, ckpt: Path, diffs: list[str]) -> None:
        self.ckpt, self.diffs = ckpt, diffs
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        shown = "; ".join(diffs[:3]) or "the parameter names differ"
        super().__init__(f"the weights of {ckpt} do not fit the model: {shown}{more}")


def mismatched_keys(model: torch.nn.Module, ckpt: Path) -> list[str]:
    """What keeps `ckpt`'s weights from loading into `model`, read from the safetensors header
    (no tensor is loaded): 'key: shape in checkpoint -> shape in model', missing and
    unexpected keys. Empty for a sharded checkpoint (its own loader names the mismatch)."""
    from safetensors import safe_open

    path = ckpt / "model.safetensors"
    if not path.is_file():
        return []
    with safe_open(str(path), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    params = model.state_dict()
    stored = {t.data_ptr() for k, t in params.items() if k in saved}
    out = [
        f"{k}: {list(saved[k])} in the checkpoint -> {list(t.shape)}"
        for k, t in params.items()
        if k in saved and tuple(t.shape) != saved[k]
    ]
    out += [
        f"{k}: not in the checkpoint"
        for k, t in params.items()
        if k not in saved and t.data_ptr() not in stored  # a tied weight is saved once
    ]
    out += [f"{k}: not in the model" for k in saved if k not in params]
    return out


def _short(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    """Trainer state; refuses arbitrary pickle (weights_only=True) with a message that says so."""
    path = ckpt / "trainer_state.pt"
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"{path} holds non-tensor Python objects and is refused for safety (vltrain never "
            "unpickles arbitrary objects); it was not written by vltrain or has been tampered with"
        ) from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {_short(e)} (truncated or corrupt?)") from None


def check_loadable(ckpt: Path) -> None:
    """Raise CheckpointError unless the weights header and the trainer state both read."""
    if is_sharded(ckpt):
        _check_shards(ckpt)
        if (ckpt / "trainer_state.pt").exists():
            load_trainer_state(ckpt)
        return
    path = ckpt / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt"):  # checks the header covers the whole file
            pass
    except Exception as e:
        raise CheckpointError(f"cannot read {path}: {_short(e)} (truncated or corrupt?)") from None
    if (ckpt / "trainer_state.pt").exists():
        load_trainer_state(ckpt)


def _check_shards(ckpt: Path) -> None:
    """A sharded checkpoint's metadata reads and every file it names is present."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(shards_of(ckpt))).read_metadata()
    except Exception as e:
        raise CheckpointError(f"cannot read {shards_of(ckpt)}: {_short(e)}") from None
    names = {item.relative_path for item in (meta.storage_data or {}).values()}
    missing = sorted(n for n in names if not (shards_of(ckpt) / n).is_file())
    if missing:
        raise CheckpointError(f"{shards_of(ckpt)} lacks {missing} (truncated copy?)")


def newest_loadable(ckpt_root: Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint that loads, and a line per newer one skipped (and why)."""
    skipped = []
    for _, path in reversed(complete_checkpoints(ckpt_root)):
        try:
            check_loadable(path)
            return path, skipped
        except CheckpointError as e:
            skipped.append(f"skipped {path.name}: {e}")
    return None, skipped


def best_step_of(ckpt: Path) -> int | None:
    """The best step a checkpoint's trainer state records (None when it has none)."""
    try:
        step = load_trainer_state(ckpt).get("loop", {}).get("best_step", -1)
    except CheckpointError:
        return None
    return int(step) if step is not None and step >= 0 else None


def _best_json_step(ckpt_root: Path) -> int | None:
    path = ckpt_root / "best" / "best.json"
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def repair_best(ckpt_root: Path, metric: str, value: float | None) -> str | None:
    """Make `checkpoints/best` hold the step the newest checkpoint names as best.

    A kill between writing `step_N` (whose trainer state says best_step=N) and updating `best`
    leaves `best` on an older step; this copies step N into place. Returns a message when it
    repaired something.
    """
    latest = latest_checkpoint(ckpt_root)
    step = best_step_of(latest) if latest is not None else None
    if step is None or _best_json_step(ckpt_root) == step:
        return None
    src = ckpt_root / f"step_{step}"
    if not (src / MARKER).is_file():
        return None  # pruned long ago: best already held it (checked by best.json above)
    update_best(ckpt_root, src, metric, value if value is not None else float("nan"), step)
    return f"checkpoints/best repaired: it now holds step {step}, the best recorded"


def resolve_loadable(path: str | Path) -> tuple[Path, str | None]:
    """`resolve_checkpoint`, falling back from a run's checkpoint that does not load to the
    newest one that does; (folder, a message naming what was skipped and why, or None).
    A checkpoint folder named directly is never swapped for another."""
    ckpt = resolve_checkpoint(path)
    try:
        check_loadable(ckpt)
        return ckpt, None
    except CheckpointError as e:
        if Path(path).resolve() == ckpt.resolve():
            raise
        fallback, _ = newest_loadable(ckpt.parent)
        if fallback is None:
            raise
        return fallback, f"{e}; using {fallback} instead"


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a run dir, a checkpoints dir, or a checkpoint folder; return the folder.

    A run resolves to its best checkpoint, else its newest; when `best` lags behind the best
    step the newest checkpoint records (a kill between the two writes), that step is used.
    """
    p = Path(path)
    if has_weights(p) and latest_checkpoint(p / "checkpoints") is None:
        return p  # a checkpoint folder (or an export); a run's own checkpoints come first
    for root in (p / "checkpoints", p):
        latest = latest_checkpoint(root)
        step = best_step_of(latest) if latest is not None else None
        if step is not None and _best_json_step(root) != step and (root / f"step_{step}").is_dir():
            return root / f"step_{step}"
        best = root / "best"
        if has_weights(best):
            return best
        if latest is not None:
            return latest
    raise FileNotFoundError(
        f"no checkpoint found at {p}: pass a run dir, its checkpoints/ folder, or a "
        "checkpoints/step_<N> folder holding model.safetensors"
    )


def resolve_init(init_from: str, pin_to: Path | None = None, write: bool = True) -> Path | None:
    """`model.init_from` as a checkpoint folder (best, else newest); None when it is unset.

    `pin_to` (a run folder): the folder the run started from is kept for the run's life: the
    first start records it in ``<pin_to>/init_from.json`` (when `write`) with its weight files'
    sizes and modification times, and a start that resumes one of the run's checkpoints uses
    the recorded folder, refusing it if its weights changed since (RL's KL reference is those
    weights: resolving again would take the init run's *current* best)."""
    from vltrain.config.core import ConfigError

    record = pin_to / INIT_RECORD if pin_to is not None else None
    if record is not None and record.is_file() and latest_checkpoint(pin_to / "checkpoints"):
        pinned = json.loads(record.read_text())
        path = Path(pinned["path"])
        if not path.is_dir() or _weight_files(path) != pinned["weights"]:
            raise ConfigError(
                f"this run started from {path} (model.init_from={pinned['init_from']}), "
                f"whose weights {'are gone' if not path.is_dir() else 'changed since'}: its "
                "KL reference cannot be rebuilt as it was; restore that checkpoint, or start "
                "a new run"
            )
        return path
    try:
        path = resolve_checkpoint(init_from) if init_from else None
    except FileNotFoundError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    if record is not None and path is not None and write:
        pinned = {"init_from": init_from, "path": str(path.resolve())}
        pinned["weights"] = _weight_files(path)
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps(pinned, indent=1) + "\n")
        tmp.replace(record)
    return path


INIT_RECORD = "init_from.json"


def _weight_files(folder: Path) -> list[list[Any]]:
    """[name, size, mtime_ns] of a checkpoint folder's weight files (safetensors, DCP)."""
    files = sorted(f for f in folder.iterdir() if f.suffix in (".safetensors", ".distcp"))
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]


# ---------------------------------------------------------------- DCP checkpoints
# torch.distributed.checkpoint is imported where it is used: importing it costs ~1.5 s of
# every command's start


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "torch.distributed is disabled ... single process" warning: loading or
    saving a sharded checkpoint in one process (fsdp at one rank, a resume on fewer ranks,
    `vltrain export`) is meant (a resume printed it twice)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_shards(module: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Every rank writes its shards of the weights and the optimizer state (FQN keys)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))


def load_shards(module: nn.Module, optimizer: torch.optim.Optimizer | None, folder: Path) -> None:
    """Load weights (and the optimizer state, when given) from `folder`, resharding to this
    run's layout (any world size, sharded or plain)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        state = {"model": get_model_state_dict(module)}
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(folder))
        set_model_state_dict(module, state["model"])
        return
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full (gathered, CPU) weights of a sharded module on rank 0 ({} elsewhere); every
    rank must call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
