"""The LLaVA kind's vision tower from an HF CLIP folder: the full model's text weights are left
behind without transformers' table of them, and a tower weight the folder lacks or holds in
another shape is an error naming it (it would start random)."""

from __future__ import annotations

import pytest
import torch

from vltrain.config.core import ConfigError
from vltrain.models.hf_vlm import load_vision_tower

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _full_clip(path) -> transformers.CLIPModel:
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=1)
    text |= dict(num_attention_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2)
    vision |= dict(image_size=32, patch_size=8)
    torch.manual_seed(0)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = transformers.CLIPModel(cfg)
    model.save_pretrained(path)
    return model


def test_a_full_clip_gives_its_vision_tower_quietly(tmp_path, capfd) -> None:
    full = _full_clip(tmp_path)
    before = transformers.utils.logging.get_verbosity()
    capfd.readouterr()
    tower = load_vision_tower(transformers.CLIPVisionModel, str(tmp_path))
    printed = "".join(capfd.readouterr())
    assert "UNEXPECTED" not in printed and "text_model" not in printed, printed
    assert transformers.utils.logging.get_verbosity() == before
    sd = full.vision_model.state_dict()  # the tower's own names, whatever its prefix
    got = {k.removeprefix("vision_model."): v for k, v in tower.state_dict().items()}
    want = {k.removeprefix("vision_model."): v for k, v in sd.items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("fault", ["missing", "shape"])
def test_a_tower_weight_missing_or_misshaped_is_an_error(tmp_path, fault) -> None:
    _full_clip(tmp_path)
    weights = tmp_path / "model.safetensors"
    sd = safetensors_torch.load_file(weights)
    if fault == "missing":
        del sd["vision_model.post_layernorm.weight"]
    else:
        sd["vision_model.post_layernorm.weight"] = torch.ones(5)
    safetensors_torch.save_file(sd, weights, metadata={"format": "pt"})
    before = transformers.utils.logging.get_verbosity()
    with pytest.raises(ConfigError, match=r"post_layernorm\.weight.*1 in all.*start random"):
        load_vision_tower(transformers.CLIPVisionModel, str(tmp_path))
    assert transformers.utils.logging.get_verbosity() == before
