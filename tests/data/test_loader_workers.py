"""DataLoader workers never outlive the trainer: a loader that fails leaves on a one-line
error (its workers ignore SIGTERM, the trainer's signal, so the interpreter's exit, which
terminates and then joins them, waited forever: a streaming run whose shard vanished hung after
printing its error), and a trainer killed outright takes its workers with it (they lived on,
holding their memory and shared segments)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = """
import os, sys, torch
from torch.utils.data import DataLoader, Dataset
from vltrain.cli import worker_message
from vltrain.data.loaders import start_workers, stop_workers, worker_init
from vltrain.data.readers import DataError

class Records(Dataset):
    def __len__(self):
        return 10_000
    def __getitem__(self, i):
        if i == 40:
            raise DataError("shard-000003.tar does not exist; check data.train")
        return torch.zeros(50_000)

it = start_workers(DataLoader(Records(), batch_size=2, num_workers=2, worker_init_fn=worker_init,
                              persistent_workers=True, prefetch_factor=4))
print(" ".join(str(w.pid) for w in it._workers), flush=True)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
try:
    for batch in it:
        pass
except DataError as e:
    print(worker_message(e), flush=True)
    if sys.argv[1] == "stop":
        stop_workers()
    sys.exit(2)
"""


def _run(tmp_path: Path, how: str, timeout: float) -> tuple[int | None, list[str]]:
    script = tmp_path / "loader.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = tmp_path / f"{how}.out"  # a file, not a pipe: a live worker would hold a pipe open
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(script), how], stdout=out, env=env)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    lines = log.read_text().splitlines()
    if rc is None:  # the control's workers, which ignore SIGTERM
        for pid in lines[0].split():
            subprocess.run(["kill", "-9", pid], capture_output=True)
    return rc, lines


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return (
        Path(f"/proc/{pid}/stat").is_file() and " Z " not in Path(f"/proc/{pid}/stat").read_text()
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork and /proc")
def test_a_failed_loader_leaves_with_its_message_and_no_worker(tmp_path: Path) -> None:
    rc, lines = _run(tmp_path, "stop", timeout=60)
    assert rc == 2, lines
    assert lines[1] == "shard-000003.tar does not exist; check data.train"  # no traceback
    assert not any(_alive(int(p)) for p in lines[0].split())
    # control: without stop_workers the exit waits on the workers (they ignore SIGTERM)
    rc, lines = _run(tmp_path, "keep", timeout=15)
    assert rc is None, lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")
def test_workers_die_with_a_killed_trainer(tmp_path: Path) -> None:
    rc, lines = _run(tmp_path, "kill", timeout=60)
    assert rc == -9
    pids = [int(p) for p in lines[0].split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
