"""DDP equivalence: `torchrun --nproc_per_node=2` equals one process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import tiny_overrides


def _run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _train(out: Path, shapes_dir: Path, nproc: int, batch: int, *extra: str) -> dict:
    args = tiny_overrides(
        shapes_dir,
        out,
        **{"data.batch_size": batch, "train.max_steps": 5, "train.save_every": 5, "optim.lr": 2e-3},
    )
    args += list(extra)
    if nproc == 1:
        cmd = [sys.executable, "-m", "vltrain", "train", "-", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "vltrain",
            "train",
            "-",
            *args,
        ]
    _run(_with_config(cmd), out.parent)
    return {**load_file(out / "checkpoints" / "step_5" / "model.safetensors"), "_dir": out}


def _with_config(cmd: list[str]) -> list[str]:
    cfg = Path(__file__).resolve().parents[2] / "configs" / "clip.yaml"
    return [str(cfg) if c == "-" else c for c in cmd]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a if k != "_dir")


@pytest.fixture(scope="module")
def single(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _train(tmp_path_factory.mktemp("ddp") / "one", shapes_dir, 1, 16)


@pytest.mark.slow
def test_two_processes_equal_one_process_with_same_global_batch(
    single: dict, shapes_dir: Path, tmp_path: Path
) -> None:
    two = _train(tmp_path / "two", shapes_dir, 2, 8)
    # sharded evaluation (gathered once) reports what one process computes
    one_eval = json.loads((single["_dir"] / "summary.json").read_text())["val"]
    two_eval = json.loads((tmp_path / "two" / "summary.json").read_text())["val"]
    assert one_eval.keys() == two_eval.keys() and "eval_i2t_R@1" in one_eval
    for k in one_eval:
        assert abs(one_eval[k] - two_eval[k]) < 1e-4, k
    initial_gap = _max_diff(single, _train(tmp_path / "zero", shapes_dir, 1, 16, "optim.lr=1e-12"))
    assert initial_gap > 1e-3  # training moved the weights, so the comparison means something
    assert _max_diff(single, two) < 1e-5


@pytest.mark.slow
def test_negative_control_without_gather_differs(
    single: dict, shapes_dir: Path, tmp_path: Path
) -> None:
    two = _train(tmp_path / "nogather", shapes_dir, 2, 8, "objective.gather=false")
    assert _max_diff(single, two) > 1e-4
