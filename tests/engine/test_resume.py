"""Exact resume: interrupt mid-epoch, resume, and reproduce the uninterrupted run bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import hardlink_tree, tiny_overrides
from vltrain.config import load_config
from vltrain.engine import loop
from vltrain.runs import train


class Interrupt(Exception):
    pass


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _cfg(shapes_dir: Path, out: Path, **extra: object):
    # 128 train samples / batch 16 = 8 batches per epoch: step 5 is mid-epoch and the run
    # crosses an epoch boundary after resuming. Dropout makes the RNG stream matter.
    opts = {
        "train.max_steps": 12,
        "train.save_every": 5,
        "model.dropout": 0.1,
        "data.num_workers": 1,
        "train.eval_every": 6,
        **extra,
    }
    return load_config(None, tiny_overrides(shapes_dir, out, **opts))


def test_resume_reproduces_uninterrupted_run_exactly(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = tmp_path / "full"
    train(_cfg(shapes_dir, full))

    part = tmp_path / "part"
    real = loop.Trainer._maybe_eval_and_save

    def stop_after_7(self, model, logger):
        real(self, model, logger)
        if self.state.step == 7:  # after the step-5 checkpoint; steps 6-7 are lost work
            raise Interrupt

    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", stop_after_7)
    with pytest.raises(Interrupt):
        train(_cfg(shapes_dir, part))
    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", real)
    assert max(_losses(part)) == 7
    summary = train(_cfg(shapes_dir, part, **{"train.resume": True}))
    assert summary["steps"] == 12

    a, b = _losses(full), _losses(part)
    assert sorted(a) == sorted(b) == list(range(1, 13))  # lost steps 6-7 were re-logged once
    assert [a[s] for s in a] == [b[s] for s in a]  # bit-for-bit equal loss sequence
    # the doctor's files tell the same story: each step's record once (the lost steps' rows
    # are replaced, not appended again), the same records, the same findings
    rows = {}
    for run in (full, part):
        lines = (run / "doctor_steps.jsonl").read_text().splitlines()
        rows[run] = [json.loads(x) for x in lines]
        assert [r["step"] for r in rows[run]] == list(range(12))
    keys = ("step", "loss", "grad_norm", "lr", "update_ratio", "weight_fp")
    assert [[r[k] for k in keys] for r in rows[full]] == [[r[k] for k in keys] for r in rows[part]]
    found = {
        run: sorted(
            (f["check"], f["step"], f["detected_at"])
            for f in map(json.loads, (run / "doctor.jsonl").read_text().splitlines())
        )
        for run in (full, part)
    }
    assert found[full] == found[part]
    wa = load_file(full / "checkpoints" / "step_12" / "model.safetensors")
    wb = load_file(part / "checkpoints" / "step_12" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_without_restoring_rng_would_differ(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the comparison above can fail if resume skips the RNG state."""
    full = tmp_path / "full"
    train(_cfg(shapes_dir, full, **{"train.max_steps": 8}))
    part = tmp_path / "part"
    train(_cfg(shapes_dir, part, **{"train.max_steps": 8}))
    for p in sorted((part / "checkpoints").glob("step_*"))[1:]:
        import shutil

        shutil.rmtree(p)  # keep only step_5
    monkeypatch.setattr(loop.checkpoint, "set_rng_state", lambda state: None)
    torch.manual_seed(123)
    train(_cfg(shapes_dir, part, **{"train.max_steps": 8, "train.resume": True}))
    a, b = _losses(full), _losses(part)
    assert a[5] == b[5]
    assert a[8] != b[8]


def _epoch_cfg(shapes_dir: Path, out: Path, **extra: object):
    # 128 samples / (batch 16 x accum 2) = 4 steps per epoch, 3 epochs = 12 steps; checkpoints
    # at steps 5 and 10 (save_every) and at each epoch's end (4, 8, 12)
    opts = {
        "train.epochs": 3,
        "train.save_every_epoch": True,
        "train.save_every": 5,
        "train.keep_last": 10,
        "optim.accum_steps": 2,
        "model.dropout": 0.1,
        "data.num_workers": 1,
        **extra,
    }
    overrides = [o for o in tiny_overrides(shapes_dir, out, **opts) if "max_steps" not in o]
    return load_config(None, overrides)


def test_epoch_scheduled_resume_mid_epoch_is_exact(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    full = tmp_path / "full"
    summary = train(_epoch_cfg(shapes_dir, full))
    out = capsys.readouterr().out
    assert "128 samples, global batch 16, accum 2 -> 4 steps per epoch, 3 epochs = 12 steps" in out
    assert summary["steps"] == 12
    saved = sorted(int(p.name[5:]) for p in (full / "checkpoints").glob("step_*"))
    assert saved == [4, 5, 8, 10, 12]  # epoch ends beside save_every
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    epochs = {r["step"]: r["epoch"] for r in rows if "loss" in r}
    assert epochs[4] == 1.0 and epochs[6] == 1.5 and epochs[12] == 3.0

    part = tmp_path / "part"
    real = loop.Trainer._maybe_eval_and_save

    def stop_after_7(self, model, logger):
        real(self, model, logger)
        if self.state.step == 7:  # mid-epoch 2, after the step-5 checkpoint
            raise Interrupt

    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", stop_after_7)
    with pytest.raises(Interrupt):
        train(_epoch_cfg(shapes_dir, part))
    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", real)
    assert not (part / "checkpoints" / "step_7").exists()  # resume starts from step 5
    # resume from the run's own config.yaml (which records the derived max_steps)
    saved_cfg = load_config(part / "config.yaml", ["train.resume=true"])
    assert saved_cfg.train.max_steps == 12 and saved_cfg.train.epochs == 3
    train(saved_cfg)
    a, b = _losses(full), _losses(part)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    assert [a[s] for s in a] == [b[s] for s in a]  # bit-for-bit
    wa = load_file(full / "checkpoints" / "step_12" / "model.safetensors")
    wb = load_file(part / "checkpoints" / "step_12" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_resume_over_a_changed_training_file_is_refused(shapes_dir: Path, tmp_path: Path):
    """The sampler resumes by record index: records appended to (or edited in) data.train
    since the start made a resume silently train another run. It is refused unless allowed;
    an unchanged file, or one only touched, resumes."""
    import os
    import shutil

    from vltrain.config.core import ConfigError

    data = tmp_path / "data"
    shutil.copytree(shapes_dir, data, ignore=shutil.ignore_patterns("images"))
    hardlink_tree(shapes_dir / "images", data / "images")
    over = {"data.train": data / "train.jsonl", "train.max_steps": 2, "train.save_every": 2}
    over |= {"train.eval_every": 0, "data.num_workers": 0}
    run = tmp_path / "run"
    train(_cfg(shapes_dir, run, **over))
    assert json.loads((run / "data_version.json").read_text())["size"] > 0
    more = {**over, "train.max_steps": 3, "train.resume": True}
    more["train.allow_changes"] = "[train.max_steps]"
    os.utime(data / "train.jsonl")  # touched, not changed
    lines = (data / "train.jsonl").read_text().splitlines()
    (data / "train.jsonl").write_text("\n".join(lines + lines[:5]) + "\n")  # 5 records more
    with pytest.raises(ConfigError, match="data.train .* changed since the run started"):
        train(_cfg(shapes_dir, run, **more))
    more["train.allow_changes"] = "[train.max_steps, data.train]"
    assert train(_cfg(shapes_dir, run, **more))["steps"] == 3
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")  # recorded anew when allowed
    more["train.max_steps"] = 4
    more["train.allow_changes"] = "[train.max_steps]"
    with pytest.raises(ConfigError, match="changed since the run started"):
        train(_cfg(shapes_dir, run, **more))
