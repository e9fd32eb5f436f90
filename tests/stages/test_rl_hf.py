"""The rl stage on HF VLMs (model kinds hf_vlm and llava; vltrain/stages/rl_hf.py): RL from the
CLI on a tiny Qwen2-VL (from model.path, LoRA) and a tiny LLaVA (from a caption run), the LoRA
reference is the base model without a copy, teacher-forced logits are the decoder loop's, exact
resume, and two processes equal one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, torchrun_vltrain
from tests.stages.test_caption_hf import PRESET as CAPTION_PRESET
from tests.stages.test_caption_hf import data, models, overrides  # noqa: F401  (fixtures)
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.engine import loop
from vltrain.runs import train

pytestmark = pytest.mark.usefixtures("one_thread")
PRESET = {
    "hf_vlm": REPO / "configs" / "rl_hf_vlm.yaml",
    "llava": REPO / "configs" / "rl_llava.yaml",
}
RL_OPTS = {
    "rl.k": 3,
    "rl.max_new_tokens": 5,
    "caption.num_beams": 2,
    "caption.max_new_tokens": 4,
    "train.max_steps": 2,
    "train.save_every": 2,
    "train.eval_every": 2,
    "optim.lr": 1e-2,
}


@pytest.fixture(scope="module")
def llava_caption_run(models: dict, data: Path, tmp_path_factory) -> Path:  # noqa: F811
    """A 2-step llava caption finetune: the model.init_from of the llava rl runs."""
    out = tmp_path_factory.mktemp("llava_cap") / "run"
    opts = {"model.freeze": "[]", "caption.mode": "finetune", "data.eval": ""}
    train(load_config(CAPTION_PRESET["llava"], overrides("llava", models, data, out, **opts)))
    return out


def rl_overrides(
    kind: str, models: dict, data: Path, out: Path, init: Path | None = None, **extra: object
) -> list[str]:
    opts: dict[str, object] = {**RL_OPTS}
    if kind == "hf_vlm":  # straight from model.path, LoRA on (the preset's)
        opts |= {"model.lora_r": 4, "model.lora_alpha": 64}
    else:
        opts |= {"model.init_from": init, "caption.mode": "finetune"}
    opts |= extra
    args = overrides(kind, models, data, out, **opts)
    if kind == "hf_vlm":
        args = [a for a in args if not a.startswith("model.lora_r=0")]
    return args


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["hf_vlm", "llava"])
def test_rl_trains_from_the_cli_and_logs_the_reward(
    kind: str,
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    init = request.getfixturevalue("llava_caption_run") if kind == "llava" else None
    out = tmp_path / "rl"
    args = rl_overrides(kind, models, data, out, init)
    assert main(["train", str(PRESET[kind]), *args]) == 0
    steps = [r for r in _rows(out) if "train_reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= r["train_reward_mean"] and r["train_kl"] >= 0.0 and r["train_entropy"] > 0.0
        assert 0.0 <= r["train_rep4_rate"] <= 1.0 and r["train_caption_words"] >= 0.0
        assert 1.0 <= r["train_length_mean"] <= 5.0
        if kind == "hf_vlm":  # rloo: the advantages of a group sum to zero
            assert abs(r["train_adv_mean"]) < 1e-5
        else:  # ema
            assert "train_baseline" in r
    summary = json.loads((out / "summary.json").read_text())
    assert {"eval_CIDEr-D", "eval_BLEU-4"} <= set(summary["val"])
    assert steps[-1]["train_kl"] > 0.0  # the policy moved off its reference
