"""A real 2-process vltrain run under strict collectives with NCCL's rule emulated on gloo.

The tiny CLIP config under torchrun with the declared device "cuda": the loop's per-step votes
(bad samples, non-finite loss), the contrastive gather and its backward, and the sharded
evaluation all pass the checkpoint, placed. Negative controls: the same run with placement
disabled from the first step, and with the helpers vltrain had before issue 11, fails at the
first step's bad-sample vote with the strict error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides

STEPS = 3


def _strict_run(mode: str, shapes_dir: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [
        "-m",
        "tests.engine.strict_run",
        mode,
        str(out),
        "train",
        str(REPO / "configs/clip.yaml"),
    ]
    cmd += tiny_overrides(shapes_dir, out / "run", **{"train.max_steps": STEPS})
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLTRAIN_STRICT_COLLECTIVES": "cuda",
    }
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _calls(out: Path, rank: int) -> dict[str, int]:
    return json.loads((out / f"rank{rank}.json").read_text())


def _count(calls: dict[str, int], helper: str, caller: str) -> int:
    return sum(n for k, n in calls.items() if k.startswith(f"{helper} <- ") and caller in k)


@pytest.mark.slow
def test_training_collectives_are_placed_under_strict_cuda(
    shapes_dir: Path, tmp_path: Path
) -> None:
    res = _strict_run("placed", shapes_dir, tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "val" in json.loads((tmp_path / "run" / "summary.json").read_text())
    for rank in range(2):
        calls = _calls(tmp_path, rank)
        # one vote of each kind per step, on every rank
        assert _count(calls, "all_reduce_sum", "vltrain.engine.loop._vote") == STEPS
        fwd_bwd = "vltrain.engine.loop.Trainer._forward_backward"
        assert _count(calls, "all_reduce_max", fwd_bwd) == STEPS
        assert _count(calls, "barrier", "vltrain.engine.loop.Trainer") >= 2  # init, save
        # image and text (and empty negatives) per step, forward and backward
        assert _count(calls, "all_gather_with_grad", "vltrain.objectives.contrastive") >= STEPS
        assert _count(calls, "all_gather_with_grad (backward)", "vltrain.stages") >= STEPS
        # the sharded evaluation at the last step
        evaluate = "vltrain.eval.image_text.ImageTextEvaluator.evaluate"
        assert _count(calls, "all_gather_no_grad", evaluate) >= 4
        assert _count(calls, "all_gather_object", evaluate) >= 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "error"),
    [
        (
            "unplaced",
            r"CollectiveDeviceError: all_reduce_sum: a \(\d+,\) torch.int64 tensor on cpu",
        ),
        (
            "legacy",
            r"CollectiveDeviceError: torch.distributed.all_reduce called from "
            r"tests.engine.legacy_distributed.all_reduce_sum: a \(\d+,\) torch.int64 tensor on cpu",
        ),
    ],
    ids=["unplaced", "legacy"],
)
def test_negative_control_unplaced_run_fails_at_the_first_vote(
    mode: str, error: str, shapes_dir: Path, tmp_path: Path
) -> None:
    res = _strict_run(mode, shapes_dir, tmp_path)
    assert res.returncode != 0
    assert re.search(error, res.stderr), res.stderr[-3000:]
    assert "communicates on cuda" in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # not a single step trained
