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
    gpu_only = [n for n in mod.CHECKS if n.startswith("stage_")]
    gpu_only += ["nccl_fsdp", "fsdp_cli", "grad_cache_qwen3vl2b", "clip_mfu", "drafter_smollm2"]
    for name in gpu_only:
        assert "skipped" in by_name[name] and "no CUDA" in by_name[name], by_name[name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real checks")
def test_gpu_check_stage_rows_train_on_the_cpu(tmp_path: Path) -> None:
    """`--device cpu` runs the stage checks' real commands (fp32): a preset or override that
    the CLI refuses (a warmup longer than the 3 steps, a batch larger than the data) fails
    here, not on the rented GPU. The finetune and drafter rows start from the caption run."""
    only = "stage_caption,stage_caption_finetune,stage_drafter_captioner"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--work", str(tmp_path), "--only", only]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| stage_")]
    assert len(rows) == 3 and all("| ok | 3 fp32 steps in" in r for r in rows), rows
    for name in only.split(","):  # each row's run folder is a finished 3-step run
        assert '"steps": 3' in (tmp_path / name / "summary.json").read_text()


def test_gpu_check_rejects_an_unknown_check() -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "clip_mfux"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "unknown check" in res.stderr
