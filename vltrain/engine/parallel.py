"""The one parallel layer: how the model is wrapped for training (none | ddp | fsdp).

Everything that depends on the wrapping lives here, so the loop and the stages never ask:

- :class:`ParallelModel` is what a stage's ``forward_backward`` receives. Calling it runs the
  wrapped forward (DDP synchronises gradients in backward); ``.module`` is the plain module,
  for work that must not go through the wrapper (sampling, GradCache chunks), after which the
  stage calls :meth:`ParallelModel.reduce_gradients`.
- :meth:`ParallelModel.micro_step` marks accumulation micro-steps (DDP's ``no_sync``).
- :meth:`ParallelModel.checkpoint_module` is the module a checkpoint is written from; every
  rank calls the checkpoint code (rank 0 writes), so a sharded mode can gather there.
- :meth:`ParallelModel.save_checkpoint` / :meth:`ParallelModel.load_checkpoint` pick the
  checkpoint format: safetensors written by rank 0 (none, ddp), or torch.distributed.checkpoint
  shards of weights and optimizer state written by every rank (fsdp, also at one process, so a
  run reshards 2 -> 1 -> 2 ranks).

``fsdp`` is FSDP2 (`fully_shard`) per block, then the root (`engine/sharding.py`);
:class:`ParallelOptions` adds activation checkpointing and ``torch.compile`` per block in
every mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from vltrain.config.core import ConfigError
from vltrain.core import async_checkpoint, checkpoint, distributed
from vltrain.engine import sharding

MODES = ("auto", "none", "ddp", "fsdp")


@dataclass(frozen=True)
class ParallelOptions:
    """How blocks are treated besides the mode (`train.*` fields of the same names)."""

    activation_checkpointing: bool = False
    compile: bool = False
    fsdp_cpu_offload: bool = False
    param_dtype: torch.dtype | None = None  # FSDP's all-gathered compute dtype (bf16 runs)


class ParallelModel:
    """A module wrapped for this run's parallel mode; see the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        mode: str,
        options: ParallelOptions | None = None,
        sharded_checkpoints: bool = False,
    ) -> None:
        options = options or ParallelOptions()
        self.module = module
        self.mode = mode
        self.sharded_checkpoints = sharded_checkpoints or mode == "fsdp"
        self.wrapped: nn.Module = module
        wanted = [k for k in ("activation_checkpointing", "compile") if getattr(options, k)]
        if wanted and not sharding.blocks(module):
            raise ConfigError(
                f"train.{wanted[0]}=true but this model declares no transformer blocks (a "
                "module class with `vltrain_block = True`, or an HF model's _no_split_modules); "
                f"set train.{wanted[0]}=false"
            )
        if options.activation_checkpointing:
            sharding.apply_activation_checkpointing(module)
        if options.compile:
            sharding.compile_blocks(module)
        self.replicated: list[nn.Parameter] = []  # fsdp: unsharded params, averaged here
        if mode == "fsdp":
            self.replicated = sharding.apply_fsdp(
                module, distributed.world_size(), options.param_dtype, options.fsdp_cpu_offload
            )
        elif mode == "ddp":
            device = next(module.parameters()).device
            ids = [device.index] if device.type == "cuda" else None  # this rank's one GPU
            self.wrapped = DistributedDataParallel(module, device_ids=ids)
        self._sync = True
        self._reduced = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped forward: gradients of its backward are synchronised as the mode says."""
        return self.wrapped(*args, **kwargs)

    @contextlib.contextmanager
    def micro_step(self, sync: bool) -> Iterator[None]:
        """One accumulation micro-step; only the last of a step (`sync`) reduces gradients."""
        self._sync, self._reduced = sync, False
        local_only = self.mode == "ddp" and not sync
        ctx = self.wrapped.no_sync() if local_only else contextlib.nullcontext()
        if self.mode == "fsdp":  # accumulate unsharded grads locally; reduce on the last
            self.module.set_requires_gradient_sync(sync)
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
        if self.mode == "fsdp":
            raise NotImplementedError(
                "train.parallel=fsdp reduces gradients in the blocks' own backward hooks; a "
                "backward that bypasses the wrapped forward (GradCache chunks, sampling) would "
                "leave the root's gradients unreduced. Use train.parallel=ddp for it"
            )
        if self.mode != "ddp" or not self._sync or self._reduced:
            return
        average_gradients(self.module.parameters())
        self._reduced = True

    def checkpoint_module(self) -> nn.Module:
        """The module whose weights a checkpoint holds (full, unsharded)."""
        return self.module

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip gradients to `max_norm` over all ranks' shards; the total norm, plain tensor.

        Under fsdp, first averages the gradients of the replicated (scalar) parameters."""
        if self.mode != "fsdp":
            return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        average_gradients(self.replicated)
        return sharding.clip_grad_norm_(list(self.module.parameters()), max_norm)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        """The module for calls that bypass the wrapped forward (evaluation, decoding)."""
        with sharding.unsharded(self.module):
            yield self.module

    def optimizer_part(self, optimizer: torch.optim.Optimizer) -> Any:
        """The optimizer as a part of the trainer state: itself, or (sharded checkpoints) a
        marker, since its state then lives in the checkpoint's shards."""
        return _ShardedOptimizer() if self.sharded_checkpoints else optimizer

    def save_checkpoint(
        self,
        ckpt_root: Path,
        step: int,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict[str, Any],
        extra_files: dict[str, Path],
        export: Callable[[nn.Module, Path], None],
        done: Callable[[Path], None],
        writer: async_checkpoint.AsyncWriter | None = None,
    ) -> None:
        """Write `step_<step>` atomically, then `done(path)` on rank 0; every rank calls.
        With a `writer` (train.async_save) the writing (and `done`) happens in its thread once
        the state is copied; `writer.wait()` joins it.

        Sharded checkpoints leave the stage's `export` (e.g. hf_model/) to `vltrain export`,
        which consolidates them in one process.
        """
        if self.sharded_checkpoints:
            if writer is not None:
                async_checkpoint.write_sharded_checkpoint_async(
                    writer, ckpt_root, step, self.module, optimizer, trainer_state,
                    extra_files, done,
                )  # fmt: skip
                return
            path = checkpoint.write_sharded_checkpoint(
                ckpt_root,
                step,
                lambda folder: checkpoint.save_shards(self.module, optimizer, folder),
                trainer_state,
                extra_files,
            )
            if path is not None:
                done(path)
            return
        if not distributed.is_main():
            return
        module = self.checkpoint_module()
        if writer is not None:
            async_checkpoint.write_checkpoint_async(
                writer, ckpt_root, step, module, trainer_state, extra_files, export, done,
                optimizer,
            )  # fmt: skip
            return
        done(checkpoint.write_checkpoint(
            ckpt_root, step, module, trainer_state, extra_files,
            writer=lambda folder: export(module, folder),
        ))  # fmt: skip

    def load_checkpoint(self, ckpt: Path, optimizer: torch.optim.Optimizer) -> None:
        """Weights (and, for sharded checkpoints, the optimizer state) for a resume."""
        if checkpoint.is_sharded(ckpt) != self.sharded_checkpoints:
            have = "sharded (fsdp)" if checkpoint.is_sharded(ckpt) else "safetensors (none/ddp)"
            raise ConfigError(
                f"{ckpt} is a {have} checkpoint but train.parallel={self.mode} "
                f"{'writes' if self.sharded_checkpoints else 'reads'} the other format; resume "
                "with the run's own train.parallel, or start a new run with model.init_from"
            )
        if self.sharded_checkpoints:
            checkpoint.load_shards(self.module, optimizer, checkpoint.shards_of(ckpt))
        else:
            checkpoint.load_weights(self.module, ckpt)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def train(self, mode: bool = True) -> ParallelModel:
        self.module.train(mode)
        return self


class _ShardedOptimizer:
    """The trainer-state entry of an optimizer whose state lives in the checkpoint's shards."""

    def state_dict(self) -> dict[str, Any]:
        return {"in_shards": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("in_shards"):
            raise ConfigError("the checkpoint's optimizer state is not sharded (see its format)")


def average_gradients(params: Iterable[nn.Parameter], bucket_elems: int = 1 << 24) -> None:
    """Average ``.grad`` over ranks in a few flat buckets (what DDP's reducer does).

    Every rank must hold gradients for the same parameters (true for a model whose every
    parameter is used in each step, which DDP without find_unused_parameters demands too).
    """
    if not distributed.is_distributed():
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
            flat = distributed.all_reduce_mean(torch.cat([g.reshape(-1) for g in grads]))
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))


def resolve_mode(mode: str, world_size: int) -> str:
    """The concrete mode for `train.parallel` at this world size."""
    if mode == "auto":
        return "ddp" if world_size > 1 else "none"
    if mode in ("ddp", "fsdp") and world_size == 1:
        return "none"  # one process: nothing to synchronise or shard
    if mode == "none" and world_size > 1:
        raise ConfigError(
            f"train.parallel=none under {world_size} processes would train {world_size} "
            "independent models; use train.parallel=ddp (or auto)"
        )
    return mode


def build_parallel(
    module: nn.Module, mode: str, world_size: int, options: ParallelOptions | None = None
) -> ParallelModel:
    """Wrap `module` (already on its device) for `train.parallel` at this world size.

    `fsdp` keeps its sharded checkpoint format at one process, so its checkpoints move
    between world sizes.
    """
    return ParallelModel(
        module, resolve_mode(mode, world_size), options, sharded_checkpoints=mode == "fsdp"
    )


def options_from(train: Any, precision: str) -> ParallelOptions:
    """ParallelOptions from a `train` config section and `run.precision`."""
    return ParallelOptions(
        activation_checkpointing=train.activation_checkpointing,
        compile=train.compile,
        fsdp_cpu_offload=train.fsdp_cpu_offload,
        param_dtype=torch.bfloat16 if precision == "bf16" else None,
    )
