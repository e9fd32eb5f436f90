"""The one parallel layer: how the model is wrapped for training (none | ddp).

Everything that depends on the wrapping lives here, so the loop and the stages never ask:

- :class:`ParallelModel` is what a stage's ``forward_backward`` receives. Calling it runs the
  wrapped forward (DDP synchronises gradients in backward); ``.module`` is the plain module,
  for work that must not go through the wrapper (sampling, GradCache chunks), after which the
  stage calls :meth:`ParallelModel.reduce_gradients`.
- :meth:`ParallelModel.micro_step` marks accumulation micro-steps (DDP's ``no_sync``).
- :func:`unwrap_model` is the one way to reach the plain module from any wrapper.
- :meth:`ParallelModel.checkpoint_module` is the module a checkpoint is written from; every
  rank calls the checkpoint code (rank 0 writes), so a sharded mode can gather there.

FSDP2 and ``torch.compile`` slot in as further modes of :func:`build_parallel`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from vltrain.config.core import ConfigError
from vltrain.engine import distributed as D

MODES = ("auto", "none", "ddp")


def unwrap_model(model: Any) -> nn.Module:
    """The plain module under any vltrain or torch wrapper (ParallelModel, DDP, compile)."""
    while True:
        if isinstance(model, ParallelModel):
            model = model.module
        elif isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


class ParallelModel:
    """A module wrapped for this run's parallel mode; see the module docstring."""

    def __init__(self, module: nn.Module, mode: str) -> None:
        self.module = module
        self.mode = mode
        self.wrapped: nn.Module = module
        if mode == "ddp":
            device = next(module.parameters()).device
            ids = [device.index] if device.type == "cuda" else None  # this rank's one GPU
            self.wrapped = DistributedDataParallel(module, device_ids=ids)
        self._sync = True
        self._reduced = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped forward: gradients of its backward are synchronised as the mode says."""
        return self.wrapped(*args, **kwargs)

    @property
    def syncs_gradients(self) -> bool:
        """True on the micro-step whose backward synchronises gradients across ranks."""
        return self._sync

    @contextlib.contextmanager
    def micro_step(self, sync: bool) -> Iterator[None]:
        """One accumulation micro-step; only the last of a step (`sync`) reduces gradients."""
        self._sync, self._reduced = sync, False
        local_only = self.mode == "ddp" and not sync
        ctx = self.wrapped.no_sync() if local_only else contextlib.nullcontext()
        try:
            with ctx:
                yield
        finally:
            self._sync = True

    def reduce_gradients(self) -> None:
        """Average gradients over ranks now, for a backward that bypassed the wrapper.

        A no-op outside DDP and on accumulation micro-steps (local gradients keep summing;
        the last micro-step averages them once, which is DDP's own arithmetic).
        """
        if self.mode != "ddp" or not self._sync or self._reduced:
            return
        average_gradients(self.module.parameters())
        self._reduced = True

    def checkpoint_module(self) -> nn.Module:
        """The module whose weights a checkpoint holds (full, unsharded)."""
        return self.module

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def train(self, mode: bool = True) -> ParallelModel:
        self.module.train(mode)
        return self


def average_gradients(params: Iterable[nn.Parameter], bucket_elems: int = 1 << 24) -> None:
    """Average ``.grad`` over ranks in a few flat buckets (what DDP's reducer does).

    Every rank must hold gradients for the same parameters (true for a model whose every
    parameter is used in each step, which DDP without find_unused_parameters demands too).
    """
    if not D.is_distributed():
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[list[Tensor]]] = {}
    filled: dict[tuple[torch.dtype, torch.device], int] = {}
    for p in params:
        if p.grad is None:
            continue
        key = (p.grad.dtype, p.grad.device)
        lists = buckets.setdefault(key, [[]])
        if lists[-1] and filled[key] + p.grad.numel() > bucket_elems:
            lists.append([])
            filled[key] = 0
        lists[-1].append(p.grad)
        filled[key] = filled.get(key, 0) + p.grad.numel()
    for _, lists in sorted(buckets.items(), key=lambda kv: str(kv[0])):
        for grads in lists:
            flat = D.all_reduce_mean(torch.cat([g.reshape(-1) for g in grads]))
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))


def resolve_mode(mode: str, world_size: int) -> str:
    """The concrete mode for `train.parallel` at this world size."""
    if mode == "auto":
        return "ddp" if world_size > 1 else "none"
    if mode == "ddp" and world_size == 1:
        return "none"  # one process: nothing to synchronise
    if mode == "none" and world_size > 1:
        raise ConfigError(
            f"train.parallel=none under {world_size} processes would train {world_size} "
            "independent models; use train.parallel=ddp (or auto)"
        )
    return mode


def build_parallel(module: nn.Module, mode: str, world_size: int) -> ParallelModel:
    """Wrap `module` (already on its device) for `train.parallel` at this world size."""
    return ParallelModel(module, resolve_mode(mode, world_size))
