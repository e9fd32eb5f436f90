"""User mistakes with the hf_vlm and llava kinds of the caption stage: each is one
`vltrain: error:` line from the real CLI, exit code 2, before anything is written."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.models import vlm_fixtures
from vltrain.cli import main
from vltrain.config.core import ConfigError
from vltrain.models import hf_vlm

PRESET = {k: str(REPO / "configs" / f"caption_{k}.yaml") for k in ("hf_vlm", "llava")}


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mistake_models")
    out = {}
    for name, build in {
        "qwen2vl": vlm_fixtures.tiny_qwen2vl,
        "clip": vlm_fixtures.tiny_clip_vision,
        "lm": vlm_fixtures.tiny_causal_lm_dir,
        "lm_no_chat": lambda p: vlm_fixtures.tiny_causal_lm_dir(p, chat_template=False),
        "llava_bad_processor": lambda p: vlm_fixtures.tiny_hf_llava(p, processor_patch=4),
    }.items():
        (root / name).mkdir()
        out[name] = build(root / name)
    return out


def _run(kind: str, shapes_dir: Path, out: Path, parts: dict, **extra: object) -> list[str]:
    over: dict[str, object] = {
        "run.out_dir": out,
        "data.train": shapes_dir / "train.jsonl",
        "data.eval": "",
        "data.num_workers": 0,
        "train.max_steps": 1,
        "optim.warmup_steps": 0,
    }
    if kind == "hf_vlm":
        over |= {"model.path": parts["qwen2vl"], "data.max_visual_tokens": 4, "model.lora_r": 0}
    else:
        over |= {"model.path": parts["lm"], "model.vision_path": parts["clip"]}
        over["data.image_size"] = 32
    over.update(extra)
    return ["train", PRESET[kind], *[f"{k}={v}" for k, v in over.items()]]


CASES = {
    "tower_size": ("llava", {"data.image_size": 64}, "set data.image_size=32"),
    "not_a_tower": ("llava", {"model.vision_path": "LM"}, "CLIP or SigLIP"),
    "sft_without_chat_template": (
        "llava",
        {"caption.mode": "sft", "model.path": "LM_NO_CHAT"},
        "has none; add chat_template.jinja",
    ),
    "freeze_unknown_part": ("llava", {"model.freeze": "[projector]"}, "'model.freeze' entry"),
    "lora_matches_nothing": (
        "hf_vlm",
        {"model.lora_r": 4, "model.lora_targets": "[attn_qkv]"},
        "match no Linear module of the language model",
    ),
    "processor_disagrees": (
        "hf_vlm",
        {"model.path": "BAD_PROCESSOR", "data.max_visual_tokens": 0},
        "expands one image to 16 image tokens, but the model has 4 features",
    ),
    "length_buckets": ("hf_vlm", {"data.length_buckets": 4}, "data.length_buckets=4"),
    "lora_on_the_lm_head": (
        "hf_vlm",
        {"model.lora_r": 4, "model.lora_targets": "[lm_head]"},
        "match no Linear module of the language model",
    ),
    "lr_scale_of_a_part_lora_freezes": (
        "hf_vlm",
        {"model.lora_r": 4, "optim.lr_scale.vision": 0.1},
        "the trainable parts are ['decoder'] (frozen parts, and a LoRA run's base weights",
    ),
    "hf_vlm_path_not_a_model": ("hf_vlm", {"model.path": "DATA"}, "holds no config.json"),
    "hf_vlm_path_a_text_lm": ("hf_vlm", {"model.path": "LM"}, "not an image-text-to-text VLM"),
    "llava_lm_a_vlm": ("llava", {"model.path": "VLM"}, "(a VLM: train it with model.kind=hf_vlm)"),
    "llava_lm_a_data_file": ("llava", {"model.path": "DATA_FILE"}, "holds no config.json"),
    "every_part_frozen": (
        "llava",
        {"model.freeze": "[vision, connector, decoder]"},
        "freezes every part",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_mistake_is_one_error_line_before_anything_is_written(
    case: str, parts: dict, shapes_dir: Path, tmp_path: Path, capsys
) -> None:
    kind, extra, message = CASES[case]
    names = {"LM": parts["lm"], "LM_NO_CHAT": parts["lm_no_chat"]}
    names["BAD_PROCESSOR"] = parts["llava_bad_processor"]
    names |= {"VLM": parts["qwen2vl"], "DATA": shapes_dir, "DATA_FILE": shapes_dir / "train.jsonl"}
    extra = {k: names.get(str(v), v) for k, v in extra.items()}
    out = tmp_path / "run"
    assert main(_run(kind, shapes_dir, out, parts, **extra)) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("vltrain: error:")]
    assert len(lines) == 1 and message in lines[0], err[-2000:]
    assert "Traceback" not in err
    assert not out.exists()


def test_the_valid_configs_of_the_cases_load(parts: dict, shapes_dir: Path, tmp_path: Path) -> None:
    """Control: without the mistake, both kinds pass every load-time check."""
    from vltrain.config import load_config
    from vltrain.stages import check_config

    for kind in ("hf_vlm", "llava"):
        args = _run(kind, shapes_dir, tmp_path / kind, parts)
        check_config(load_config(args[1], args[2:]))


def _fake_gguf(monkeypatch, types_in_file: list[str]) -> None:
    class QType:
        def __init__(self, name: str) -> None:
            self.name = name

    tensors = [types.SimpleNamespace(tensor_type=QType(t)) for t in types_in_file]
    gguf = types.ModuleType("gguf")
    gguf.GGUFReader = lambda path: types.SimpleNamespace(tensors=tensors)  # type: ignore[attr-defined]
    quants = types.ModuleType("gguf.quants")
    quants._type_traits = {QType("Q4_K"): None, QType("Q8_0"): None}  # type: ignore[attr-defined]
    gguf.quants = quants  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gguf", gguf)
    monkeypatch.setitem(sys.modules, "gguf.quants", quants)
    monkeypatch.setattr("vltrain.config.extras.installed", lambda name: True)


def test_gguf_quantisation_transformers_cannot_dequantise_is_refused(monkeypatch) -> None:
    _fake_gguf(monkeypatch, ["F32", "Q4_K", "IQ2_XXS"])
    with pytest.raises(ConfigError, match=r"quantised as \['IQ2_XXS'\]"):
        hf_vlm.check_gguf("lm.gguf")
    _fake_gguf(monkeypatch, ["F32", "Q4_K", "Q8_0", "F16"])  # control: all dequantisable
    hf_vlm.check_gguf("lm.gguf")


def test_gguf_without_the_gguf_package_names_it(monkeypatch) -> None:
    monkeypatch.setattr("vltrain.config.extras.installed", lambda name: False)
    with pytest.raises(ConfigError, match="pip install gguf"):
        hf_vlm.check_gguf("lm.gguf")


def test_freeze_naming_a_part_the_model_lacks(
    parts: dict, shapes_dir: Path, tmp_path: Path
) -> None:
    """A VLM whose parameters hold no connector (projector, merger) cannot freeze one."""
    from torch import nn

    from vltrain.config import load_config
    from vltrain.stages import caption_hf_checks

    class NoConnector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision_tower = nn.Linear(2, 2)
            self.language_model = nn.Linear(2, 2)

    args = _run("llava", shapes_dir, tmp_path / "r", parts, **{"model.freeze": "[connector]"})
    cfg = load_config(args[1], args[2:])
    with pytest.raises(ConfigError, match=r"names \['connector'\], which model.kind=llava"):
        caption_hf_checks._check_parts_and_lora(cfg, NoConnector())
    cfg.model.freeze = ["vision"]  # control: a part it has
    caption_hf_checks._check_parts_and_lora(cfg, NoConnector())


def test_gguf_check_on_real_files(tmp_path: Path) -> None:
    """With the real gguf package: a Q8_0 tensor passes, a Q8_1 one (no dequantiser) is refused."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    qtype = gguf.GGMLQuantizationType
    for name, kind in (("ok", qtype.Q8_0), ("bad", qtype.Q8_1)):
        w = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), "qwen2")
        w.add_tensor("a.weight", np.ones((4, 32), np.float32))
        w.add_tensor(
            "b.weight", np.zeros((4, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), raw_dtype=kind
        )
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    hf_vlm.check_gguf(str(tmp_path / "ok.gguf"))
    with pytest.raises(ConfigError, match=r"\['Q8_1'\]"):
        hf_vlm.check_gguf(str(tmp_path / "bad.gguf"))


def test_the_lora_targets_offered_are_targets(parts: dict) -> None:
    """The error for unmatched model.lora_targets lists the decoder's Linear names; each must
    be one LoRA takes (it offered 'lm_head' and then refused it)."""
    model = hf_vlm.load_hf_vlm(parts["qwen2vl"], True)
    names = hf_vlm.decoder_linear_names(model)
    assert names and "lm_head" not in names
    assert all(hf_vlm.lora_module_names(model, [n]) for n in names)
