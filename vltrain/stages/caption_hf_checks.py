"""The caption stage's config policy for the HF kinds (hf_vlm, llava): the keys they read and
the rules checked at load, before anything is written (`check_hf_caption_config`): keys these
kinds do not read, a missing model folder, ``model.freeze`` naming a part the model lacks, LoRA
targets matching no Linear of the language model, SFT (or hf_vlm, which always uses the chat
template) with a tokenizer without a chat template, a vision tower whose image size or patch
does not fit ``data.image_size`` (llava), a GGUF file transformers cannot dequantise, and a
processor whose image-token count disagrees with the model's features (hf_vlm).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from vltrain.config.core import ConfigError, reject_unused
from vltrain.config.schema import Config
from vltrain.core.checkpoint import resolve_checkpoint
from vltrain.data.vlm_caption_data import VLMCaptionCollate
from vltrain.models import hf_vlm

HF_CAPTION_KINDS = ("hf_vlm", "llava")
#: llava connector options; select_strategy defaults to the tower's: CLIP "default" (its class
#: token dropped), SigLIP "full" (no class token: "default" would drop a patch)
LLAVA_OPTIONS = {"feature_layer": -2, "select_strategy": None}
_DATA = ("train", "eval", "test", "batch_size", "max_train_samples", "eval_batch_size")
_DATA += ("num_workers", "max_text_len", "max_bad_fraction", "image_column", "text_column")


def used_keys(kind: str) -> tuple[str, ...]:
    """The keys the caption stage reads for an HF kind."""
    used = ["stage", "run.*", "optim.*", "train.*", "log.*", "tune.*", "doctor.*", "caption.*"]
    used += [f"data.{k}" for k in _DATA]
    used += ["model.kind", "model.path", "model.local_files_only", "model.lora_*"]
    used += ["model.freeze", "model.init_from"]
    if kind == "hf_vlm":
        used.append("data.max_visual_tokens")
    else:
        used += ["data.image_size", "model.vision_path", "model.connector_options"]
    return tuple(used)


WHY = {
    "data.length_buckets": "the built-in captioner's length-bucketed batches",
    "data.tokenizer_vocab": "HF models bring their own tokenizer",
    "data.image_size": "hf_vlm images go through the model's own processor",
    "model.vision*": "the built-in captioner's (the llava kind reads model.vision_path)",
    "model.connector*": "the built-in captioner's and the llava kind's",
}


def vision_dir(path: str) -> str:
    """model.vision_path as an HF folder: a CLIP/SigLIP folder, or a contrastive run (or
    checkpoint) of hf_clip / hf_siglip, whose checkpoint holds ``hf_model/``."""
    p = Path(path)
    if (p / "config.json").is_file():
        return str(p)
    try:
        hf = resolve_checkpoint(p) / "hf_model"
    except FileNotFoundError:
        hf = p / "missing"
    if not (hf / "config.json").is_file():
        raise ConfigError(
            f"model.vision_path={path!r} is neither an HF CLIP/SigLIP folder (config.json) nor a "
            "contrastive run of model.kind hf_clip / hf_siglip (checkpoints/*/hf_model)"
        )
    return str(hf)


def llava_options(cfg: Config) -> dict:
    """model.connector_options of the llava kind, defaults filled in and values checked."""
    opts = {**LLAVA_OPTIONS, **cfg.model.connector_options}
    if opts["select_strategy"] is None:
        tower = hf_vlm.vision_config(vision_dir(cfg.model.vision_path)).model_type
        opts["select_strategy"] = "full" if tower.startswith("siglip") else "default"
    if opts["select_strategy"] not in ("default", "full"):
        raise ConfigError(
            f"model.connector_options.select_strategy={opts['select_strategy']!r}: use default "
            "(patch tokens; CLIP's class token dropped) or full (every token)"
        )
    if not isinstance(opts["feature_layer"], int):
        raise ConfigError("model.connector_options.feature_layer must be an int (e.g. -2)")
    return opts


def meta_model(cfg: Config) -> nn.Module:
    """The model's architecture on the meta device (no weights read)."""
    m = cfg.model
    if m.kind == "hf_vlm":
        return hf_vlm.meta_hf_vlm(m.path, m.local_files_only)
    import torch
    from transformers import AutoConfig, LlavaForConditionalGeneration

    where, kw = hf_vlm.lm_tokenizer_source(m.path)
    text = AutoConfig.from_pretrained(where, **kw)
    opts = llava_options(cfg)
    config = hf_vlm.llava_config(
        vision_dir(m.vision_path), text, 0, opts["select_strategy"], opts["feature_layer"]
    )
    with torch.device("meta"):
        return LlavaForConditionalGeneration(config)


def _check_paths(cfg: Config) -> None:
    m = cfg.model
    if not m.path:
        raise ConfigError(f"model.kind={m.kind} needs 'model.path' (a local HF model folder)")
    what = "an HF causal-LM folder or .gguf file" if m.kind == "llava" else "an HF VLM folder"
    if not Path(m.path).exists():
        raise ConfigError(f"model.path={m.path!r} does not exist; point it at {what}")
    _check_model_type(m.path, m.kind, what)
    if m.kind == "llava":
        if not m.vision_path:
            raise ConfigError("model.kind=llava needs 'model.vision_path' (an HF CLIP/SigLIP)")
        unknown = set(m.connector_options) - set(LLAVA_OPTIONS)
        if unknown:
            raise ConfigError(
                f"model.connector_options {sorted(unknown)} are not llava options; valid: "
                f"{sorted(LLAVA_OPTIONS)}"
            )
        if Path(m.path).suffix == ".gguf":
            hf_vlm.check_gguf(m.path)


def _check_model_type(path: str, kind: str, what: str) -> None:
    """model.path holds the kind of model the kind builds on (its config.json's model_type),
    so a data folder, a VLM given as llava's LM or an LM given as hf_vlm is one line, not a
    traceback from inside transformers."""
    import json

    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    p = Path(path)
    if kind == "llava" and p.suffix == ".gguf":
        return
    config = p / "config.json"
    if not config.is_file():
        raise ConfigError(f"model.path={path!r} holds no config.json; point it at {what}")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        raise ConfigError(f"{config} is not a model's config ({e}); point it at {what}") from None
    vlm = model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    if kind == "hf_vlm" and not vlm:
        raise ConfigError(
            f"model.path={path!r} is a {model_type!r} model, not an image-text-to-text VLM; "
            "for a text-only LM use model.kind=llava with a vision tower (model.vision_path)"
        )
    if kind == "llava" and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        hint = " (a VLM: train it with model.kind=hf_vlm)" if vlm else ""
        raise ConfigError(
            f"model.path={path!r} is a {model_type!r} model, not a causal LM{hint}; "
            f"model.kind=llava builds on {what}"
        )


def _check_vision_geometry(cfg: Config) -> None:
    v = hf_vlm.vision_config(vision_dir(cfg.model.vision_path))
    size = cfg.data.image_size
    if v.image_size != size or size % v.patch_size:
        raise ConfigError(
            f"model.vision_path's tower takes {v.image_size}px images in {v.patch_size}px "
            f"patches, but data.image_size={size}; set data.image_size={v.image_size}"
        )


def _check_parts_and_lora(cfg: Config, model: nn.Module) -> None:
    m = cfg.model
    for part in m.freeze:
        if part not in hf_vlm.PARTS:
            raise ConfigError(f"'model.freeze' entry {part!r} is not one of {list(hf_vlm.PARTS)}")
    have = hf_vlm.model_parts(model)
    missing = [p for p in m.freeze if p not in have]
    if missing:
        raise ConfigError(
            f"'model.freeze' names {missing}, which model.kind={m.kind} ({m.path}) does not have; "
            f"its parts are {sorted(have)}"
        )
    if not m.lora_r and have <= set(m.freeze):
        raise ConfigError("'model.freeze' freezes every part of the model: nothing would train")
    if m.lora_r and not hf_vlm.lora_module_names(model, m.lora_targets):
        raise ConfigError(
            f"model.lora_targets {m.lora_targets} match no Linear module of the language model "
            f"of {m.path}; its Linear names are {hf_vlm.decoder_linear_names(model)}"
        )


def _check_chat_template(cfg: Config) -> None:
    m = cfg.model
    if m.kind == "llava" and cfg.caption.mode != "sft":
        return
    from transformers import AutoTokenizer

    where, kw = hf_vlm.lm_tokenizer_source(m.path)
    if not getattr(AutoTokenizer.from_pretrained(where, **kw), "chat_template", None):
        why = "caption.mode=sft" if m.kind == "llava" else "model.kind=hf_vlm (every mode)"
        raise ConfigError(
            f"{why} builds prompts with the chat template, but the tokenizer of model.path="
            f"{m.path} has none; add chat_template.jinja to it or use an instruct model"
        )


def _check_processor(cfg: Config, model: nn.Module) -> None:
    """hf_vlm: the processor expands an image to as many tokens as the model has features."""
    want = hf_vlm.expected_image_tokens(model.config)
    if want is None:
        return
    from PIL import Image

    collate = VLMCaptionCollate(cfg.model.path, model.config.model_type, "chat", 8)
    st = collate._load()
    got = collate.images([Image.new("RGB", (48, 40))])[1][0].count(st["image_token"])
    if got != want:
        raise ConfigError(
            f"the processor of model.path={cfg.model.path} expands one image to {got} image "
            f"tokens, but the model has {want} features per image: fix processor_config.json "
            "(patch_size, num_additional_image_tokens, vision_feature_select_strategy or "
            "image_seq_len) to match config.json"
        )


def check_hf_caption_config(
    cfg: Config, stage: str = "caption", extra: tuple[str, ...] = ()
) -> None:
    """Every load-time rule of the hf_vlm / llava kinds (see the module doc); `stage` and the
    `extra` keys it reads for the rl stage."""
    m = cfg.model
    why = WHY if "rl.*" in extra else {**WHY, "rl.*": "the rl stage's"}
    reject_unused(cfg, used_keys(m.kind) + extra, f"stage {stage} with model.kind={m.kind}", why)
    _check_paths(cfg)
    if m.kind == "llava":
        _check_vision_geometry(cfg)
    _check_chat_template(cfg)
    model = meta_model(cfg)
    _check_parts_and_lora(cfg, model)
    if m.kind == "hf_vlm":
        _check_processor(cfg, model)
