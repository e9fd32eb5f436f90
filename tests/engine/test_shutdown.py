"""How a distributed run leaves its process group (`vltrain.core.distributed.shutdown`).

A finished rank waits for the others before it tears gloo down, so no rank closes its
connections under a peer that is still talking (a rank that did was seen to abort with SIGABRT
after a successful torchrun run). The wait is bounded: a peer that never arrives (it failed, or
was killed) is reported and the rank leaves anyway. After an error there is no wait at all."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vltrain.core import distributed


def _worker(rank: int, store: str, out: str, scenario: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    distributed.FINISH_TIMEOUT_S = 3
    marker = Path(out, f"{scenario}_rank1_arrived")
    if rank == 1:
        time.sleep(1.5 if scenario == "late_peer" else 8)  # rank 1 is still busy
        marker.touch()
        distributed.shutdown(finished=scenario == "late_peer")
    else:
        distributed.shutdown(finished=scenario != "error")
    # what rank 0 saw when it left: had rank 1 reached its shutdown?
    report = {"peer_arrived": marker.exists(), "initialized": dist.is_initialized()}
    Path(out, f"{scenario}_rank{rank}.json").write_text(json.dumps(report))


def _run(tmp_path: Path, scenario: str) -> list[dict]:
    store = tmp_path / f"store_{scenario}"
    mp.start_processes(
        _worker, args=(str(store), str(tmp_path), scenario), nprocs=2, join=True,
        start_method="spawn",
    )  # fmt: skip
    return [json.loads((tmp_path / f"{scenario}_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_finished_ranks_wait_for_each_other_then_leave(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "late_peer")
    assert all(not r["initialized"] for r in ranks)
    assert ranks[0]["peer_arrived"]  # rank 0 left only after rank 1 finished its work


@pytest.mark.slow
def test_a_missing_peer_bounds_the_wait(tmp_path: Path) -> None:
    # rank 1 arrives 8 s late (as if it failed); rank 0 waits FINISH_TIMEOUT_S = 3 s, then
    # leaves with a message instead of hanging for the group's 30-minute timeout
    ranks = _run(tmp_path, "missing_peer")
    assert all(not r["initialized"] for r in ranks)
    assert not ranks[0]["peer_arrived"]


@pytest.mark.slow
def test_after_an_error_nobody_waits(tmp_path: Path) -> None:
    ranks = _run(tmp_path, "error")
    assert all(not r["initialized"] for r in ranks)
    assert not ranks[0]["peer_arrived"]
