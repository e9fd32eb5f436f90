"""A run folder is locked while a process trains in it (run_dir.LOCK: host and pid)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides
from vltrain.cli import main
from vltrain.config import ConfigError, load_config
from vltrain.engine import run_dir
from vltrain.runs import train


def _lock(run: Path, pid: int, host: str | None = None) -> None:
    run.mkdir(parents=True, exist_ok=True)
    holder = {"host": host or socket.gethostname(), "pid": pid}
    (run / run_dir.LOCK).write_text(json.dumps(holder))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def finished_run(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("lock") / "run"
    seen = []

    def on_eval(step: int, metrics: dict) -> None:
        seen.append(json.loads((run / run_dir.LOCK).read_text()))

    opts = {"train.max_steps": 2, "train.eval_every": 2, "optim.warmup_steps": 0}
    train(load_config(None, tiny_overrides(shapes_dir, run, **opts)), on_eval=on_eval)
    # held while training, by this host and process; gone at the end
    assert seen == [{"host": socket.gethostname(), "pid": os.getpid()}]
    assert not (run / run_dir.LOCK).exists()
    return run


@pytest.mark.parametrize("host", [None, "another-host"])
def test_a_second_train_or_resume_in_a_locked_run_is_refused(
    finished_run: Path, shapes_dir: Path, tmp_path: Path, capsys, host: str | None
) -> None:
    live = os.getppid()  # a live process that is not this one
    _lock(finished_run, live, host)
    before = {p: p.stat().st_mtime_ns for p in finished_run.rglob("*")}
    try:
        resume = ["train", str(finished_run / "config.yaml"), "train.resume=true"]
        over = ["train", str(finished_run / "config.yaml"), "train.overwrite=true"]
        for argv in (resume, over):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert f"process {live}" in err and "in use" in err, err
            assert (host or "on this host") in err
        assert {p: p.stat().st_mtime_ns for p in finished_run.rglob("*")} == before
    finally:
        (finished_run / run_dir.LOCK).unlink()


def test_a_dead_process_lock_is_taken_over_with_a_message(
    shapes_dir: Path, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "run"
    dead = _dead_pid()
    _lock(run, dead)
    opts = {"train.max_steps": 1, "optim.warmup_steps": 0}
    assert (
        main(
            ["train", str(REPO / "configs" / "clip.yaml"), *tiny_overrides(shapes_dir, run, **opts)]
        )
        == 0
    )
    assert f"process {dead} has ended" in capsys.readouterr().out
    assert not (run / run_dir.LOCK).exists()


def test_the_lock_is_created_exclusively(tmp_path: Path) -> None:
    """Two processes planning one folder at once: the one that creates the lock second is
    refused (O_EXCL), not silently sharing it; this process's own lock is retaken."""
    run = tmp_path / "run"
    run.mkdir()
    _lock(run, os.getppid())  # a live process took the folder after this one planned it
    with pytest.raises(ConfigError, match="is in use"):
        run_dir._create_lock(run / run_dir.LOCK)
    _lock(run, os.getpid())
    run_dir._create_lock(run / run_dir.LOCK)
    assert json.loads((run / run_dir.LOCK).read_text())["pid"] == os.getpid()
    control = tmp_path / "free"
    control.mkdir()
    run_dir._create_lock(control / run_dir.LOCK)  # no lock yet: created
    assert (control / run_dir.LOCK).is_file()
