"""bench/gpu_check.py on a CPU-only machine: every check runs or says it was skipped, and the
one table comes out (this catches import and argument errors before a GPU machine does)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.bench_scripts import load_bench

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real checks")
def test_gpu_check_runs_on_cpu_and_skips_gpu_parts_clearly() -> None:
    res = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if line.startswith("| ")][2:]
    by_name = {r.split("|")[1].strip(): r for r in rows}
    mod = load_bench("gpu_check")
    assert list(by_name) == list(mod.CHECKS)  # one row per check, in order
    assert "| ok |" in by_name["env"]
    gpu_only = [n for n in mod.CHECKS if n.startswith("stage_")]
    gpu_only += [
        "fp16_clip",
        "nccl_fsdp",
        "fsdp_cli",
        "grad_cache_qwen3vl2b",
        "embed_pages_qwen3vl2b",
        "clip_mfu",
        "drafter_smollm2",
        "sft_rl_hf_vlm_qwen2vl2b",
        "sft_rl_llava_qwen2vl2b",
    ]
    for name in gpu_only:
        assert "skipped" in by_name[name] and "no CUDA" in by_name[name], by_name[name]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real checks")
def test_every_gpu_row_runs_its_code_on_the_cpu(tmp_path: Path) -> None:
    """`--device cpu` runs each row's real code: the stage presets through the CLI (fp32, the
    finetune/SFT/RL/drafter rows from the caption runs), FSDP2 and the FSDP CLI on 2 gloo
    ranks, GradCache through a tiny Qwen3-VL, the CLIP step, and the drafter row on a tiny
    random Llama (regenerate, train, speculative vs HF greedy decoding: identical). A preset the
    CLI refuses or an API that moved fails here, not on a rented GPU."""
    from tests.stages.drafter_fixtures import tiny_lm

    # 6 layers: the drafter's target layers (1, 2, 3) avoid the last one, which neither engine
    # format can express, so the row's exports run
    lm = tiny_lm(tmp_path / "lm", layers=6)
    own_test = ("env", "embed_pages_qwen3vl2b")  # the latter runs in the test below
    names = [n for n in _module().CHECKS if n not in own_test]
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--work", str(tmp_path / "w")]
    cmd += ["--only", ",".join(names), "--drafter-target", str(lm), "--drafter-prompts", "16"]
    cmd += ["--drafter-steps", "4", "--drafter-max-new", "12", "--drafter-repeats", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    rows = {r.split("|")[1].strip(): r for r in res.stdout.splitlines() if r.startswith("| ")}
    for name in names:
        assert f"| {name} | ok |" in rows[name], rows[name]
    stages = [n for n in names if n.startswith("stage_")]
    assert len(stages) == 7 and all("3 fp32 steps in" in rows[n] for n in stages)
    for name in stages:  # each row's run folder is a finished 3-step run
        assert '"steps": 3' in (tmp_path / "w" / name / "summary.json").read_text()
    assert "8 fp16 steps" in rows["fp16_clip"] and "scaler skips" in rows["fp16_clip"]
    assert "gloo over 2 CPU ranks ok" in rows["nccl_fsdp"]
    assert "sharded checkpoint written: True" in rows["fsdp_cli"]
    assert "chain tau" in rows["drafter_smollm2"] and "DIFFERS" not in rows["drafter_smollm2"]
    for fmt in ("speculators", "dflash"):  # both exports decode like the run
        assert f"{fmt} export reloaded: chain tau" in rows["drafter_smollm2"]
    for kind in ("hf_vlm", "llava"):
        row = rows[f"sft_rl_{kind}_qwen2vl2b"]
        assert "SFT step (AdamW)" in row and "K=4 samples" in row and "without a grad" not in row


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real checks")
def test_embed_pages_row_runs_gradcache_and_the_uncached_step_on_the_cpu(tmp_path: Path) -> None:
    """The reference-workload row on a tiny random Qwen3-VL through VLMEmbedder, HFCollate and
    GradCache with 5 page negatives per query: every LoRA tensor gets a gradient, the uncached
    step fits the whole batch on the CPU and its loss equals GradCache's (fp32, <= 1e-5)."""
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--work", str(tmp_path)]
    res = subprocess.run(
        [*cmd, "--only", "embed_pages_qwen3vl2b"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    row = next(r for r in res.stdout.splitlines() if r.startswith("| embed_pages_qwen3vl2b"))
    assert "| ok |" in row, row
    assert "4 queries + 4 pages + 20 page negatives" in row and "cap 1280" in row
    assert "largest batch that fits 4" in row and "GradCache's differs by" in row
    assert "without a grad" not in row


def test_embed_pages_row_fails_when_gradcache_changes_the_loss() -> None:
    """The row's verdict is not vacuous: a loss that GradCache moved, or a LoRA tensor left
    without a gradient, is FAILED."""
    mod = load_bench("gpu_embed_pages")
    good = dict(no_grad=0, uncached_batch=4, batch=4, chunk=2, page=(35, 41), fp32=True)
    good |= dict(params_b=5e-5, trainable_m=0.01, visual_tokens=20, gib_cached=None)
    good |= dict(gib_uncached=None, s_cached=0.5, s_uncached=0.1)
    good |= dict(loss_cached=3.28170, loss_uncached=3.28170)
    assert mod.row(good)[0] == "ok"
    assert mod.row({**good, "loss_uncached": 3.2818})[0] == "FAILED"
    assert mod.row({**good, "no_grad": 1})[0] == "FAILED"
    assert mod.row({**good, "uncached_batch": 0, "s_uncached": float("nan")})[0] == "FAILED"


def _module():
    return load_bench("gpu_check")


def test_gpu_check_rejects_an_unknown_check() -> None:
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "clip_mfux"], capture_output=True, text=True
    )
    assert res.returncode == 2 and "unknown check" in res.stderr


def test_vlm_steps_row_runs_both_kinds_and_its_verdict_can_fail() -> None:
    """The sft_rl rows' code on a tiny model of each kind (bf16, CPU): a finite SFT loss, sampled
    tokens, every trainable tensor with an RL gradient; a row without them is FAILED."""
    mod = load_bench("gpu_vlm_steps")
    r = mod.run("llava", "cpu")
    assert r["visual_tokens"] == 16 and r["rl_rows"] == 4 and r["rl_tokens"] > 0
    assert mod.row(r)[0] == "ok", mod.row(r)
    assert mod.row({**r, "rl_no_grad": 2})[0] == "FAILED"
    assert mod.row({**r, "sft_loss": float("nan")})[0] == "FAILED"
