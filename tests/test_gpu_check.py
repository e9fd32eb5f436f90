"""bench/gpu_check.py on a CPU-only machine: every check runs or says it was skipped, and the
one table comes out (this catches import and argument errors before a GPU machine does)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real checks")
def test_gpu_check_runs_on_cpu_and_skips_gpu_parts_clearly() -> None:
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")][2:]
    by_name = {r.split("|")[1].strip(): r for r in rows}
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("gpu_check", SCRIPT)
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert list(by_name) == list(mod.CHECKS)  # one row per check, in order
    assert "| ok |" in by_name["env"]
    for name in ("stage_contrastive", "nccl_fsdp", "fsdp_cli", "clip_mfu"):
        assert "skipped" in by_name[name] and "no CUDA" in by_name[name], by_name[name]


def test_gpu_check_rejects_an_unknown_check() -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "clip_mfux"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "unknown check" in res.stderr
