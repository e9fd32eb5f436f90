"""Models from a config: the contrastive backbones (built-in dual encoder or a Hugging Face
embedder) and the captioner.

Each backbone comes with a batcher that turns samples into model inputs. Both batchers offer
the same three calls: `__call__(samples)` (training collate), `image_batch(images)` and
`text_batch(texts)` (evaluation, mining), so the stage never asks which backbone it has.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config, ObjectiveConfig
from vltrain.core.checkpoint import load_weights, resolve_checkpoint
from vltrain.data.collate import ImageTextCollate
from vltrain.data.tokenizer import SPECIAL_TOKENS, TextTokenizer
from vltrain.models.captioner import Captioner
from vltrain.models.dual_encoder import DualEncoder
from vltrain.models.presets import text_config, vision_config
from vltrain.models.text import TextTowerConfig
from vltrain.models.vit import VisionTowerConfig

HF_KINDS = ("hf_clip", "hf_siglip", "vlm")

# loss_init() kwargs of an HF embedder -> the ObjectiveConfig field they initialise
_LOSS_INIT_FIELDS = {
    "temperature": "temperature",
    "init_scale": "siglip_init_scale",
    "init_bias": "siglip_init_bias",
    "max_logit_scale": "max_logit_scale",
}


#: model.kind -> the encoder builder; the contrastive stage trains these kinds
ENCODER_KINDS = ("dual_encoder", *HF_KINDS)


def uses_tokenizer(cfg: Config) -> bool:
    """True when the stage trains its own BPE tokenizer (the built-in dual encoder)."""
    return cfg.model.kind == "dual_encoder"


def build_encoder(
    cfg: Config,
    tokenizer: TextTokenizer | None,
    weights: bool = True,
    reading_tokens: list[int] | None = None,
) -> nn.Module:
    """The encoder `model.kind` names, with `encode_image` / `encode_text`; an HF backbone
    with `weights=False` is its architecture on the meta device (for FLOP accounting). With
    `objective.reading`, the built-in tower reads `reading_tokens` (the run's reading
    vocabulary; None: every id of the tokenizer)."""
    m = cfg.model
    if m.kind == "dual_encoder":
        assert tokenizer is not None
        reads = None
        if cfg.objective.reading:  # the run's reading vocabulary, else every id its own class
            reads = list(range(tokenizer.vocab_size)) if reading_tokens is None else reading_tokens
        return DualEncoder(
            _sized(
                vision_config,
                m.vision,
                m.vision_layers,
                m.vision_width,
                image_size=cfg.data.image_size,
                dropout=m.dropout,
                **vision_options(m.vision_options),
            ),
            _sized(
                text_config,
                m.text,
                m.text_layers,
                m.text_width,
                vocab_size=tokenizer.vocab_size,
                context_length=cfg.data.max_text_len,
                dropout=m.dropout,
                **tower_options(m.text_options, TextTowerConfig, "model.text_options"),
            ),
            m.embed_dim,
            head=m.head,
            pair_code=m.pair_code,
            reading_tokens=reads,
            specials=len(SPECIAL_TOKENS),
        )
    from vltrain.models.hf_embedders import build_embedder

    opts: dict[str, Any] = {"local_files_only": m.local_files_only}
    if not weights:
        opts["weights"] = False
    if m.lora_r:
        opts["lora"] = {
            "r": m.lora_r,
            "alpha": m.lora_alpha,
            "dropout": m.lora_dropout,
            "target_modules": list(m.lora_targets),
        }
    if m.kind == "vlm":
        opts.update(
            pooling=m.pooling,
            instruction_query=m.instruction_query,
            instruction_doc=m.instruction_doc,
            matryoshka_dims=m.matryoshka_dims,
        )
    return build_embedder(m.kind, m.path, **opts)


def tower_options(options: dict[str, Any], fields_of: type, key: str) -> dict[str, Any]:
    """`model.vision_options` / `model.text_options` checked against the tower config's fields
    (did-you-mean); lists become tuples."""
    fields = {f.name for f in dataclasses.fields(fields_of)}
    fields -= {"image_size", "vocab_size", "context_length"}  # data.* and the tokenizer decide
    out = {}
    for name, value in options.items():
        if name not in fields:
            close = difflib.get_close_matches(name, sorted(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key}: unknown field {name!r}{hint}")
        out[name] = tuple(value) if isinstance(value, list) else value
    return out


def vision_options(options: dict[str, Any]) -> dict[str, Any]:
    """`model.vision_options` as `VisionTowerConfig` overrides."""
    return tower_options(options, VisionTowerConfig, "model.vision_options")


def _sized(make: Any, preset: str, n_layers: int, n_width: int, /, **dims: Any) -> Any:
    """A tower config from its preset, with explicit depth/width overrides (0 keeps the preset;
    a tower without blocks: ``layers: 0`` in its ``*_options``).

    The image size always comes from `data.image_size`, so any preset trains on any data.
    """
    if n_layers:
        dims["layers"] = n_layers
    if n_width:
        dims["width"] = n_width
    return make(preset, **dims)


def dual_encoder_params(cfg: Config) -> int:
    """Parameters of the built-in dual encoder `cfg` describes, counted on the meta device (no
    memory allocated), with data.tokenizer_vocab as the vocabulary size."""
    from types import SimpleNamespace

    stub = SimpleNamespace(vocab_size=cfg.data.tokenizer_vocab)
    with torch.device("meta"):
        encoder = build_encoder(cfg, stub)  # type: ignore[arg-type]
    return sum(p.numel() for p in encoder.parameters())


def build_batcher(cfg: Config, tokenizer: TextTokenizer | None) -> Any:
    """The collate/batcher matching `build_encoder`."""
    if cfg.model.kind == "dual_encoder":
        return ImageTextCollate(tokenizer, cfg.data.max_text_len)
    from vltrain.data.hf_collate import HFCollate

    m = cfg.model
    return HFCollate(
        m.path,
        m.kind,
        cfg.data.max_text_len,
        cfg.data.max_visual_tokens or None,
        m.instruction_query,
        m.instruction_doc,
        m.local_files_only,
        m.instruction_role,
    )


def objective_for(encoder: nn.Module, objective: ObjectiveConfig) -> ObjectiveConfig:
    """Start the loss at a pretrained CLIP/SigLIP model's own temperature (and bias)."""
    init = getattr(encoder, "loss_init", None)
    if init is None:
        return objective
    fields = {_LOSS_INIT_FIELDS[k]: v for k, v in init(objective.loss).items()}
    return dataclasses.replace(objective, **fields)


# ----------------------------------------------------------------------------- captioner


def build_captioner(cfg: Config, tokenizer: TextTokenizer) -> Captioner:
    """The captioner that `cfg.model` describes, sized for `tokenizer` and `data.max_text_len`."""
    m = cfg.model
    side = vision_config(m.vision).image_size
    if side != cfg.data.image_size:
        raise ConfigError(
            f"'data.image_size' is {cfg.data.image_size} but the '{m.vision}' vision preset "
            f"takes {side}x{side} images; set data.image_size={side}"
        )
    try:
        return Captioner.from_config(
            m.vision,
            m.text,
            vocab_size=tokenizer.vocab_size,
            connector=m.connector,
            connector_options=m.connector_options,
            max_text_len=cfg.data.max_text_len,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            dropout=m.dropout,
            text_dims={k: v for k, v in (("layers", m.text_layers), ("width", m.text_width)) if v},
            vision_dims=captioner_vision_dims(cfg),
        )
    except ValueError as e:  # connector options and sizes are user config
        raise ConfigError(f"model.connector / model.connector_options: {e}") from None


def captioner_vision_dims(cfg: Config) -> dict[str, Any]:
    """The captioner's vision tower over its preset: model.vision_layers / _width (0: the
    preset's) and model.vision_options."""
    m = cfg.model
    dims = {k: v for k, v in (("layers", m.vision_layers), ("width", m.vision_width)) if v}
    return {**dims, **vision_options(m.vision_options)}


def check_captioner_vision(cfg: Config) -> None:
    """The caption stages' load-time check of the vision tower: it builds (a value it refuses
    is a ConfigError naming the key, before any tokenizer trains) and has features to caption
    from."""
    m = cfg.model
    if m.vision_options.get("pool") == "none":
        raise ConfigError(
            "model.vision_options.pool: none leaves the vision tower without features to "
            "caption from (it is the word-pair head's tower, stage contrastive); use cls, "
            "flatten or max"
        )
    vision_config(m.vision, dropout=m.dropout, **captioner_vision_dims(cfg))


def load_initial_weights(model: Captioner, ckpt: Path) -> None:
    """Load a checkpoint into `model`, explaining an architecture mismatch."""
    try:
        load_weights(model, ckpt)
    except RuntimeError as e:
        raise ConfigError(
            f"model.init_from={ckpt}: {str(e).splitlines()[0][:400]}; model.vision, "
            "model.text, model.connector(_options) and data.max_text_len must match the "
            "source run's config.yaml"
        ) from None


def load_vision_tower(model: Captioner, source: str) -> None:
    """Initialise `model.vision` from a contrastive run's image tower (`encoder.vision.*`)."""
    from safetensors.torch import load_file

    try:
        ckpt = resolve_checkpoint(source)
    except FileNotFoundError as e:
        raise ConfigError(f"model.vision_init_from: {e}") from None
    weights = load_file(str(ckpt / "model.safetensors"))
    prefix = "encoder.vision."
    tower = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if not tower:
        raise ConfigError(
            f"model.vision_init_from={ckpt} holds no {prefix}* weights: pass a "
            "checkpoint of the contrastive stage's built-in dual encoder"
        )
    try:
        model.vision.load_state_dict(tower, strict=True)
    except RuntimeError as e:
        raise ConfigError(
            f"model.vision_init_from={ckpt} does not fit model.vision "
            f"({str(e)[:200]}...): use the same model.vision preset"
        ) from None
