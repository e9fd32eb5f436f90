"""vltrain/core/distributed.py as it was before issue 11, kept as a negative control.

Its helpers hand the caller's tensor straight to `dist.*`: fine on gloo, but under NCCL a CPU
tensor (the loop's bad-sample vote, CPU evaluation shards) fails. Strict mode with the declared
device "cuda" must reject these helpers on gloo (tests/engine/test_distributed_strict.py).
Do not fix this file.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def init_from_env(device_type: str) -> None:
    """Join the process group torchrun describes in the environment (no-op without torchrun)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (in place on a copy); identity in one process."""
    t = t.clone()
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(t) / world_size()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from `src` to every rank (trusted: our own processes)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's object, in rank order."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def _gather_counts(x: torch.Tensor) -> list[int]:
    """Every rank's number of rows of `x`."""
    n = torch.tensor([x.shape[0]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world_size())]
    dist.all_gather(sizes, n)
    return [int(s.item()) for s in sizes]


def _all_gather_rows(x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Gather tensors whose first dim differs across ranks: pad, gather, strip the padding."""
    pad = max(counts) - x.shape[0]
    xp = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x
    out = [torch.empty_like(xp) for _ in counts]
    dist.all_gather(out, xp.contiguous())
    return torch.cat([p[:c] for p, c in zip(out, counts, strict=True)])


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward sends each rank the gradient of its own rows.

    Every rank computes the same loss on the gathered features; its gradient w.r.t. the
    gathered tensor covers all rows. Summing those across ranks (all_reduce) and taking this
    rank's slice gives d(sum of per-rank losses)/d(local rows), which DDP then averages over
    ranks. Hence a loss computed identically on every rank trains exactly like one process
    holding the global batch.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ctx.counts = counts
        ctx.rank = rank()
        return _all_gather_rows(x, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None


def all_gather_with_grad(x: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """Concatenate `x` (N_r, ...) from all ranks, differentiably; ranks may differ in N_r.

    Returns the gathered tensor (sum N_r, ...) and the slice holding this rank's rows.
    """
    if not is_distributed():
        return x, slice(0, x.shape[0])
    counts = _gather_counts(x)
    start = sum(counts[: rank()])
    return _GatherWithGrad.apply(x, counts), slice(start, start + x.shape[0])


def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate `x` from all ranks in rank order (no gradient); ranks may differ in rows."""
    if not is_distributed():
        return x
    return _all_gather_rows(x, _gather_counts(x))
