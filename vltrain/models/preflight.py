"""What a config asks of its model, checked at load before anything is built or written:
an HF backbone's family, text positions, embedding width and LoRA targets, read from its
config.json (modules on the meta device); the built-in dual encoder's size against the memory
it would train in (parameters counted on the meta device)."""

from __future__ import annotations

import os

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.models.backbones import HF_KINDS, dual_encoder_params


def check_backbone(cfg: Config) -> None:
    """An HF backbone fits the config, read from its config.json before any weights load:
    its family matches model.kind (hf_siglip on a CLIP folder), its text positions hold
    data.max_text_len, its embedding is as wide as model.matryoshka_dims."""
    m = cfg.model
    if m.kind not in HF_KINDS or not m.path:
        return
    from transformers import AutoConfig

    from vltrain.models.hf_embedders import EMBEDDERS

    try:
        hf = AutoConfig.from_pretrained(m.path, local_files_only=m.local_files_only)
        text = hf.get_text_config()
    except (OSError, ValueError, AttributeError):
        return  # loading the model reports a bad model.path
    families = EMBEDDERS[m.kind].model_types
    if families and hf.model_type not in families:
        fits = [k for k in HF_KINDS if hf.model_type in EMBEDDERS[k].model_types]
        raise ConfigError(
            f"model.path={m.path} holds a {hf.model_type!r} model but model.kind={m.kind} "
            f"loads {' or '.join(families)}; set model.kind="
            + (fits[0] if fits else "the kind of that family")
            + " (or point model.path at a "
            + f"{families[0]} model)"
        )
    positions = getattr(text, "max_position_embeddings", None)
    if m.kind != "vlm" and positions and cfg.data.max_text_len > positions:
        raise ConfigError(
            f"data.max_text_len={cfg.data.max_text_len} is longer than the text positions of "
            f"{m.path} (max_position_embeddings={positions}); set data.max_text_len<={positions}"
        )
    if m.kind == "hf_siglip":
        _check_siglip_length(cfg, positions)
    if m.lora_r:
        _check_lora_targets(cfg, hf)
    width = int(getattr(text, "hidden_size", 0) or 0)
    if m.kind == "vlm" and m.matryoshka_dims and width and m.matryoshka_dims[-1] > width:
        raise ConfigError(
            f"'model.matryoshka_dims' {m.matryoshka_dims} go beyond the embedding width {width} "
            f"of {m.path}; keep every prefix <= {width}"
        )


def _check_siglip_length(cfg: Config, positions: int | None) -> None:
    """SigLIP's text embedding is its last position's, of a text padded to the tokenizer's
    length (HF's processors pad with padding="max_length" to model_max_length, 64 for the
    released models): trained at another data.max_text_len, the embedding a user computes with
    transformers or sentence-transformers is not the one trained and evaluated (up to 0.6
    apart on a tiny model)."""
    from transformers import AutoTokenizer

    m = cfg.model
    try:
        tok = AutoTokenizer.from_pretrained(m.path, local_files_only=m.local_files_only)
    except (OSError, ValueError):
        return  # loading the model reports it
    length = tok.model_max_length if tok.model_max_length < 10**6 else positions
    if length and cfg.data.max_text_len != length:
        raise ConfigError(
            f"data.max_text_len={cfg.data.max_text_len} but {m.path} embeds a text as its last "
            f"position, padded to {length} tokens (its tokenizer's model_max_length, as HF's "
            f"processors pad): set data.max_text_len={length}, or the embeddings trained here "
            "differ from the ones transformers computes"
        )


def _check_lora_targets(cfg: Config, hf: object) -> None:
    """model.lora_targets must name some module of the backbone (peft's rule: a module whose
    dotted name is a target or ends in '.' + a target), read on the meta device."""
    import torch
    from transformers import AutoModel

    m = cfg.model
    try:
        with torch.device("meta"):
            names = [n for n, _ in AutoModel.from_config(hf).named_modules()]
    except Exception:  # an architecture AutoModel cannot build: LoRA itself reports it
        return
    if not any(n == t or n.endswith("." + t) for t in m.lora_targets for n in names):
        leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n.endswith("proj")})
        raise ConfigError(
            f"model.lora_targets={list(m.lora_targets)} match no module of {m.path}; name "
            f"some of its layers instead, e.g. {', '.join(leaves[:10])}"
        )


def check_memory(cfg: Config) -> None:
    """Sizes that cannot fit are refused before anything is allocated: the weights, gradients
    and Adam moments (16 bytes a parameter, counted on the meta device) plus one batch of
    images must fit in this machine's memory (the GPU's when training on one)."""
    try:
        n = dual_encoder_params(cfg)
    except ConfigError:
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError):
        return  # an option the meta device cannot build with: building the model reports it
    d = cfg.data
    need = 16 * n + 4 * d.batch_size * 3 * d.image_size**2
    have, where = _memory(cfg.run.device)
    if have and need > have:
        m = cfg.model
        raise ConfigError(
            f"the dual encoder would hold {n / 1e6:,.0f}M parameters and a batch of "
            f"{d.batch_size} images of {d.image_size}px: ~{need / 2**30:,.0f} GiB with its "
            f"gradients and optimizer state, more than the {have / 2**30:,.0f} GiB of {where}; "
            f"lower the sizes (model.embed_dim={m.embed_dim}, model.vision_width="
            f"{m.vision_width}, model.text_width={m.text_width}, data.image_size={d.image_size}, "
            f"data.max_text_len={d.max_text_len}, data.tokenizer_vocab={d.tokenizer_vocab})"
        )


def _memory(device: str) -> tuple[int, str]:
    """(bytes, name) of the memory a run on `device` trains in (0 when unknown)."""
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "GPU memory"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "memory on this machine"
    except (ValueError, OSError, AttributeError):
        return 0, ""
