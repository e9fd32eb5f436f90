"""FSDP2 per block, activation checkpointing and compile per block, and DCP checkpoints.

The parallel layer (`engine/parallel.py`) is the only user. A *block* (the unit that is
sharded, checkpointed and compiled) is declared by the model, never guessed from names:

- a built-in module class sets ``vltrain_block = True`` (``models.layers.Block``, ...);
- an HF model lists its layer classes in ``_no_split_modules`` (transformers' own declaration,
  which accelerate's FSDP auto-wrap reads too): decoder layers and vision blocks.

Everything keeps the plain module's state_dict keys: FSDP2 swaps parameters for DTensors in
place, activation checkpointing and compile patch a block's ``forward`` on the instance.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vltrain.config.core import ConfigError

BLOCK_FLAG = "vltrain_block"


def blocks(module: nn.Module) -> list[nn.Module]:
    """The outermost declared blocks of `module`, in module order (see the module docstring)."""
    hf_names: set[str] = set()
    for m in module.modules():
        hf_names.update(getattr(m, "_no_split_modules", None) or ())
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in module.modules():
        if m is module or id(m) in inside:
            continue
        if getattr(type(m), BLOCK_FLAG, False) or type(m).__name__ in hf_names:
            found.append(m)
            inside.update(id(c) for c in m.modules())
    return found


def apply_activation_checkpointing(module: nn.Module) -> int:
    """Recompute each block's activations in backward (non-reentrant); returns the count."""
    units = blocks(module)
    for block in units:
        block.forward = functools.partial(_checkpointed, block.forward)
    return len(units)


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def compile_blocks(module: nn.Module) -> int:
    """`torch.compile` each block in place (keys unchanged); returns the count."""
    units = blocks(module)
    for block in units:
        block.compile()
    return len(units)


def apply_fsdp(
    module: nn.Module, world_size: int, param_dtype: torch.dtype | None, offload: bool
) -> list[nn.Parameter]:
    """FSDP2 (`fully_shard`) on every block, then on the root.

    Parameters are stored sharded in fp32; `param_dtype` (bf16 runs) is what the all-gathered
    compute copy uses, and gradients are reduce-scattered in fp32. Scalar parameters (a
    loss's temperature), which FSDP2 cannot shard, stay replicated: returns them, for the
    caller to average their gradients as DDP would.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    device = next(module.parameters()).device
    if offload and device.type == "cpu":
        raise ConfigError(
            "train.fsdp_cpu_offload moves the shards off an accelerator into CPU memory; this "
            "run's parameters already live there (device cpu): turn it off"
        )
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = {
        "mesh": mesh,
        "mp_policy": policy,
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
    }
    scalars = [p for p in module.parameters() if p.ndim == 0]
    for block in blocks(module):
        fully_shard(block, **kwargs, ignored_params=set(scalars))
    fully_shard(module, **kwargs, ignored_params=set(scalars))
    return scalars


@contextlib.contextmanager
def unsharded(module: nn.Module) -> Iterator[None]:
    """The root's own parameters gathered, for calls that bypass its forward (evaluation,
    decoding); blocks gather themselves in their forward."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` over sharded (DTensor) and plain gradients at once;
    the total norm over all ranks' shards, as a plain tensor."""
    from torch.nn.utils import get_total_norm

    sharded, plain = [], []
    for p in params:
        if p.grad is not None:
            (sharded if _is_dtensor(p.grad) else plain).append(p.grad)
    parts = []
    if sharded:
        parts.append(get_total_norm(sharded).full_tensor())  # reduces the partial norms
    if plain:
        parts.append(get_total_norm(plain))
    if not parts:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([p.float().cpu() for p in parts]))
    coef = max_norm / (float(total) + 1e-6)  # torch's formula
    if coef < 1.0:  # scaled here: clip_grads_with_norm_ left DTensor grads unscaled (gloo)
        for g in sharded + plain:
            g.mul_(coef)
    return total


def _is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor; never true (and nothing imported) before torch.distributed.tensor is loaded,
    which FSDP2 and DCP do: importing it costs ~1.5 s of every command's start."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def sharded_scaler(device_type: str, init_scale: float) -> torch.amp.GradScaler:
    """fp16 under FSDP: the loss scaler that checks every rank's gradient shards for overflow
    (one all-reduce), so all ranks skip the same steps."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type, init_scale=init_scale)
