"""run.precision=fp16 on CPU: autocast in fp16 with a dynamic loss scaler that is checkpointed,
restored on resume bit for bit, and whose overflow skips are counted apart from non-finite
steps (and judged by the doctor as such)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_overrides
from tests.stages.test_caption_stage import PRESETS, caption_overrides
from tests.stages.test_caption_stage import cap_data as cap_data  # the fixture, shared
from vltrain.config import ConfigError, load_config
from vltrain.core import checkpoint
from vltrain.engine import loop, optim
from vltrain.runs import train

pytestmark = pytest.mark.usefixtures("one_thread")


class Interrupt(Exception):
    pass


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(run) if "loss" in r}


def _cfg(shapes_dir: Path, out: Path, **extra: object):
    opts = {"run.precision": "fp16", "train.max_steps": 8, "train.save_every": 4, **extra}
    return load_config(None, tiny_overrides(shapes_dir, out, **opts))


def test_fp16_trains_and_checkpoints_the_scaler(shapes_dir: Path, tmp_path: Path) -> None:
    summary = train(_cfg(shapes_dir, tmp_path / "run"))
    losses = _losses(tmp_path / "run")
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    assert losses[8] < losses[1]  # it learns
    assert summary["scaler_skips"] == 0 and summary["skipped_steps"] == 0
    state = checkpoint.load_trainer_state(tmp_path / "run" / "checkpoints" / "step_8")
    assert state["scaler"]["scale"] == optim.INIT_SCALE  # no overflow, < growth_interval steps
    assert state["scaler"]["_growth_tracker"] == 8
    last = [r for r in _rows(tmp_path / "run") if "loss" in r][-1]
    assert last["loss_scale"] == optim.INIT_SCALE and last["scaler_skips"] == 0


def test_fp32_run_has_no_scaler(shapes_dir: Path, tmp_path: Path) -> None:
    """Negative control: the default precision writes no scaler state and no scaler metrics."""
    summary = train(_cfg(shapes_dir, tmp_path / "run", **{"run.precision": "fp32"}))
    state = checkpoint.load_trainer_state(tmp_path / "run" / "checkpoints" / "step_8")
    assert "scaler" not in state and "scaler_skips" not in summary
    assert not any("loss_scale" in r for r in _rows(tmp_path / "run"))
    # and fp16 really computes in fp16: the first loss (same weights, same batch) differs a bit
    train(_cfg(shapes_dir, tmp_path / "fp16", **{"train.max_steps": 2}))
    fp32, fp16 = _losses(tmp_path / "run")[1], _losses(tmp_path / "fp16")[1]
    assert fp32 != fp16 and abs(fp32 - fp16) < 0.05


def test_fp16_resume_is_bit_identical_with_scaler_state(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2^20 overflows on the first steps: the scale the resumed run needs is not the initial one
    monkeypatch.setattr(optim, "INIT_SCALE", 2.0**20)
    extra = {"model.dropout": 0.1}
    full = tmp_path / "full"
    train(_cfg(shapes_dir, full, **extra))
    part = tmp_path / "part"
    real = loop.Trainer._maybe_eval_and_save

    def stop_after_6(self, model, logger):
        real(self, model, logger)
        if self.state.step == 6:
            raise Interrupt

    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", stop_after_6)
    with pytest.raises(Interrupt):
        train(_cfg(shapes_dir, part, **extra))
    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", real)
    saved = checkpoint.load_trainer_state(part / "checkpoints" / "step_4")["scaler"]
    assert saved["scale"] < 2.0**20  # the overflows halved it: restoring it matters
    summary = train(_cfg(shapes_dir, part, **extra, **{"train.resume": True}))
    a, b = _losses(full), _losses(part)
    assert [a[s] for s in range(1, 9)] == [b[s] for s in range(1, 9)]
    scales = [[r["loss_scale"] for r in _rows(run) if "loss_scale" in r] for run in (full, part)]
    assert scales[0][-3:] == scales[1][-3:]  # the resumed steps 6-8 ran at the same scales
    assert summary["scaler_skips"] > 0
    # a few skips while the scale settles are no finding (negative control of the one above)
    found = [json.loads(x) for x in (full / "doctor.jsonl").read_text().splitlines()]
    assert not {"scaler_skips", "nonfinite"} & {f["check"] for f in found}
    wa = load_file(full / "checkpoints" / "step_8" / "model.safetensors")
    wb = load_file(part / "checkpoints" / "step_8" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_without_the_scaler_state_differs(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: a resume that starts from a fresh scaler diverges from the full run."""
    monkeypatch.setattr(optim, "INIT_SCALE", 2.0**20)
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg(shapes_dir, full))
    train(_cfg(shapes_dir, part))
    for p in sorted((part / "checkpoints").glob("step_*")):
        if p.name != "step_4":
            import shutil

            shutil.rmtree(p)
    (part / "summary.json").unlink()
    monkeypatch.setattr(torch.amp.GradScaler, "load_state_dict", lambda self, state: None)
    train(_cfg(shapes_dir, part, **{"train.resume": True}))
    a, b = _losses(full), _losses(part)
    assert a[4] == b[4]
    assert [a[s] for s in range(5, 9)] != [b[s] for s in range(5, 9)]


def test_overflow_is_skipped_counted_and_judged(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A huge initial scale overflows: the scaler skips (weights untouched), the skips are
    counted apart from non-finite steps, the doctor reports the run of skips, not a NaN."""
    monkeypatch.setattr(optim, "INIT_SCALE", 2.0**60)
    run = tmp_path / "run"
    summary = train(_cfg(shapes_dir, run, **{"train.max_steps": 20, "train.save_every": 0}))
    assert summary["skipped_steps"] == 0  # max_consecutive_skips (5) did not abort either
    assert summary["scaler_skips"] >= 17
    rows = [r for r in _rows(run) if "loss" in r]
    assert rows[-1]["scaler_skips"] == summary["scaler_skips"]
    found = [json.loads(x) for x in (run / "doctor.jsonl").read_text().splitlines()]
    checks = {f["check"] for f in found}
    assert checks == {"scaler_skips"}  # not nonfinite, nor anything the skipped steps imply
    lr_free = load_file(run / "checkpoints" / "step_20" / "model.safetensors")
    assert all(torch.isfinite(v).all() for v in lr_free.values())


def test_doctor_still_reports_a_real_nan_under_fp16(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control for the scaler-skip exemption: a non-finite loss is a NaN finding."""
    real = loop.Trainer._forward_backward

    def nan_loss(self, model, micro):
        loss, metrics, grad_norm, finite, overflow = real(self, model, micro)
        if self.state.step == 3:
            nan = torch.tensor(float("nan"), dtype=torch.float64)
            return nan, metrics, grad_norm, False, False
        return loss, metrics, grad_norm, finite, overflow

    monkeypatch.setattr(loop.Trainer, "_forward_backward", nan_loss)
    summary = train(_cfg(shapes_dir, tmp_path / "run"))
    assert summary["skipped_steps"] == 1 and summary["scaler_skips"] == 0
    found = [json.loads(x) for x in (tmp_path / "run" / "doctor.jsonl").read_text().splitlines()]
    assert "nonfinite" in {f["check"] for f in found}


def test_fp16_trains_the_captioner_on_cpu(cap_data: Path, tmp_path: Path) -> None:
    """The other built-in kind fp16 accepts on CPU (FP16_CPU_KINDS) runs its ops in fp16."""
    over = caption_overrides(cap_data, tmp_path / "cap", **{"run.precision": "fp16"})
    summary = train(load_config(PRESETS["pretrain"], [*over, "train.max_steps=4"]))
    losses = _losses(tmp_path / "cap")
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert summary["skipped_steps"] == 0 and summary["scaler_skips"] < 4


def test_fp16_refused_on_cpu_for_hf_kinds(shapes_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="run.precision=fp16 on CPU"):
        load_config(
            None,
            [f"run.out_dir={tmp_path}", "run.precision=fp16", "run.device=cpu",
             "model.kind=hf_clip"],
        )  # fmt: skip
    load_config(None, [f"run.out_dir={tmp_path}", "run.precision=fp16", "run.device=cpu"])
