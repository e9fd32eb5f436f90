"""The rl stage end to end on a tiny caption checkpoint: metrics, frozen reference, resume, KL,
two ranks under torchrun (tests/stages/rl_ddp_worker.py records each rank), bf16 autocast."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, hardlink_tree
from tests.stages.rl_ddp_worker import digest
from tests.stages.test_caption_stage import caption_overrides
from vltrain.config import load_config
from vltrain.config.core import ConfigError
from vltrain.engine.optim import build_optimizer
from vltrain.objectives.caption_shaping import caption_stats
from vltrain.runs import Trainer, train
from vltrain.stages import check_config, get_stage
from vltrain.stages.rl import RL_METRICS

PRESET = REPO / "configs" / "rl.yaml"
WORKER = Path(__file__).with_name("rl_ddp_worker.py")


@pytest.fixture(scope="module")
def rl_data(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32 training records (several captions each) and a 4-image val split."""
    out = tmp_path_factory.mktemp("rldata")
    hardlink_tree(shapes_dir / "images", out / "images")
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


def _rl_overrides(data: Path, init: Path, out: Path, **extra: object) -> list[str]:
    """Overrides for a few-second rl run (3 steps, 4 images x 3 samples) from `init`."""
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
    return [f"{k}={v}" for k, v in base.items()]


def _rl_cfg(data: Path, init: Path, out: Path, **extra: object):
    return load_config(PRESET, _rl_overrides(data, init, out, **extra))


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
    trainer = Trainer(cfg, stage=get_stage(cfg.stage))
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
        assert 0 <= r["train_rep4_rate"] <= 1 and 0 <= r["train_caption_words"] <= 8
        assert "train_length_penalty" not in r  # logged only when the penalty is on
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
    cfg = _rl_cfg(rl_data, caption_ckpt, tmp_path / "part", **over, **{"train.resume": True})
    resumed = Trainer(cfg, stage=get_stage(cfg.stage))
    resumed.stage.prepare()
    assert resumed.stage.baseline.value == 0.0  # fresh stage: nothing loaded yet
    resumed.run()
    assert resumed.stage.baseline.value != 0.0
    want = {r["step"]: r for r in _train_rows(tmp_path / "full")}
    got = {r["step"]: r for r in _train_rows(tmp_path / "part")}
    for step in (3, 4):  # steps after the resume match the uninterrupted run exactly
        for k in ("train_baseline", "train_reward_mean", "loss"):
            assert got[step][k] == pytest.approx(want[step][k], abs=1e-6), (step, k)


def test_grpo_length_penalty_and_caption_stats(rl_data: Path, caption_ckpt: Path, tmp_path) -> None:
    """The baseline sees reward - penalty, the logged reward is the metric's, and rep4_rate /
    caption_words are the decoded samples' (single process: the logged means are exact)."""
    over = {"rl.baseline": "grpo", "rl.length_penalty": 0.05, "rl.length_target": 3}
    cfg = _rl_cfg(rl_data, caption_ckpt, tmp_path / "run", **over, **{"train.max_steps": 2})
    trainer = Trainer(cfg, stage=get_stage(cfg.stage))
    stage, seen = trainer.stage, []
    sample, rewards = stage._sample, stage._rewards

    def sample_(*args):
        s = sample(*args)
        seen.append({"seq": s["seq"], "len": s["len"]})
        return s

    def rewards_(texts, refs, k):
        r = rewards(texts, refs, k)
        seen[-1].update(texts=texts, rewards=r)
        return r

    stage._sample, stage._rewards = sample_, rewards_
    trainer.run()
    rows = _train_rows(tmp_path / "run")
    assert len(rows) == len(seen) == 2
    for row, s in zip(rows, seen, strict=True):
        eos = s["seq"].gather(1, (s["len"] - 1)[:, None])[:, 0] == stage.tokenizer.eos_id
        tokens = (s["len"] - eos.long()).float()
        penalty = 0.05 * (tokens - 3).abs()
        assert row["train_length_penalty"] == pytest.approx(float(penalty.mean()), abs=1e-6)
        assert row["train_reward_mean"] == pytest.approx(float(s["rewards"].mean()), abs=1e-6)
        stats = caption_stats(s["texts"])
        assert row["train_rep4_rate"] == pytest.approx(float(stats["rep4_rate"]), abs=1e-12)
        assert row["train_caption_words"] == pytest.approx(float(stats["caption_words"]))
        # grpo on the shaped reward: advantages are 0-mean per image (logged mean over all)
        assert abs(row["train_adv_mean"]) < 1e-5
    assert any(float(s["len"].float().std()) > 0 for s in seen)  # lengths vary: penalty varies


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"rl.scale_rewards": "none"}, "rl.scale_rewards"),
        ({"rl.length_target": 5}, "rl.length_target"),
        ({"rl.baseline": "grpo", "rl.k": 1}, "rl.k"),
        ({"rl.baseline": "rloo", "rl.k": 1}, "rl.k"),
    ],
)
def test_rl_config_mistakes(rl_data: Path, tmp_path: Path, extra: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_config(_rl_cfg(rl_data, tmp_path / "ckpt", tmp_path / "run", **extra))


def _init_weights(caption_ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(caption_ckpt / "checkpoints" / "best" / "model.safetensors")


@pytest.mark.slow
def test_torchrun_two_ranks_own_shards_one_baseline_same_weights(
    rl_data: Path, caption_ckpt: Path, tmp_path: Path
) -> None:
    out = tmp_path / "two"
    over = _rl_overrides(rl_data, caption_ckpt, out, **{"rl.kl_coeff": 0.1, "train.save_every": 2})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(WORKER), str(PRESET), *over]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r0, r1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["world_size"], r1["rank"]) == (2, 1)
    s0, s1 = r0["steps"], r1["steps"]
    assert len(s0) == len(s1) == 3

    # each rank rolls out its own shard: 4 records each, none repeated in the epoch (32 records)
    indices = [i for s in s0 + s1 for i in s["index"]]
    assert all(len(s["index"]) == 4 and len(s["rewards"]) == 4 * 3 for s in s0 + s1)  # B, B*K
    assert len(set(indices)) == len(indices) == 24
    # ... with its own noise: the same two records, sampled on both ranks, give different captions
    assert r0["probe"] != r1["probe"]

    # one EMA baseline: bitwise equal on both ranks, the EMA (decay 0.9) of the global mean reward
    rows = _train_rows(out)
    b = None
    for a, c, row in zip(s0, s1, rows, strict=True):
        assert a["baseline"] == c["baseline"] == row["train_baseline"]
        global_mean = (mean(a["rewards"]) + mean(c["rewards"])) / 2
        assert row["train_reward_mean"] == pytest.approx(global_mean, abs=1e-6)
        b = global_mean if b is None else 0.9 * b + 0.1 * global_mean
        assert a["baseline"] == pytest.approx(b, abs=1e-6)
    # negative control: the ranks' own mean rewards differ, so local updates would disagree
    gaps = [abs(mean(a["rewards"]) - mean(c["rewards"])) for a, c in zip(s0, s1, strict=True)]
    assert max(gaps) > 1e-4

    # weights: both ranks start at init_from and stay bitwise identical; training moved them
    init = _init_weights(caption_ckpt)
    assert s0[0]["weights_before"] == s1[0]["weights_before"] == digest(init)
    assert [s["weights_before"] for s in s0] == [s["weights_before"] for s in s1]
    assert r0["final_weights"] == r1["final_weights"] != digest(init)
    final = load_file(out / "checkpoints" / "step_3" / "model.safetensors")
    assert digest(final) == r0["final_weights"] and set(final) == set(init)  # no reference keys
    # the reference on each rank is still the init_from weights, bit for bit, in fp32
    assert r0["reference"] == r1["reference"] == digest(init)
    assert r0["reference_dtypes"] == r1["reference_dtypes"] == ["torch.float32"]

    # the run finished: summary, sharded eval, checkpoints with the baseline and rollout count
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == r0["summary_steps"] == 3 and "eval_CIDEr-D" in summary["val"]
    assert (out / "checkpoints" / "step_2" / "model.safetensors").is_file()
    ts = torch.load(out / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=True)
    assert ts["world_size"] == 2 and ts["stage"]["rollouts"] == r0["rollouts"] == 3
    assert ts["stage"]["baseline"] == {"value": s0[-1]["baseline"], "initialized": True}


def test_bf16_autocast_steps_are_finite_and_close_to_fp32(
    rl_run, rl_data: Path, caption_ckpt: Path, tmp_path: Path
) -> None:
    cfg32, _, _ = rl_run  # the same run in fp32
    cfg = _rl_cfg(
        rl_data, caption_ckpt, tmp_path / "bf16", **{"rl.kl_coeff": 0.1, "run.precision": "bf16"}
    )
    trainer = Trainer(cfg, stage=get_stage(cfg.stage))
    summary = trainer.run()
    rows = _train_rows(tmp_path / "bf16")
    assert [r["step"] for r in rows] == [1, 2, 3] and summary["skipped_steps"] == 0
    for r in rows:
        for k in ("loss", "grad_norm", *(f"train_{n}" for n in RL_METRICS)):
            assert math.isfinite(r[k]), (r["step"], k, r[k])
        assert r["train_kl"] >= 0 and r["train_entropy"] > 0
    assert all(math.isfinite(v) for v in summary["val"].values())
    assert rows[0]["train_kl"] == 0.0 and rows[-1]["train_kl"] > 1e-6  # policy left the ref

    init = _init_weights(caption_ckpt)
    ref = trainer.stage.reference.state_dict()
    assert set(ref) == set(init) and all(torch.equal(ref[k], init[k]) for k in init)
    assert {v.dtype for v in ref.values()} == {torch.float32}
    final = load_file(tmp_path / "bf16" / "checkpoints" / "best" / "model.safetensors")
    assert not all(torch.equal(final[k], init[k]) for k in init)  # control: the policy moved

    # step 1 against fp32 (same seed, so the same samples and rewards): terms computed in fp32
    # from bf16 logits. The entropy is within 2e-4 relative (measured ~3e-6; one bf16 rounding
    # of a value near 5.9 is ~2e-3), the loss within 2% of the advantages' spread (measured
    # ~0.02%), and the loss is not bitwise the fp32 one (control: autocast was really on).
    r16, r32 = rows[0], _train_rows(Path(cfg32.run.out_dir))[0]
    assert r16["train_reward_mean"] == pytest.approx(r32["train_reward_mean"], abs=1e-6)
    assert r16["train_entropy"] == pytest.approx(r32["train_entropy"], rel=2e-4)
    assert abs(r16["loss"] - r32["loss"]) <= 0.02 * r32["train_adv_std"]
    assert r16["loss"] != r32["loss"]


def test_a_resume_keeps_the_kl_reference_of_its_start(rl_data, caption_ckpt, tmp_path: Path):
    """The reference is the checkpoint the run started from, recorded in init_from.json: when
    the init run trains on (its newest checkpoint is another), a resume still builds the
    reference from the recorded one; if that checkpoint's weights changed, it is refused."""
    from safetensors.torch import load_file, save_file

    from vltrain.core.checkpoint import resolve_checkpoint

    init = tmp_path / "init"
    shutil.copytree(caption_ckpt, init)
    shutil.rmtree(init / "checkpoints" / "best")  # the start is the newest checkpoint
    start = resolve_checkpoint(init)
    over = {"train.max_steps": 2, "train.save_every": 2}
    train(_rl_cfg(rl_data, init, tmp_path / "rl", **over))
    pinned = json.loads((tmp_path / "rl" / "init_from.json").read_text())
    assert pinned["path"] == str(start.resolve())
    later = init / "checkpoints" / "best"  # the init run trains on: another best
    shutil.copytree(caption_ckpt / "checkpoints" / "best", later)
    weights = load_file(later / "model.safetensors")
    save_file({k: v + 0.01 for k, v in weights.items()}, later / "model.safetensors")
    assert resolve_checkpoint(init) == later
    over = {**over, "train.max_steps": 3, "train.resume": True}
    over["train.allow_changes"] = "[train.max_steps]"
    cfg = _rl_cfg(rl_data, init, tmp_path / "rl", **over)
    resumed = Trainer(cfg, stage=get_stage(cfg.stage))
    resumed.stage.prepare()
    assert resumed.stage.core.init_ckpt == start.resolve()
    resumed.stage.build_model()
    want = load_file(start / "model.safetensors")
    got = resumed.stage.reference.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items() if k in got)
    save_file(weights, start / "model.safetensors")  # the start rewritten (same tensors, new file)
    with pytest.raises(ConfigError, match="whose weights changed since"):
        Trainer(cfg, stage=get_stage(cfg.stage)).stage.prepare()


def test_rl_refuses_another_caption_mode_than_its_start(rl_data, caption_ckpt, tmp_path: Path):
    cfg = _rl_cfg(rl_data, caption_ckpt, tmp_path / "rl", **{"caption.mode": "sft"})
    with pytest.raises(ConfigError, match="trained with caption.mode=finetune"):
        Trainer(cfg, stage=get_stage(cfg.stage)).stage.prepare()
