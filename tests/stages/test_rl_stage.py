"""The rl stage end to end on a tiny caption checkpoint: metrics, frozen reference, resume, KL."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.stages.test_caption_stage import caption_overrides
from vltrain.config import load_config
from vltrain.engine.loop import Trainer, train
from vltrain.engine.optim import build_optimizer
from vltrain.stages.rl import RL_METRICS

PRESET = REPO / "configs" / "rl.yaml"


@pytest.fixture(scope="module")
def rl_data(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32 training records (several captions each) and a 4-image val split."""
    out = tmp_path_factory.mktemp("rldata")
    (out / "images").symlink_to(shapes_dir / "images")
    for split, n in (("train", 32), ("val", 4)):
        lines = (shapes_dir / f"{split}.jsonl").read_text().splitlines()[:n]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return out


@pytest.fixture(scope="module")
def caption_ckpt(rl_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny caption run (finetune preset, everything trains) the rl runs start from."""
    out = tmp_path_factory.mktemp("cap") / "run"
    over = caption_overrides(
        rl_data, out, "finetune", **{"train.max_steps": 4, "data.max_text_len": 24}
    )
    train(load_config(REPO / "configs" / "caption_finetune.yaml", over))
    return out


def _rl_cfg(data: Path, init: Path, out: Path, **extra: object):
    base = {
        "run.out_dir": out,
        "data.train": data / "train.jsonl",
        "data.eval": data / "val.jsonl",
        "data.batch_size": 4,
        "data.num_workers": 0,
        "data.tokenizer_vocab": 400,
        "data.max_text_len": 24,
        "model.init_from": init,
        "model.freeze": "[]",
        "caption.mode": "finetune",
        "caption.max_new_tokens": 6,
        "caption.num_beams": 2,
        "rl.k": 3,
        "rl.max_new_tokens": 8,
        "train.max_steps": 3,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.log_every": 1,
        "optim.warmup_steps": 0,
        "optim.lr": 1e-3,
        "log.progress": False,
        "log.tensorboard": False,
    }
    base.update(extra)
    return load_config(PRESET, [f"{k}={v}" for k, v in base.items()])


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _train_rows(run: Path) -> list[dict]:
    return [r for r in _rows(run) if "train_reward_mean" in r]


@pytest.fixture(scope="module")
def rl_run(rl_data: Path, caption_ckpt: Path, tmp_path_factory: pytest.TempPathFactory):
    """A 3-step rl run with a KL penalty; returns (cfg, summary, trainer)."""
    cfg = _rl_cfg(
        rl_data, caption_ckpt, tmp_path_factory.mktemp("rl") / "run", **{"rl.kl_coeff": 0.1}
    )
    trainer = Trainer(cfg)
    return cfg, trainer.run(), trainer


def test_rl_run_logs_metrics_and_evaluates(rl_run) -> None:
    cfg, summary, _ = rl_run
    run = Path(cfg.run.out_dir)
    rows = _train_rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for name in RL_METRICS:
            v = r[f"train_{name}"]
            assert v == v and abs(v) < 1e6, (name, v)  # present, finite
        assert r["train_reward_mean"] >= 0 and r["train_reward_std"] >= 0
        assert 1 <= r["train_length_mean"] <= 8 and 0 <= r["train_eos_frac"] <= 1
    assert summary["best_metric"] == "eval_CIDEr-D" and summary["steps"] == 3
    for k in ("eval_CIDEr-D", "eval_BLEU-4", "eval_beam_CIDEr-D", "eval_beam_BLEU-4"):
        assert k in summary["val"]


def test_kl_is_finite_nonnegative_and_moves_off_zero(rl_run) -> None:
    cfg, _, _ = rl_run
    kls = [r["train_kl"] for r in _train_rows(Path(cfg.run.out_dir))]
    assert all(k == k and k >= 0 for k in kls)
    # step 1 samples from the reference itself (KL 0); after two updates the policy moved
    assert kls[0] == pytest.approx(0.0, abs=1e-6)
    assert kls[-1] > 1e-6  # negative control: the KL is not identically zero


def test_reference_is_frozen_outside_the_model_and_optimizer(rl_run, caption_ckpt) -> None:
    cfg, _, trainer = rl_run
    stage = trainer.stage
    init = load_file(caption_ckpt / "checkpoints" / "best" / "model.safetensors")
    ref = stage.reference.state_dict()
    assert set(ref) == set(init)
    assert all(torch.equal(ref[k], init[k]) for k in init)  # never changed by training
    final = load_file(Path(cfg.run.out_dir) / "checkpoints" / "best" / "model.safetensors")
    assert set(final) == set(init)  # checkpoint holds the policy only, no "reference." keys
    assert not all(torch.equal(final[k], init[k]) for k in init)  # negative control: moved
    assert not any(p.requires_grad for p in stage.reference.parameters())
    model = stage.build_model()
    opt = build_optimizer(model, cfg.optim)
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt and not any(id(p) in in_opt for p in stage.reference.parameters())


def test_resume_keeps_the_ema_baseline(rl_data, caption_ckpt, tmp_path: Path) -> None:
    over = {"train.max_steps": 4, "train.save_every": 2}
    full = _rl_cfg(rl_data, caption_ckpt, tmp_path / "full", **over)
    train(full)
    part = _rl_cfg(rl_data, caption_ckpt, tmp_path / "part", **over)
    train(part)
    shutil.rmtree(tmp_path / "part" / "checkpoints" / "step_4")
    ts = torch.load(
        tmp_path / "part" / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=True
    )
    assert ts["stage"]["baseline"]["initialized"] is True
    resumed = Trainer(
        _rl_cfg(rl_data, caption_ckpt, tmp_path / "part", **over, **{"train.resume": True})
    )
    resumed.stage.prepare()
    assert resumed.stage.baseline.value == 0.0  # fresh stage: nothing loaded yet
    resumed.run()
    assert resumed.stage.baseline.value != 0.0
    want = {r["step"]: r for r in _train_rows(tmp_path / "full")}
    got = {r["step"]: r for r in _train_rows(tmp_path / "part")}
    for step in (3, 4):  # steps after the resume match the uninterrupted run exactly
        for k in ("train_baseline", "train_reward_mean", "loss"):
            assert got[step][k] == pytest.approx(want[step][k], abs=1e-6), (step, k)
