"""Strict collectives: every collective sees tensors on the declared communication device.

- the checkpoint itself (one process): unplaced tensors are rejected when the declared device
  differs from theirs, placed ones pass, raw `dist.*` calls are wrapped from the environment;
- two spawned gloo ranks with the declared device "cuda" (NCCL's rule, emulated): the helpers
  pass with the right values, including the with-grad gather's backward; negative controls:
  the same helpers with placement disabled, and vltrain's pre-fix helpers
  (tests/engine/legacy_distributed.py), fail with the strict error; those pre-fix helpers pass
  when the declared device is the group's own (cpu), so the failures are the device rule.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.engine import legacy_distributed
from vltrain.core import distributed


@pytest.fixture
def strict_state() -> Iterator[None]:
    """Restore strict mode to what the environment (tests/conftest.py) asks for."""
    yield
    distributed._strict_override = distributed._UNSET
    distributed._remove_guards()
    if distributed.strict_device() is not None:
        distributed._install_guards()


def test_suite_runs_strict_with_cuda_declared() -> None:
    assert distributed.strict_device() == torch.device("cuda")
    assert dist.all_reduce is not dist.distributed_c10d.all_reduce  # raw calls are wrapped


def test_checkpoint_rejects_unplaced_tensors(strict_state: None) -> None:
    distributed.set_strict("cuda")
    cpu = torch.zeros(3)
    with pytest.raises(
        distributed.CollectiveDeviceError, match=r"my_helper: a \(3,\) .* on cpu .* cuda"
    ):
        distributed._check("my_helper", [cpu])
    placed = distributed._to_comm(cpu)
    distributed._check("my_helper", [placed])
    assert placed.data_ptr() != cpu.data_ptr()  # collectives write in place: never the input
    with pytest.raises(distributed.CollectiveDeviceError):
        distributed._check("my_helper", [placed[:2]])  # a view was not produced by placement
    distributed.set_strict("cpu")
    distributed._check("my_helper", [cpu])  # on the declared device itself
    distributed.set_strict(None)
    distributed._check("my_helper", [cpu])
    assert dist.all_reduce is dist.distributed_c10d.all_reduce and not distributed._originals


def test_raw_call_outside_helpers_is_caught(strict_state: None) -> None:
    distributed.set_strict("cuda")
    with pytest.raises(
        distributed.CollectiveDeviceError, match="torch.distributed.all_reduce called from"
    ):
        dist.all_reduce(torch.zeros(2))
    with pytest.raises((ValueError, RuntimeError), match="(?i)process group"):
        dist.all_reduce(distributed._to_comm(torch.zeros(2)))  # passes the check; no group here


@pytest.mark.parametrize(
    ("value", "expected"), [("", None), ("0", None), ("1", "cpu"), ("cuda", "cuda")]
)
def test_environment_values(
    value: str, expected: str | None, monkeypatch: pytest.MonkeyPatch, strict_state: None
) -> None:
    monkeypatch.setenv(distributed.STRICT_ENV, value)
    distributed._strict_override = distributed._UNSET
    got = distributed.strict_device()
    assert (got and str(got)) == expected


def test_unknown_declared_device_is_a_clear_error(strict_state: None) -> None:
    with pytest.raises(ValueError, match="VLTRAIN_STRICT_COLLECTIVES to 0 .off., 1"):
        distributed.set_strict("gpu0")


# ---------------------------------------------------------------- two spawned gloo ranks


def _helper_calls(mod: ModuleType, r: int) -> dict[str, Callable[[], Any]]:
    """Each helper on rank `r`'s CPU inputs; the value returned is what the test compares."""
    rows = torch.arange(2 * (r + 1), dtype=torch.float32).reshape(r + 1, 2) + 10 * r

    def reduce_sum() -> Any:
        t = torch.tensor([r + 1, 10], dtype=torch.int64)
        out = mod.all_reduce_sum(t)
        return [out.tolist(), str(out.dtype), str(out.device), t.tolist()]

    calls = {
        "all_reduce_sum": reduce_sum,
        "all_reduce_mean": lambda: mod.all_reduce_mean(torch.tensor([2.0 * r])).tolist(),
        "all_reduce_max": lambda: mod.all_reduce_max(torch.tensor([r, -r]).double()).tolist(),
        "barrier": lambda: mod.barrier(),
        "broadcast_object": lambda: mod.broadcast_object({"from": r, "x": [r] * 3}, src=1),
        "all_gather_object": lambda: mod.all_gather_object(("x" * (50 * r), r)),
        "all_gather_no_grad": lambda: mod.all_gather_no_grad(rows).tolist(),
    }
    if hasattr(mod, "broadcast"):
        calls["broadcast"] = lambda: mod.broadcast(torch.tensor([r + 5.0]), src=1).tolist()
    return calls


def _with_grad(mod: ModuleType, r: int, declared: str) -> dict[str, Any]:
    """The differentiable gather, forward and backward checked separately: the forward runs
    strict, then strict is lifted for a forward whose backward alone runs strict."""
    out: dict[str, Any] = {}
    weights = torch.arange(6, dtype=torch.float32).reshape(3, 2)
    x = torch.full((r + 1, 2), r + 1.0, requires_grad=True)
    distributed.set_strict(declared)
    out["all_gather_with_grad"] = _attempt(lambda: mod.all_gather_with_grad(x)[0].tolist())
    distributed.set_strict(None)
    gathered, mine = mod.all_gather_with_grad(x)
    distributed.set_strict(declared)

    def backward() -> Any:
        (gathered * weights).sum().backward()  # the same loss on both ranks
        return [x.grad.tolist(), [mine.start, mine.stop]]

    out["all_gather_with_grad (backward)"] = _attempt(backward)
    return out


def _attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "value": fn()}
    except distributed.CollectiveDeviceError as e:
        return {"ok": False, "error": str(e)}


def _scenario(mod: ModuleType, r: int, declared: str, placement: bool) -> dict[str, Any]:
    mark = distributed._mark
    if not placement:
        distributed._mark = lambda t: (
            t
        )  # placement copies but no longer marks: as if it were skipped
    try:
        distributed.set_strict(declared)
        res = {name: _attempt(fn) for name, fn in _helper_calls(mod, r).items()}
        return {**res, **_with_grad(mod, r, declared)}
    finally:
        distributed._mark = mark
        distributed.set_strict(None)


SCENARIOS = {  # name: (module, declared device, placement on)
    "fixed": (distributed, "cuda", True),
    "no_placement": (distributed, "cuda", False),
    "legacy": (legacy_distributed, "cuda", True),
    "legacy_declared_cpu": (legacy_distributed, "group", True),
}


def _worker(r: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=r, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        report = {k: _scenario(mod, r, *rest) for k, (mod, *rest) in SCENARIOS.items()}
        Path(out, f"rank{r}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("strict")
    # spawn, not fork: a child forked from the threaded pytest process can hang
    mp.start_processes(
        _worker, args=(str(out / "store"), str(out)), nprocs=2, join=True, start_method="spawn"
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


EXPECTED = {  # helper: value on rank 0, value on rank 1
    # the sum, its dtype and device, and the caller's tensor, untouched
    "all_reduce_sum": [[[3, 20], "torch.int64", "cpu", [r + 1, 10]] for r in range(2)],
    "all_reduce_mean": [[1.0], [1.0]],
    "all_reduce_max": [[1.0, 0.0], [1.0, 0.0]],
    "barrier": [None, None],
    "broadcast": [[6.0], [6.0]],
    "broadcast_object": [{"from": 1, "x": [1, 1, 1]}] * 2,
    "all_gather_object": [[["", 0], ["x" * 50, 1]]] * 2,
    "all_gather_no_grad": [[[0.0, 1.0], [10.0, 11.0], [12.0, 13.0]]] * 2,
    "all_gather_with_grad": [[[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]] * 2,
    # both ranks' losses: twice the weights, each rank gets its own rows
    "all_gather_with_grad (backward)": [
        [[[0.0, 2.0]], [0, 1]],
        [[[4.0, 6.0], [8.0, 10.0]], [1, 3]],
    ],
}


def test_fixed_helpers_pass_strict_cuda_with_right_values(reports: list[dict]) -> None:
    for r, rep in enumerate(reports):
        assert rep["fixed"].keys() == EXPECTED.keys()
        for helper, want in EXPECTED.items():
            got = rep["fixed"][helper]
            assert got["ok"], got
            assert got["value"] == want[r], (helper, r)


def test_negative_control_helpers_without_placement_fail(reports: list[dict]) -> None:
    for rep in reports:
        for helper, got in rep["no_placement"].items():
            assert not got["ok"], helper  # every helper's collective passes the checkpoint
            assert got["error"].startswith(f"{helper}: a "), got["error"]
            assert "on cpu reached a collective" in got["error"]
            assert "communicates on cuda" in got["error"]


def test_negative_control_pre_fix_helpers_fail(reports: list[dict]) -> None:
    # torch places the tensors of its own barrier and object collectives; the tensor
    # helpers handed the caller's CPU tensor to NCCL
    tensor_helpers = {
        "all_reduce_sum": "all_reduce",
        "all_reduce_mean": "all_reduce",
        "all_reduce_max": "all_reduce",
        "all_gather_no_grad": "all_gather",
        "all_gather_with_grad": "all_gather",
        "all_gather_with_grad (backward)": "all_reduce",
    }
    for r, rep in enumerate(reports):
        for helper, got in rep["legacy"].items():
            if helper not in tensor_helpers:
                assert got["ok"] and got["value"] == EXPECTED[helper][r], helper
                continue
            assert not got["ok"], helper
            raw = f"torch.distributed.{tensor_helpers[helper]} called from "
            assert got["error"].startswith(raw + "tests.engine.legacy_distributed."), got
            assert "on cpu reached a collective" in got["error"]
        # the same code with the group's own device declared: all pass, same values
        for helper, got in rep["legacy_declared_cpu"].items():
            assert got["ok"], got
            assert got["value"] == EXPECTED[helper][r], helper
