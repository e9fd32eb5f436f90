"""kill -9 at any moment of a resume leaves each history file as it was or complete.

A resume rewrites metrics.jsonl (dropping the rows of steps after the checkpoint) and the
doctor's files; done in place, a kill during the rewrite left metrics.jsonl at 0 bytes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, kills, tiny_overrides
from vltrain.config import load_config
from vltrain.diagnostics.doctor import read_history
from vltrain.engine import loop
from vltrain.runs import train

KILLS = kills(4, 12)  # 12 with VLTRAIN_FULL_KILLS=1
HISTORY = ("metrics.jsonl", "doctor.jsonl", "doctor_steps.jsonl")


class Interrupt(Exception):
    pass


@pytest.fixture(scope="module")
def interrupted_run(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run checkpointed at step 2 and stopped after step 3, its metrics padded to ~20 MB (a
    long run's history) so that rewriting it takes a while."""
    run = tmp_path_factory.mktemp("kill") / "run"
    opts = {"train.max_steps": 6, "train.save_every": 2, "optim.warmup_steps": 0}
    cfg = load_config(None, tiny_overrides(shapes_dir, run, **opts))
    real = loop.Trainer._maybe_eval_and_save

    def stop_after_3(self, model, logger):
        real(self, model, logger)
        if self.state.step == 3:
            raise Interrupt

    loop.Trainer._maybe_eval_and_save = stop_after_3
    try:
        with pytest.raises(Interrupt):
            train(cfg)
    finally:
        loop.Trainer._maybe_eval_and_save = real
    metrics = run / "metrics.jsonl"
    pad = "".join(json.dumps({"step": 1, "note": "x" * 200}) + "\n" for _ in range(90_000))
    metrics.write_text(pad + metrics.read_text())
    return run


def _kept(run: Path) -> dict[str, bytes]:
    """What each history file must start with once the resume from step 2 rewrote it."""
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines()]
    metrics = [r for r in rows if json.loads(r).get("step", 0) <= 2]
    history = read_history(run, 2)
    return {
        "metrics.jsonl": "".join(r + "\n" for r in metrics).encode(),
        "doctor.jsonl": "".join(json.dumps(r) + "\n" for r in history.findings).encode(),
        "doctor_steps.jsonl": "".join(json.dumps(r) + "\n" for r in history.steps).encode(),
    }


def _rewriting(metrics: Path, before: os.stat_result) -> bool:
    if any(metrics.parent.glob(".metrics.jsonl.*")):
        return True  # the atomic rewrite's temp file
    try:
        now = metrics.stat()
    except FileNotFoundError:
        return True
    return (now.st_ino, now.st_size) != (before.st_ino, before.st_size)


def test_kill_9_during_resume_never_truncates_history(
    interrupted_run: Path, tmp_path: Path
) -> None:
    before = {n: (interrupted_run / n).read_bytes() for n in HISTORY}
    kept = _kept(interrupted_run)
    assert len(kept["metrics.jsonl"]) < len(before["metrics.jsonl"])  # the resume rewrites
    rng = random.Random(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    outcomes, width = [], 9.5 / (KILLS // 2)
    for i in range(KILLS):
        run = tmp_path / f"run_{i}"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(interrupted_run, run)
        metrics = run / "metrics.jsonl"
        st = metrics.stat()
        cmd = [sys.executable, "-m", "vltrain", "train", str(run / "config.yaml")]
        proc = subprocess.Popen(
            [*cmd, "train.resume=true", f"run.out_dir={run}"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # even kills: the moment the rewrite starts; odd ones: a random moment of the resume,
        # the j-th drawn from the j-th of KILLS // 2 equal parts of 0.5-10 s (early to late)
        lo = 0.5 + (i // 2) * width
        deadline = time.monotonic() + (120 if i % 2 == 0 else rng.uniform(lo, lo + width))
        while proc.poll() is None and time.monotonic() < deadline:
            if i % 2 == 0 and _rewriting(metrics, st):
                break
            time.sleep(0.0005)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for name in HISTORY:
            data = (run / name).read_bytes() if (run / name).exists() else b""
            same, complete = data == before[name], data.startswith(kept[name])
            assert same or complete, f"kill {i}: {name} is neither the old file nor complete"
            if name == "metrics.jsonl":
                outcomes.append("old" if same else "new")
    assert "new" in outcomes, f"no kill landed after a rewrite: {outcomes}"  # not vacuous
