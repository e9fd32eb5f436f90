"""Every shipped preset builds its model: the stage, tokenizer and model keys fit together.

Loading a preset (tests/config/test_config.py) checks keys and types; this builds what the
preset describes on tiny synthetic data, so a preset naming a model, connector or stage option
that no longer builds fails here rather than at a user's first step. HF presets are pointed at
tiny random HF models saved locally (the fixtures of tests/models/test_hf_embedders.py); every
other key of the preset is kept.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.config.test_config import PRESETS
from tests.models.test_hf_embedders import clip_dir, qwen2vl_dir, siglip_dir  # noqa: F401
from vltrain.config import load_config

# lists of stages, not configs
PIPELINES = (
    "pipeline.yaml",
    "pipeline_hf_vlm.yaml",
    "pipeline_llava.yaml",
    "pipeline_smollm2_llava.yaml",
    "quickstart_pipeline.yaml",
)
MODEL_PRESETS = [p for p in PRESETS if p.name not in PIPELINES]
HF_FIXTURE = {"hf_clip.yaml": "clip_dir", "hf_siglip.yaml": "siglip_dir"}
# the tiny Qwen2-VL stands in for the preset's VLM; its width (32) caps the matryoshka dims
# the drafter presets train against a captioner run / a tiny random HF LM instead of the real ones
DRAFTER_TARGET = {"drafter.yaml": "caption_run", "drafter_smollm2.yaml": "tiny_lm_dir"}
HF_CAPTION = ("caption_hf_vlm.yaml", "caption_llava.yaml", "rl_hf_vlm.yaml", "rl_llava.yaml")
VLM = {
    "vlm_embed.yaml": {"model.matryoshka_dims": "[8]", "data.max_visual_tokens": 4},
    "qwen3vl_embed_pages.yaml": {"data.max_visual_tokens": 4},
}


def one_step_run(preset_name: str, out: Path, train: Path, **extra: object) -> Path:
    """A 1-step run of a shipped preset in `out` (what a later stage's `model.init_from` needs)."""
    from vltrain.cli import main

    over = {
        "run.out_dir": out,
        "data.train": train,
        "data.eval": "",
        "data.num_workers": 0,
        "train.max_steps": 1,
        "train.save_every": 1,
        "train.eval_every": 0,
        "optim.warmup_steps": 0,
        "log.progress": False,
        "log.tensorboard": False,
        **extra,
    }
    preset = next(p for p in PRESETS if p.name == preset_name)
    assert main(["train", str(preset), *[f"{k}={v}" for k, v in over.items()]]) == 0
    return out


@pytest.fixture(scope="module")
def caption_run(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-step caption_finetune run: the `model.init_from` the rl preset needs."""
    extra = {"data.tokenizer_vocab": 400, "model.init_from": ""}
    out = tmp_path_factory.mktemp("caption_init")
    return one_step_run("caption_finetune.yaml", out, shapes_dir / "train.jsonl", **extra)


@pytest.fixture(scope="module")
def llava_parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A tiny CLIP vision tower and causal LM: what caption_llava.yaml assembles."""
    from tests.models import vlm_fixtures

    root = tmp_path_factory.mktemp("llava_parts")
    (root / "clip").mkdir()
    (root / "lm").mkdir()
    return {
        "model.vision_path": vlm_fixtures.tiny_clip_vision(root / "clip"),
        "model.path": vlm_fixtures.tiny_causal_lm_dir(root / "lm"),
        "data.image_size": 32,
    }


@pytest.fixture(scope="module")
def llava_caption_run(
    llava_parts: dict, shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A 1-step caption_llava run: the `model.init_from` rl_llava.yaml needs."""
    out = tmp_path_factory.mktemp("llava_init")
    extra = {"data.batch_size": 2, **llava_parts}
    return one_step_run("caption_llava.yaml", out, shapes_dir / "train.jsonl", **extra)


@pytest.fixture(scope="module")
def pages_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A few synthetic pages: pages.yaml trains on query/page records with word boxes."""
    from vltrain.data.synth_pages import pages_command

    out = tmp_path_factory.mktemp("pages")
    pages_command(str(out), n_train=8, n_val=2, n_test=2, negatives=1, distractors=2)
    return out


@pytest.fixture(scope="module")
def tiny_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.stages.drafter_fixtures import tiny_lm

    return tiny_lm(tmp_path_factory.mktemp("tiny_lm"))


def build_preset_model(cfg, out_dir: Path) -> nn.Module:
    """The model a run of `cfg` trains, built the way the engine builds it (single process)."""
    from vltrain.engine.runtime import RunContext
    from vltrain.stages import check_config

    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, out_dir, ctx)
    stage.prepare()
    return stage.build_model()


def test_every_model_preset_is_covered() -> None:
    assert len(MODEL_PRESETS) == len(PRESETS) - len(PIPELINES) > 0


@pytest.mark.parametrize("preset", MODEL_PRESETS, ids=lambda p: p.name)
def test_every_shipped_preset_builds_its_model(
    preset: Path, shapes_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    over = {
        "run.out_dir": tmp_path / "run",
        "data.train": shapes_dir / "train.jsonl",
        "data.eval": shapes_dir / "val.jsonl",
        "data.tokenizer_vocab": 400,
        "data.num_workers": 0,
        "model.init_from": "",  # the chained presets start from a run that does not exist here
    }
    if preset.name == "rl.yaml":
        over["model.init_from"] = request.getfixturevalue("caption_run")
    if preset.name in DRAFTER_TARGET:
        over["model.target"] = request.getfixturevalue(DRAFTER_TARGET[preset.name])
    if preset.name in HF_FIXTURE:
        over["model.path"] = request.getfixturevalue(HF_FIXTURE[preset.name])
        over["data.max_text_len"] = 16  # the tiny towers' text positions (the presets': 77, 64)
    if preset.name in VLM:
        over |= {"model.path": request.getfixturevalue("qwen2vl_dir"), **VLM[preset.name]}
    if preset.name == "pages.yaml":  # its reading loss needs records that list word boxes
        pages = request.getfixturevalue("pages_dir")
        over |= {"data.train": pages / "train.jsonl", "data.eval": pages / "val"}
    if preset.name in ("caption_hf_vlm.yaml", "rl_hf_vlm.yaml"):  # a tiny Qwen2-VL stands in
        over |= {"model.path": request.getfixturevalue("qwen2vl_dir"), "data.max_visual_tokens": 4}
    if preset.name in ("caption_llava.yaml", "rl_llava.yaml"):
        over |= request.getfixturevalue("llava_parts")
    if preset.name == "rl_llava.yaml":
        over["model.init_from"] = request.getfixturevalue("llava_caption_run")
    if preset.name in HF_FIXTURE or preset.name in VLM or preset.name in HF_CAPTION:
        del over["data.tokenizer_vocab"]  # HF backbones bring their tokenizer: the key is refused
    cfg = load_config(preset, [f"{k}={v}" for k, v in over.items()])
    model = build_preset_model(cfg, tmp_path / "run")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable > 0, f"{preset.name}: nothing to train"
