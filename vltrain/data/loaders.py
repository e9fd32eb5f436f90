"""Resumable training loaders (the engine's :class:`~vltrain.engine.task.Loader` protocol).

:class:`MapLoader` is the map-style implementation: a dataset indexed by SampleKey, a
position-aware batch sampler (vltrain.data.samplers) and a torch DataLoader. Its state is the
sampler position ``(epoch, batch_in_epoch)`` of the next batch, so resume never replays
batches. A streaming source implements the same three methods with its own opaque state.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from vltrain.data.records import split_bad


@dataclass
class Batch:
    """One micro-batch as the loader hands it to the engine.

    ``data`` is what the stage's collate built from the good samples (empty when every sample
    was bad); the rest is the engine's bookkeeping, out of band.
    """

    data: dict[str, Any]
    n_seen: int
    n_good: int
    bad: list[tuple[str, str]] = field(default_factory=list)  # (reason, example) per bad sample
    position: Any = None  # the loader's position after this batch (opaque to the engine)
    keys: list[tuple[int, int]] = field(default_factory=list)  # (epoch, index) per good sample
    lengths: list[int] = field(default_factory=list)  # token length per good sample, if known
    bucket: int | None = None  # the length bucket the sampler drew this batch from, if any

    def pin_memory(self) -> Batch:
        """DataLoader(pin_memory=True) calls this: pin the tensors, keep the bookkeeping."""
        from torch.utils.data._utils.pin_memory import pin_memory

        self.data = pin_memory(self.data)
        return self


@runtime_checkable
class Loader(Protocol):
    """A resumable source of micro-batches for one rank.

    ``state_dict`` is opaque to the engine (a map-style sampler position, a stream's shard
    cursors...) and must load with ``torch.load(weights_only=True)``: numbers, strings, lists,
    dicts and tensors only. After ``load_state_dict(s)`` the next batch is the one that followed
    the batch whose ``position`` was ``s``.
    """

    def __iter__(self) -> Iterator[Batch]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PositionSampler(Protocol):
    """What MapLoader needs of a batch sampler."""

    def __iter__(self) -> Any: ...

    def set_position(self, position: tuple[int, int]) -> None: ...

    def position_after(self, key: tuple[int, int, int]) -> tuple[int, int]: ...


# The signals the trainer owns: stop (SIGTERM, SIGINT) and checkpoint-and-continue (SIGUSR1/2,
# `train.checkpoint_on`). A cluster sends them to the whole process group; a DataLoader worker
# that died of one (torch's worker handler re-raises an outside SIGTERM) took the run with it.
TRAINER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def worker_init(worker_id: int) -> None:
    """Ignore the trainer's signals in a DataLoader worker, then seed numpy/python from torch's
    per-worker seed.

    The worker exits when the trainer shuts its loader down (or its parent is gone). The
    signals were blocked since the fork (`workers_starting`): one sent in between is discarded
    here, not fatal. vltrain's own per-sample randomness does not use the seeds (it derives
    from seed, epoch and index), but user transforms might.
    """
    for sig in TRAINER_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TRAINER_SIGNALS)
    _die_with_parent()
    s = torch.initial_seed() % (2**32)
    np.random.seed(s)
    random.seed(s)


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the trainer dies (a SIGKILL, an OOM kill). It
    ignores SIGTERM, and one blocked writing a batch to a trainer that is gone never checks on
    its parent: such workers outlived the trainer, holding their memory and shared segments."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the request
        os._exit(1)


def stop_workers() -> None:
    """Kill the workers of this process's DataLoader iterators that are still alive. For a
    trainer leaving on an error: the workers ignore SIGTERM (the trainer's signal), and one
    blocked writing a batch never sees the shutdown request, so the interpreter's exit, which
    terminates and then joins them, waited for them forever. Their pids leave torch's SIGCHLD
    watch first (a killed worker is no failure to report)."""
    from torch.utils.data._utils import signal_handling

    for it in list(_ITERATORS):
        workers = getattr(it, "_workers", [])
        if getattr(it, "_worker_pids_set", False):
            signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join(timeout=5)
        with contextlib.suppress(Exception):
            it._shutdown_workers()
    _ITERATORS.clear()


#: the multi-process DataLoader iterators `start_workers` started, to stop on an error
_ITERATORS: weakref.WeakSet[Any] = weakref.WeakSet()


def start_workers(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)`` with the trainer's signals held while its workers fork
    (`workers_starting`); the iterator is kept for `stop_workers`."""
    with workers_starting():
        it = iter(loader)
    if getattr(it, "_workers", None):
        _ITERATORS.add(it)
    return it


@contextlib.contextmanager
def workers_starting() -> Iterator[None]:
    """Hold the trainer's signals while DataLoader workers fork (they inherit the mask and
    ignore the signals before unblocking them, in `worker_init`); the trainer receives a
    signal that arrived meanwhile as soon as the workers exist."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, TRAINER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class BatchCollate:
    """Picklable collate: drops bad samples (the engine counts them), then the stage collates.

    The bookkeeping (samples seen, bad reasons, the last key) travels beside the stage's
    tensors in a :class:`Batch`, never inside them.
    """

    def __init__(self, stage_collate: Callable[[list[dict]], dict[str, Any]]) -> None:
        self.stage_collate = stage_collate

    def __call__(self, samples: list[dict]) -> Batch:
        good, bad = split_bad(samples)
        return Batch(
            data=self.stage_collate(good) if good else {},
            n_seen=len(samples),
            n_good=len(good),
            bad=bad,
            position=tuple(samples[-1]["key"]),  # the last key; MapLoader turns it into a position
            keys=[(int(s["key"][0]), int(s["index"])) for s in good],
            lengths=[len(s["input_ids"]) for s in good if "input_ids" in s],
        )


class MapLoader:
    """Sampler + DataLoader over a map-style dataset, resumable at any batch boundary."""

    def __init__(
        self,
        dataset: Dataset,
        sampler: PositionSampler,
        collate: Callable[[list[dict]], dict[str, Any]],
        *,
        num_workers: int,
        seed: int,
        pin_memory: bool = False,
    ) -> None:
        self.dataset, self.sampler = dataset, sampler
        self.collate = BatchCollate(collate)
        self.num_workers, self.seed, self.pin_memory = num_workers, seed, pin_memory
        self.position: tuple[int, int] = (0, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.position[0], "batch_in_epoch": self.position[1]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = (int(state["epoch"]), int(state["batch_in_epoch"]))

    def __iter__(self) -> Iterator[Batch]:
        self.sampler.set_position(self.position)
        # A private generator keeps DataLoader seeding off the global RNG, so creating the
        # iterator at a different moment (resume) leaves the dropout RNG stream untouched.
        loader = DataLoader(
            self.dataset,
            batch_sampler=self.sampler,
            collate_fn=self.collate,
            num_workers=self.num_workers,
            worker_init_fn=worker_init,
            generator=torch.Generator().manual_seed(self.seed),
            persistent_workers=self.num_workers > 0,
            pin_memory=self.pin_memory,
            prefetch_factor=4 if self.num_workers > 0 else None,
        )
        bucket_of = getattr(self.sampler, "bucket_of_batch", None)
        batches = start_workers(loader)
        for batch in batches:
            if bucket_of is not None:  # position is still the batch's last key here
                batch.bucket = bucket_of(int(batch.position[0]), int(batch.position[1]))
            self.position = self.sampler.position_after(batch.position)
            batch.position = self.state_dict()
            yield batch
