"""Signals the way clusters send them: to the whole process group (the trainer and its DataLoader
workers), to torchrun, or to one rank. Every rank stops at the same step boundary with a
complete checkpoint and exits 128 + signal; resuming equals the uninterrupted run, every loss
bit-identical. `train.checkpoint_on: [SIGUSR1]` (SLURM's early warning) saves and goes on.

Most signals are sent by `tests/engine/signal_driver.py` at a fixed moment (after a step,
inside a checkpoint write, inside an evaluation), from a child process as `kill` would, so the
boundary is known without sleeping and hoping.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, tiny_overrides
from vltrain.config import load_config
from vltrain.config.core import ConfigError
from vltrain.core import checkpoint
from vltrain.data.loaders import MapLoader

STEPS = 8
# evaluation at step 4 (the `eval` case signals inside it) and the end; a save at step 4 (the
# `save` case signals inside it)
OVER = {"train.max_steps": STEPS, "train.eval_every": 4, "train.save_every": 4}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _args(shapes_dir: Path, out: Path, workers: int, *extra: str) -> list[str]:
    over = {**OVER, "data.num_workers": workers}
    return ["train", str(REPO / "configs" / "clip.yaml"), *tiny_overrides(shapes_dir, out, **over)]


def _start(cmd: list[str], **env: str) -> subprocess.Popen:
    """A command in a new session: its process group holds it and its DataLoader workers."""
    return subprocess.Popen(
        cmd, env={**ENV, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, cwd=REPO,
    )  # fmt: skip


def _driven(where: str, step: int, sig: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "tests.engine.signal_driver", where, str(step), sig, *args]


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    """Wait for `proc`, then for its process group to empty: DataLoader workers ignore the
    signals, so they must have been shut down by the trainer, not left behind."""
    _, err = proc.communicate(timeout=300)
    deadline = time.time() + 20
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.time() < deadline, "processes of the run outlived it (DataLoader workers?)"
        time.sleep(0.1)
    return proc.returncode, err.decode()


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _resume(run: Path, torchrun: bool = False) -> None:
    cmd = [sys.executable, "-m", "vltrain", "train", str(run / "config.yaml"), "train.resume=true"]
    if torchrun:
        cmd = [*TORCHRUN, *cmd[1:]]
    code, err = _finish(_start(cmd))
    assert code == 0, err[-3000:]


def _check_stopped(run: Path, code: int, err: str, sig: int, at: int | None) -> int:
    """Exit 128 + sig, one line, no traceback; the newest checkpoint is complete, no temp
    folder left; returns the step it stopped at."""
    assert code == 128 + sig, err[-3000:]
    assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
    assert f"{signal.Signals(sig).name} received: stopped at step" in err
    saved = checkpoint.latest_checkpoint(run / "checkpoints")
    assert saved is not None
    checkpoint.check_loadable(saved)
    assert not list((run / "checkpoints").glob(".tmp_*"))
    stopped_at = int(saved.name.split("_")[1])
    if at is not None:
        assert stopped_at == at
    assert stopped_at < STEPS
    return stopped_at


_REFERENCE: dict[int, float] = {}


def _reference(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted run's losses (2 DataLoader workers; run once). The workers do not
    change the batches, so the runs stopped with 0 workers resume to these losses as well."""
    if not _REFERENCE:
        out = tmp_path_factory.mktemp("reference") / "run"
        code, err = _finish(_start([sys.executable, "-m", "vltrain", *_args(shapes_dir, out, 2)]))
        assert code == 0, err[-3000:]
        _REFERENCE.update(_losses(out))
    return _REFERENCE


# (where the signal is sent, after which step, signal, DataLoader workers, expected stop step):
# after step 3 the next boundary is 3; a signal during step 4's save or evaluation lets them
# finish, then stops at 4 without saving twice
CASES = [
    ("step", 3, "SIGTERM", 2, 3),
    ("step", 3, "SIGINT", 2, 3),
    ("step", 3, "SIGTERM", 0, 3),
    ("save", 4, "SIGTERM", 2, 4),
    ("eval", 4, "SIGINT", 2, 4),
]


@pytest.mark.slow  # ~25 s on 2 shared cores: a stopped run, its resume (and the reference)
@pytest.mark.parametrize(("where", "after", "sig", "workers", "at"), CASES)
def test_a_signal_to_the_process_group_stops_at_a_boundary_and_resumes_exactly(
    shapes_dir: Path,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    where: str,
    after: int,
    sig: str,
    workers: int,
    at: int,
) -> None:
    run = tmp_path / "run"
    proc = _start(_driven(where, after, sig, _args(shapes_dir, run, workers)))
    code, err = _finish(proc)
    _check_stopped(run, code, err, signal.Signals[sig].value, at)
    if where in ("save", "eval"):  # the interrupted save / evaluation completed: best exists
        assert (run / "checkpoints" / "best" / "best.json").is_file()
    _resume(run)
    assert _losses(run) == _reference(shapes_dir, tmp_path_factory)


@pytest.mark.slow
def test_sigterm_from_outside_to_the_process_group_with_workers(
    shapes_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """No hook: `kill -TERM -PGID` at whatever moment three steps are logged."""
    run = tmp_path / "run"
    proc = _start([sys.executable, "-m", "vltrain", *_args(shapes_dir, run, 2)])
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (
        not metrics.is_file() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    code, err = _finish(proc)
    _check_stopped(run, code, err, signal.SIGTERM, None)
    _resume(run)
    assert _losses(run) == _reference(shapes_dir, tmp_path_factory)


@pytest.mark.slow
def test_checkpoint_on_sigusr1_saves_and_continues(
    shapes_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    run = tmp_path / "run"
    args = _args(shapes_dir, run, 2) + ["train.save_every=0", "train.checkpoint_on=[SIGUSR1]"]
    code, err = _finish(_start(_driven("step", 2, "SIGUSR1", args)))
    assert code == 0, err[-3000:]
    # sent after step 2: the ranks agree at step 3's boundary and save after step 3
    assert "SIGUSR1 received: saved" in err and "training continues" in err
    saved = {p.name for p in (run / "checkpoints").glob("step_*")}
    assert {"step_3", f"step_{STEPS}"} <= saved  # (and step_4, the best at eval)
    checkpoint.check_loadable(run / "checkpoints" / "step_3")
    # the save changed nothing in the run (save_every differs from the reference: harmless)
    assert _losses(run) == _reference(shapes_dir, tmp_path_factory)


class _Numbers(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor([i]), "key": (0, i, i), "index": i}


class _Pairs:
    """A position sampler of the batches [0, 1], [2, 3], ... (position ignored)."""

    def __iter__(self):
        return iter([[i, i + 1] for i in range(0, 64, 2)])

    def __len__(self) -> int:
        return 32

    def set_position(self, position: tuple[int, int]) -> None:
        pass

    def position_after(self, key: tuple[int, int, int]) -> tuple[int, int]:
        return (0, key[1] + 1)


def _stack(samples: list[dict]) -> dict:
    return {"x": torch.cat([s["x"] for s in samples])}


def test_loader_workers_ignore_the_trainers_signals() -> None:
    """SIGTERM, SIGINT and SIGUSR1 sent to the workers from outside (as a process-group signal
    reaches them) leave them loading: before, torch's worker handler re-raised the outside
    SIGTERM and the trainer died of `DataLoader worker (pid ...) is killed by signal`."""
    before = {p.pid for p in multiprocessing.active_children()}
    loader = MapLoader(_Numbers(), _Pairs(), _stack, num_workers=2, seed=0)
    batches = iter(loader)
    first = next(batches)
    workers = [p.pid for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == 2
    for sig in ("TERM", "INT", "USR1"):
        for pid in workers:  # from another process (`kill`), not the workers' parent
            subprocess.run(["kill", f"-{sig}", str(pid)], check=True)
    time.sleep(0.5)  # delivered by now
    rest = list(batches)
    assert first.data["x"].tolist() == [0, 1] and len(rest) == 31
    assert rest[-1].data["x"].tolist() == [62, 63]
    assert all(p.is_alive() is False for p in multiprocessing.active_children() if p.pid in workers)


def test_checkpoint_on_names_a_signal_that_continues(shapes_dir: Path, tmp_path: Path) -> None:
    over = tiny_overrides(shapes_dir, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"checkpoint_on.*SIGUSR1.*'SIGTERM'"):
        load_config(None, [*over, "train.checkpoint_on=[SIGTERM]"])
    assert load_config(None, [*over, "train.checkpoint_on=[SIGUSR2]"]).train.checkpoint_on


@pytest.fixture(scope="module")
def torchrun_reference(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("torchrun") / "full"
    code, err = _finish(_start([*TORCHRUN, "-m", "vltrain", *_args(shapes_dir, out, 1)]))
    assert code == 0, err[-3000:]
    return _losses(out)


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_both_ranks_and_resumes_exactly(
    shapes_dir: Path, tmp_path: Path, torchrun_reference: dict[int, float]
) -> None:
    """`kill -TERM -PGID` of torchrun (it forwards SIGTERM to each rank's process group, the
    ranks' DataLoader workers included)."""
    run = tmp_path / "run"
    proc = _start([*TORCHRUN, "-m", "vltrain", *_args(shapes_dir, run, 1)])
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (
        not metrics.is_file() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    code, err = _finish(proc)
    assert code != 0  # torchrun reports its signal
    assert err.count("SIGTERM received: stopped at step") == 2, err[-3000:]  # both ranks
    assert "Traceback" not in err.split("SIGTERM received")[0]
    saved = checkpoint.latest_checkpoint(run / "checkpoints")
    assert saved is not None and int(saved.name.split("_")[1]) < STEPS
    checkpoint.check_loadable(saved)
    _resume(run, torchrun=True)
    assert _losses(run) == torchrun_reference


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank(
    shapes_dir: Path, tmp_path: Path, torchrun_reference: dict[int, float]
) -> None:
    run = tmp_path / "run"
    cmd = [*TORCHRUN, "-m", "tests.engine.signal_driver", "step", "3", "SIGTERM"]
    proc = _start([*cmd, *_args(shapes_dir, run, 1)], SIGNAL_RANK="1", TARGET="rank")
    code, err = _finish(proc)
    assert code != 0
    assert "SIGTERM received: stopped at step 3" in err, err[-3000:]  # rank 1
    assert "another rank got a signal: stopped at step 3" in err, err[-3000:]  # rank 0
    checkpoint.check_loadable(run / "checkpoints" / "step_3")
    _resume(run, torchrun=True)
    assert _losses(run) == torchrun_reference
