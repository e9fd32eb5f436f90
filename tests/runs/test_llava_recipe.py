"""bench/llava_smollm2_recipe.py at toy sizes: configs/pipeline_smollm2_llava.yaml chains an
hf_clip contrastive run into llava pretrain (projector only), finetune (everything, the tower
at 0.1x lr) and rl (the tower frozen), with a tiny random LM in place of SmolLM2 and a tiny
random CLIP."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import REPO
from tests.models import vlm_fixtures
from vltrain.config.core import ConfigError
from vltrain.runs.pipeline import load_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe():
    path = REPO / "bench" / "llava_smollm2_recipe.py"
    spec = importlib.util.spec_from_file_location("llava_smollm2_recipe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _final(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "step_2" / "model.safetensors")


def test_recipe_chains_clip_pretrain_finetune_rl(shapes_dir: Path, tmp_path: Path) -> None:
    recipe = _recipe()
    out = tmp_path / "recipe"
    recipe.make_clip_dir(out / "clip_init", shapes_dir / "train.jsonl", width=32, layers=1)
    (tmp_path / "lm").mkdir()
    lm = vlm_fixtures.tiny_causal_lm_dir(tmp_path / "lm")
    toy = ["train.max_steps=2", "train.eval_every=2", "train.save_every=2", "data.batch_size=4"]
    toy += ["data.num_workers=0", "optim.warmup_steps=0", "data.eval_batch_size=16"]
    toy += [f"--stage={s}:caption.max_new_tokens=4" for s in ("pretrain", "finetune", "rl")]
    toy += ["--stage=rl:rl.max_new_tokens=4", "--stage=rl:data.batch_size=2"]
    args = ["--out", str(out), "--data", str(shapes_dir), "--lm", lm, *toy]
    result = recipe.main(args)

    assert list(result["stages"]) == ["clip", "pretrain", "finetune", "rl"]
    for name in ("pretrain", "finetune", "rl"):
        assert result["stages"][name]["steps"] == 2
        assert isinstance(result["stages"][name]["test_CIDEr-D"], float)
        assert isinstance(result["stages"][name]["val_CIDEr-D"], float)
    assert "| finetune | 2 |" in (out / "recipe.md").read_text()
    # pretrain: the clip run's tower and the LM arrive unchanged (frozen), the projector learns
    from transformers import CLIPVisionModel, Qwen2ForCausalLM

    tower = CLIPVisionModel.from_pretrained(out / "clip" / "checkpoints" / "step_2" / "hf_model")
    want = tower.state_dict()
    pre, fine = _final(out / "pretrain"), _final(out / "finetune")
    vis = "model.model.vision_tower."
    assert all(torch.equal(pre[vis + k], v) for k, v in want.items())
    ref = Qwen2ForCausalLM.from_pretrained(lm).state_dict()
    layer = "layers.1.mlp.down_proj.weight"
    assert torch.equal(pre["model.model.language_model." + layer], ref["model." + layer])
    # finetune starts from pretrain and trains the tower too (at a tenth of the lr)
    assert any(not torch.equal(fine[vis + k], v) for k, v in want.items())
    assert not torch.equal(fine["model.model.language_model." + layer], ref["model." + layer])
    # rl starts from finetune: the tower stays as finetune left it, the LM moves
    rl = _final(out / "rl")
    assert all(torch.equal(rl[k], v) for k, v in fine.items() if k.startswith(vis))
    lm_key = "model.model.language_model." + layer
    assert not torch.equal(rl[lm_key], fine[lm_key])
    # a rerun skips every finished stage
    again = recipe.main(args)
    assert again["stages"]["rl"]["test_CIDEr-D"] == result["stages"]["rl"]["test_CIDEr-D"]


def test_init_mapping_names_earlier_stages_and_defers_their_checks(
    shapes_dir: Path, tmp_path: Path
) -> None:
    """init {key: stage}: each key gets <root>/<stage>; a llava stage whose tower run is not
    there yet loads (keys checked) and is checked when it starts; a later or unknown stage is
    refused."""
    clip = _recipe().make_clip_dir(
        tmp_path / "clip", shapes_dir / "train.jsonl", width=32, layers=1
    )
    (tmp_path / "lm").mkdir()
    lm = f"model.path={vlm_fixtures.tiny_causal_lm_dir(tmp_path / 'lm')}"
    own = {"clip": [f"model.path={clip}"], "pretrain": [lm], "finetune": [lm], "rl": [lm]}
    path = REPO / "configs" / "pipeline_smollm2_llava.yaml"
    stages = load_pipeline(path, stage_overrides=own, root=tmp_path / "r")
    assert [s.name for s in stages] == ["clip", "pretrain", "finetune", "rl"]
    assert [s.checked for s in stages] == [True, False, False, False]
    fine = stages[2].cfg
    assert fine.model.vision_path == str(tmp_path / "r" / "clip")
    assert fine.model.init_from == str(tmp_path / "r" / "pretrain")
    assert (fine.caption.mode, fine.model.freeze, fine.optim.lr_scale) == (
        "finetune",
        [],
        {"vision": 0.1},
    )
    assert stages[1].cfg.model.freeze == ["vision", "decoder"]
    rl = stages[3].cfg
    assert (rl.stage, rl.model.init_from, rl.model.freeze) == (
        "rl",
        str(tmp_path / "r" / "finetune"),
        ["vision"],
    )
    assert rl.model.vision_path == str(tmp_path / "r" / "clip")
    shutil.copy(REPO / "configs" / "caption_pretrain.yaml", tmp_path / "p.yaml")
    for init, match in (({"model.init_from": "b"}, "'b' is not an earlier stage"), ([1], "init")):
        spec = {"root": "r", "stages": [{"name": "a", "config": "p.yaml"}]}
        spec["stages"] += [{"name": "b", "config": "p.yaml", "init": init}]
        (tmp_path / "pl.yaml").write_text(yaml.safe_dump(spec))
        with pytest.raises(ConfigError, match=match):
            load_pipeline(tmp_path / "pl.yaml")
