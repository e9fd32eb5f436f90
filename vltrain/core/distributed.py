"""Everything that touches torch.distributed lives here.

The loop, stages and losses call these helpers; they work unchanged in a single process
(where they are no-ops) and under `torchrun` (NCCL on GPU, gloo on CPU).

The device rule (invariant 7). NCCL accepts only CUDA tensors on the rank's own device, yet
callers hold tensors wherever they were made: the bad-sample vote is a CPU int64 vector, the
non-finite vote a CPU scalar, evaluation shards may live on the CPU. So the process group has
one *communication device*, `comm_device()`: `cuda:LOCAL_RANK` under NCCL, `cpu` under gloo.
Every helper copies its input there (`_to_comm`), runs the collective, and hands the result
back on the input's device and dtype; callers may pass tensors from any device. Collectives
write in place, so the copy is made even when the input already lives there: a helper never
mutates its argument.

Why one NCCL group and not `"cpu:gloo,cuda:nccl"`: a dual-backend group would make CPU
tensors "work" by silently sending them over gloo/TCP next to NCCL, hiding exactly the
mistake this rule catches, and the hot collectives (the contrastive gather with its backward,
gradient buckets) belong on NCCL anyway. The price of one device is a few bytes copied to
the GPU per vote, and the votes already synchronise the host with `.item()`. The object
collectives (`broadcast_object`, `all_gather_object`) pickle to a uint8 tensor and use the
same path (trusted pickle: our own processes), and `barrier` is an all-reduce of one element
read back on the host, so it blocks the host under NCCL as well.

Strict mode (`VLTRAIN_STRICT_COLLECTIVES`, or `set_strict(declared_device)`) checks the rule.
Every helper's collective passes one checkpoint, `_collective`, and in strict mode
torch.distributed's tensor collectives (`all_reduce`, `all_gather`, `broadcast`,
`reduce_scatter`, ...) are wrapped so that raw calls from outside torch are checked too
(torch's own internals, DDP's reducer, FSDP, place their tensors themselves and are not
checked). A tensor passes if it sits on the declared device, or if it came out of the
placement step, which marks what it produces as placed on the declared device. Anything else
fails with `CollectiveDeviceError`, naming the helper (or raw call and its caller) and the
tensor's device. Environment values: unset, "" or "0": off; "1": the declared device is the
group's own `comm_device()`; a device string ("cuda", "cuda:0", "cpu"): that device.

Emulating NCCL on gloo: the tests set `VLTRAIN_STRICT_COLLECTIVES=cuda` (tests/conftest.py,
so torchrun children inherit it). The gloo group physically communicates on the CPU, but
strict mode declares "cuda": a CPU tensor is then accepted only if placement produced it,
which is what would have put it on the GPU under NCCL. Code that hands the caller's CPU
tensor straight to `dist.*` (vltrain before issue 11) fails on gloo exactly where NCCL would.
"""

from __future__ import annotations

import functools
import gc
import os
import pickle
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STRICT_ENV = "VLTRAIN_STRICT_COLLECTIVES"
_MARK = "_vltrain_placed_on"  # attribute placement sets: the declared device, as a string
FINISH_TIMEOUT_S = 300  # shutdown(finished=True): how long a rank waits for the others
_GROUP = "group"  # set_strict's "declare the group's own comm_device()"
_UNSET = object()
_strict_override: Any = _UNSET  # set_strict's choice; _UNSET defers to the environment
# wrapped in strict mode; each takes tensors (or lists of them) in its arguments
_GUARDED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "gather",
    "scatter",
)
_originals: dict[str, Callable[..., Any]] = {}


class CollectiveDeviceError(RuntimeError):
    """A tensor reached a collective off the process group's declared communication device."""


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched_world_size() -> int:
    """The world size the launcher (torchrun) set: readable before the process group exists,
    e.g. to check a config at load."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    return rank() == 0


def init_from_env(device_type: str) -> None:
    """Join the process group torchrun describes in the environment (no-op without torchrun)."""
    if strict_device() is not None:
        _install_guards()
    if launched_world_size() <= 1 or dist.is_initialized():
        return
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))


def shutdown(finished: bool = False) -> None:
    """Leave the process group.

    `finished=True` (every rank returned from its work): first wait, at most
    `FINISH_TIMEOUT_S`, until every rank got here, so no rank closes its connections while a
    peer still talks on them (a rank that tore down gloo under a peer's last messages was seen
    to abort, SIGABRT, after a successful run), and drop unreachable objects (a DDP reducer)
    that still hold the group. After an error, no collective: a rank that already left must
    not leave another waiting."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if finished and is_distributed():
        try:
            if "gloo" in str(dist.get_backend()):
                dist.monitored_barrier(timeout=timedelta(seconds=FINISH_TIMEOUT_S))
            else:
                barrier()
        except RuntimeError as e:  # a peer failed or left: leave anyway, say so
            print(f"[rank {rank()}] leaving without the final barrier: {e}", file=sys.stderr)
    global _checkpoint_group
    _checkpoint_group = None  # destroyed with the default group
    gc.collect()
    dist.destroy_process_group()


def comm_device() -> torch.device:
    """The device this process group's collectives run on: cuda:LOCAL_RANK under NCCL, else cpu."""
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", local_rank())
    return torch.device("cpu")


# ---------------------------------------------------------------- strict mode


def _parse_declared(value: str | torch.device | None) -> str | torch.device | None:
    if value is None or value in ("", "0"):
        return None
    if value in ("1", _GROUP):
        return _GROUP
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"strict collectives: {value!r} is not a device; set {STRICT_ENV} to 0 (off), "
            "1 (the group's own device) or a device such as 'cuda'"
        ) from e


def set_strict(declared_device: str | torch.device | None = _GROUP) -> None:
    """Check every collective against `declared_device` ("group": the group's own
    `comm_device()`; "cuda" on gloo emulates NCCL's rule); None turns strict mode off."""
    global _strict_override
    _strict_override = _parse_declared(declared_device)
    if _strict_override is None:
        _remove_guards()
    else:
        _install_guards()


def strict_device() -> torch.device | None:
    """The declared communication device strict mode checks against, or None when off."""
    choice = _strict_override
    if choice is _UNSET:
        choice = _parse_declared(os.environ.get(STRICT_ENV))
    if choice is None:
        return None
    return comm_device() if choice == _GROUP else choice


def _declared_or_comm() -> torch.device:
    return strict_device() or comm_device()


def _mark(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _MARK, str(_declared_or_comm()))
    return t


def _on(device: torch.device, declared: torch.device) -> bool:
    return device.type == declared.type and declared.index in (None, device.index)


def _check(where: str, tensors: list[torch.Tensor]) -> None:
    """Strict mode: reject a tensor neither placed on nor living on the declared device."""
    declared = strict_device()
    if declared is None:
        return
    for t in tensors:
        placed = getattr(t, _MARK, None) == str(declared) and t.device == comm_device()
        if not (placed or _on(t.device, declared)):
            raise CollectiveDeviceError(
                f"{where}: a {tuple(t.shape)} {t.dtype} tensor on {t.device} reached a "
                f"collective, but the process group communicates on {declared} (NCCL accepts "
                "only CUDA tensors); pass it through a vltrain.core.distributed helper, "
                "which moves it to comm_device() and back"
            )


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors in a collective's arguments (bare, or in a list or tuple)."""
    out = []
    for a in (*args, *kwargs.values()):
        items = a if isinstance(a, list | tuple) else [a]
        out += [x for x in items if isinstance(x, torch.Tensor)]
    return out


def _guard(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        caller = frame.f_globals.get("__name__", "?")
        if not caller.startswith("torch."):
            where = f"torch.distributed.{name} called from {caller}.{frame.f_code.co_qualname}"
            _check(where, _tensors(args, kwargs))
        return fn(*args, **kwargs)

    return guarded


def _install_guards() -> None:
    for name in _GUARDED:
        if name not in _originals and hasattr(dist, name):
            _originals[name] = getattr(dist, name)
            setattr(dist, name, _guard(name, _originals[name]))


def _remove_guards() -> None:
    for name, fn in _originals.items():
        setattr(dist, name, fn)
    _originals.clear()


if strict_device() is not None:  # the tests' environment: catch raw calls from the start
    _install_guards()


# ---------------------------------------------------------------- placement and checkpoint


def _to_comm(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` on comm_device(), marked as placed there."""
    out = t.detach().to(comm_device(), copy=True, memory_format=torch.contiguous_format)
    return _mark(out)


def _comm_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An output buffer on comm_device(), marked as placed there."""
    return _mark(torch.empty(shape, dtype=dtype, device=comm_device()))


def _collective(helper: str, name: str, /, *args: Any, **kwargs: Any) -> None:
    """The one checkpoint every helper's collective passes: check placement, run `dist.<name>`."""
    if strict_device() is not None:
        _install_guards()
    _check(helper, _tensors(args, kwargs))
    getattr(dist, name)(*args, **kwargs)


# ---------------------------------------------------------------- helpers


def barrier() -> None:
    """Wait until every rank arrives (the host blocks, under NCCL too)."""
    if is_distributed():
        flag = _comm_empty((1,), torch.int32).zero_()
        _collective("barrier", "all_reduce", flag, op=dist.ReduceOp.SUM)
        flag.item()


def _all_reduce(helper: str, t: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
    if not is_distributed():
        return t.clone()
    c = _to_comm(t)
    _collective(helper, "all_reduce", c, op=op)
    return c.to(t.device)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, as a new tensor on `t`'s device; identity (a copy) in one process."""
    return _all_reduce("all_reduce_sum", t, dist.ReduceOp.SUM)


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over ranks, as a new tensor on `t`'s device."""
    return _all_reduce("all_reduce_mean", t, dist.ReduceOp.SUM) / world_size()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise max over ranks, as a new tensor on `t`'s device."""
    return _all_reduce("all_reduce_max", t, dist.ReduceOp.MAX)


def _broadcast(helper: str, t: torch.Tensor, src: int) -> torch.Tensor:
    c = _to_comm(t)
    _collective(helper, "broadcast", c, src=src)
    return c.to(t.device)


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `tensor` on every rank (same shape and dtype everywhere), on the input's
    device; the input is not modified."""
    if not is_distributed():
        return tensor.clone()
    return _broadcast("broadcast", tensor, src)


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _from_bytes(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())  # trusted: our own processes


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Send a picklable object from `src` to every rank (trusted: our own processes)."""
    if not is_distributed():
        return obj
    data = _to_bytes(obj) if rank() == src else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    n = int(_broadcast("broadcast_object", size, src).item())
    if rank() != src:
        data = torch.zeros(n, dtype=torch.uint8)
    return _from_bytes(_broadcast("broadcast_object", data, src))


_checkpoint_group: Any = None


def checkpoint_group() -> Any:
    """A gloo process group of every rank for background checkpoint writes (created on the
    first call, which every rank makes): a thread's collectives never interleave with the
    training group's. None outside distributed runs."""
    global _checkpoint_group
    if not is_distributed():
        return None
    if _checkpoint_group is None:
        _checkpoint_group = dist.new_group(backend="gloo")
    return _checkpoint_group


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's object, in rank order."""
    if not is_distributed():
        return [obj]
    data = _to_bytes(obj)
    counts = _gather_counts(data, "all_gather_object")
    flat = _all_gather_rows(data, counts, "all_gather_object")
    starts = [sum(counts[:r]) for r in range(len(counts))]
    return [_from_bytes(flat[s : s + c]) for s, c in zip(starts, counts, strict=True)]


def _gather_counts(x: torch.Tensor, helper: str = "_gather_counts") -> list[int]:
    """Every rank's number of rows of `x`."""
    n = _to_comm(torch.tensor([x.shape[0]], dtype=torch.int64))
    sizes = [_comm_empty((1,), torch.int64) for _ in range(world_size())]
    _collective(helper, "all_gather", sizes, n)
    return torch.cat(sizes).tolist()


def _all_gather_rows(
    x: torch.Tensor, counts: list[int], helper: str = "_all_gather_rows"
) -> torch.Tensor:
    """Gather tensors whose first dim differs across ranks: pad, gather, strip the padding.

    The result lives on `x`'s device."""
    pad = max(counts) - x.shape[0]
    xp = _to_comm(torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x)
    out = [_comm_empty(xp.shape, xp.dtype) for _ in counts]
    _collective(helper, "all_gather", out, xp)
    return torch.cat([p[:c] for p, c in zip(out, counts, strict=True)]).to(x.device)


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
        ctx.device = x.device
        return _all_gather_rows(x, counts, "all_gather_with_grad")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = _to_comm(grad)
        _collective("all_gather_with_grad (backward)", "all_reduce", g, op=dist.ReduceOp.SUM)
        start = sum(ctx.counts[: ctx.rank])
        return g[start : start + ctx.counts[ctx.rank]].to(ctx.device), None


def all_gather_with_grad(x: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """Concatenate `x` (N_r, ...) from all ranks, differentiably; ranks may differ in N_r.

    Returns the gathered tensor (sum N_r, ...) on `x`'s device and the slice holding this
    rank's rows.
    """
    if not is_distributed():
        return x, slice(0, x.shape[0])
    counts = _gather_counts(x, "all_gather_with_grad")
    start = sum(counts[: rank()])
    return _GatherWithGrad.apply(x, counts), slice(start, start + x.shape[0])


def all_gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """Concatenate `x` from all ranks in rank order (no gradient); ranks may differ in rows."""
    if not is_distributed():
        return x
    return _all_gather_rows(x, _gather_counts(x, "all_gather_no_grad"), "all_gather_no_grad")
