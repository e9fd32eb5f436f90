"""Non-finite loss: the step is skipped alike on every rank, counted, and too many abort."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_overrides
from vltrain.config import load_config
from vltrain.models.contrastive import ContrastiveModel
from vltrain.runs import TrainingAborted, train


def _poison(monkeypatch: pytest.MonkeyPatch, bad_calls: set[int] | None) -> None:
    """Make the training forward's loss NaN on the given calls (so its gradients are NaN too)."""
    real = ContrastiveModel.forward
    calls = {"n": 0}

    def forward(self, batch):
        calls["n"] += 1
        value, metrics = real(self, batch)
        if bad_calls is None or calls["n"] in bad_calls:
            value = value * float("nan")
        return value, metrics

    monkeypatch.setattr(ContrastiveModel, "forward", forward)


def test_nan_step_is_skipped_counted_and_leaves_weights_untouched(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison(monkeypatch, {3})
    cfg = load_config(
        None,
        tiny_overrides(
            shapes_dir, tmp_path / "run", **{"train.max_steps": 3, "train.save_every": 1}
        ),
    )
    summary = train(cfg)
    assert summary["skipped_steps"] == 1
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [0, 0, 1]
    ckpt = tmp_path / "run" / "checkpoints"
    w2, w3 = (load_file(ckpt / f"step_{s}" / "model.safetensors") for s in (2, 3))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)  # the NaN step changed nothing
    w1 = load_file(ckpt / "step_1" / "model.safetensors")
    assert not all(torch.equal(w1[k], w2[k]) for k in w1)  # control: normal steps do change


def test_consecutive_non_finite_steps_abort(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _poison(monkeypatch, None)
    cfg = load_config(
        None,
        tiny_overrides(
            shapes_dir,
            tmp_path / "run",
            **{"train.max_steps": 10, "train.max_consecutive_skips": 3},
        ),
    )
    with pytest.raises(TrainingAborted, match="3 consecutive steps"):
        train(cfg)
