"""Checkpoints written in the background (train.async_save): training stalls only for a copy.

Plain checkpoints (train.parallel none/ddp, rank 0 writes): the trainer state is copied to CPU
tensors synchronously; the weights and the optimizer state, which only the optimizer step
changes, are copied by the writer thread while the next step's forward and backward run (its
optimizer step waits for the copy); the thread then writes them into the temp folder and
renames it into place, exactly as the synchronous save does (the same bytes). Sharded
checkpoints (fsdp): torch.distributed.checkpoint's `async_save` stages the shards and writes
them in its own thread, on a process group of its own; then the writer thread (rank 0) adds
the trainer state, marker and rename.

At most one save is in flight: the next one, the end of the run and a stop on a signal wait
for it. The writer thread issues no collective of the training process group. A checkpoint is
complete only once renamed into place, so a kill at any moment leaves the previous complete
checkpoint as the newest loadable one.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vltrain.core import checkpoint, distributed


class Copies:
    """CPU copies of tensors: those in `deferred` (the weights and the optimizer state, which
    only the optimizer step changes) are copied later, in the writer thread, while training
    runs up to its next optimizer step (which waits for them); every other tensor now."""

    def __init__(self, deferred: set[int] | None = None) -> None:
        self.deferred = deferred or set()
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source, CPU copy)

    def of(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.deferred:
            return t.detach().to("cpu", copy=True)
        out = torch.empty_like(t, device="cpu")  # same strides: the same bytes in torch.save
        self.pairs.append((t, out))
        return out

    def run(self) -> None:
        with torch.no_grad():
            for src, dst in self.pairs:
                dst.copy_(src.detach())


def snapshot(obj: Any, copies: Copies | None = None, memo: dict[int, Any] | None = None) -> Any:
    """A copy of `obj` (nested dicts, lists, tuples) whose tensors are CPU copies, aliasing
    kept (one tensor twice stays one copy); other values are deep-copied."""
    copies = Copies() if copies is None else copies
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, torch.Tensor):
        out = copies.of(obj)
    elif isinstance(obj, dict):  # dict, OrderedDict, defaultdict: same type, copied values
        out = copy.copy(obj)
        out.clear()
        out.update((k, snapshot(v, copies, memo)) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        out = type(obj)(snapshot(v, copies, memo) for v in obj)
    else:
        return copy.deepcopy(obj)
    memo[id(obj)] = out
    return out


def snapshot_module(module: nn.Module, copies: Copies | None = None) -> nn.Module:
    """A copy of `module` on CPU whose parameters and buffers are copies (tied weights stay
    tied; gradients are not copied): what the writer thread saves and exports."""
    copies = Copies() if copies is None else copies
    memo: dict[int, Any] = {}
    for p in module.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(copies.of(p), p.requires_grad)
    for b in module.buffers():
        if id(b) not in memo:
            memo[id(b)] = b.detach().to("cpu", copy=True)
    return copy.deepcopy(module, memo)


def optimizer_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> set[int]:
    """The tensors only an optimizer step changes: the parameters and the optimizer state."""
    out = {id(p) for p in module.parameters()}
    for state in optimizer.state.values() if optimizer is not None else ():
        out |= {id(v) for v in state.values() if isinstance(v, torch.Tensor)}
    return out


class AsyncWriter:
    """Runs one save job at a time in a background thread; `wait` joins it and re-raises its
    error (e.g. a full disk) in the training thread. Given the optimizer, its step waits until
    the job's deferred copies are taken (the weights must not change under the copy)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copied = threading.Event()
        self._copied.set()
        self.gated = optimizer is not None
        if optimizer is not None:
            optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, *_: Any) -> None:
        self.wait_copied()

    def wait_copied(self) -> None:
        """Block until the save in flight has its copy of the weights (they may change)."""
        self._copied.wait()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None], copies: Copies | None = None) -> None:
        """Start `copies` then `job` once the previous job finished (one save in flight)."""
        self.wait()
        if copies is not None and copies.pairs and not self.gated:
            copies.run()  # nothing would stop training from changing them: copy now
            copies = None
        self._copied.clear()
        self._thread = threading.Thread(target=self._run, args=(job, copies), name="vltrain-ckpt")
        self._thread.start()

    def _run(self, job: Callable[[], None], copies: Copies | None) -> None:
        try:
            try:
                if copies is not None:
                    copies.run()
            finally:
                self._copied.set()
            job()
        except BaseException as e:  # re-raised in the training thread by wait()
            self._error = e

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


def write_checkpoint_async(
    writer: AsyncWriter,
    ckpt_root: Path,
    step: int,
    module: nn.Module,
    trainer_state: dict[str, Any],
    extra_files: dict[str, Path],
    export: Callable[[nn.Module, Path], None],
    done: Callable[[Path], None],
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Rank 0: copy the state, write `step_<step>` in the background, then `done(path)` (best
    and pruning) in the same thread. The weights and `optimizer`'s state are copied in the
    thread too when the writer gates that optimizer's step, everything else now."""
    writer.wait()  # the previous save's copy is released before this one is taken
    copies = Copies(optimizer_tensors(module, optimizer) if writer.gated else set())
    model, state = snapshot_module(module, copies), snapshot(trainer_state, copies)

    def job() -> None:
        path = checkpoint.write_checkpoint(
            ckpt_root, step, model, state, extra_files, lambda folder: export(model, folder)
        )
        done(path)

    writer.submit(job, copies)


def write_sharded_checkpoint_async(
    writer: AsyncWriter,
    ckpt_root: Path,
    step: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    extra_files: dict[str, Path],
    done: Callable[[Path], None],
) -> None:
    """Every rank: stage the shards with torch.distributed.checkpoint's async_save (on its own
    process group); rank 0's writer thread then commits the folder and calls `done(path)`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    writer.wait()
    tmp = checkpoint.shared_tmp(ckpt_root, step)
    model_sd, optim_sd = get_state_dict(module, optimizer)
    future = dcp.async_save(
        {"model": model_sd, "optim": optim_sd},
        checkpoint_id=str(tmp / checkpoint.SHARDS),
        process_group=distributed.checkpoint_group(),
    )
    state = snapshot(trainer_state) if distributed.is_main() else None

    def job() -> None:
        future.result()  # on rank 0: every rank's shards and the metadata are written
        if state is None:
            return
        torch.save(state, tmp / "trainer_state.pt")
        checkpoint.copy_files(extra_files, tmp)
        done(checkpoint.commit(ckpt_root, tmp, step))

    writer.submit(job)
