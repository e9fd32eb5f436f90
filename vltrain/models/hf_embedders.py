"""Hugging Face backbones as contrastive embedders: CLIP, SigLIP, and VLMs (Qwen2/2.5/3-VL, LLaVA).

Every embedder has the interface the contrastive stage already drives (see `DualEncoder`):
``encode_image(images) -> (B, E)`` and ``encode_text(input_ids, attention_mask) -> (B, E)``,
unit-norm fp32. ``images`` is a pixel tensor for CLIP/SigLIP and a dict of image-side inputs
(prompt ids, pixel patches, grid sizes) for VLMs; `vltrain.data.hf_collate.HFCollate` builds
both from the same local model directory.

Models load from a local directory, or by hub id from the HF cache, by default
(``local_files_only=True``): nothing is downloaded at run time unless the user passes a hub id
and sets ``local_files_only=False``.
Optional LoRA (peft) freezes the backbone and trains only the adapters. ``save_pretrained``
writes a directory that this class and plain transformers both load (LoRA merged by default).
"""

from __future__ import annotations

import copy
import fnmatch
import math
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.config.core import ConfigError
from vltrain.config.hub_ids import is_model_id
from vltrain.core import hub

# Files a model directory holds besides weights and model config: the processor side.
PROCESSOR_FILES = (
    "tokenizer*",
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "video_preprocessor_config.json",
)
LORA_KEYS = {"r", "alpha", "dropout", "target_modules"}


def check_model_path(path: str | Path, local_files_only: bool) -> str:
    """The path as a string; a clear error when a local directory was required and is missing,
    or a hub id (``org/name``) is not in the HF cache and may not be downloaded."""
    p = Path(path)
    if is_model_id(str(path)):
        hub.check_model_id(str(path), "model.path", local_files_only)
        return str(path)  # transformers reads it from the cache (or downloads it)
    if local_files_only and not p.is_dir():
        raise FileNotFoundError(
            f"model path {str(path)!r} is not a local directory. Point it at a directory written "
            "by save_pretrained (config.json + weights + tokenizer/processor files), or, to "
            "download a hub id on purpose, set local_files_only=False."
        )
    return str(path)


def apply_lora(
    model: nn.Module, lora: Mapping[str, Any], default_targets: Sequence[str]
) -> nn.Module:
    """Wrap `model` with peft LoRA adapters; the backbone is frozen, only adapters train.

    ``lora`` keys: ``r`` (rank, default 8), ``alpha`` (default 2*r), ``dropout`` (default 0.0),
    ``target_modules`` (module-name suffixes; default depends on the embedder).
    """
    unknown = set(lora) - LORA_KEYS
    if unknown:
        raise ValueError(f"unknown lora option(s) {sorted(unknown)}; valid: {sorted(LORA_KEYS)}")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ModuleNotFoundError("LoRA needs peft", name="peft") from None  # CLI: the extra
    r = int(lora.get("r", 8))
    if r <= 0:
        raise ValueError(f"lora.r must be a positive int, got {lora.get('r')!r}")
    cfg = LoraConfig(
        r=r,
        lora_alpha=float(lora.get("alpha", 2 * r)),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules=list(lora.get("target_modules") or default_targets),
    )
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        linear = sorted({n.rsplit(".", 1)[-1] for n, x in model.named_modules() if _is_linear(x)})
        raise ConfigError(
            f"model.lora_targets={sorted(cfg.target_modules)} match no module LoRA can wrap in "
            f"{type(model).__name__} ({str(e).split('. ')[0]}); name some of its linear "
            f"layers instead: {', '.join(linear[:12])}"
        ) from None


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, (nn.Linear, nn.Conv1d)) or type(module).__name__ == "Conv1D"


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def copy_processor_files(src: str | Path, out_dir: Path) -> list[str]:
    """Copy tokenizer / image-processor / chat-template files from a local model dir."""
    copied = []
    src = Path(src)
    if not src.is_dir():
        return copied
    for f in sorted(src.iterdir()):
        if f.is_file() and any(fnmatch.fnmatch(f.name, pat) for pat in PROCESSOR_FILES):
            shutil.copy2(f, out_dir / f.name)
            copied.append(f.name)
    return copied


class _HFEmbedder(nn.Module):
    """Shared loading, LoRA and saving; subclasses set `auto_class`, `model_types`, LoRA targets."""

    kind = ""
    model_types: tuple[str, ...] = ()
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")

    def __init__(
        self,
        path: str | Path,
        *,
        local_files_only: bool = True,
        lora: Mapping[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        weights: bool = True,
    ) -> None:
        super().__init__()
        self.path = check_model_path(path, local_files_only)
        self.local_files_only = local_files_only
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path, local_files_only=local_files_only)
        mt = config.model_type
        if self.model_types and mt not in self.model_types:  # checked before loading weights
            raise ConfigError(
                f"{self.path} holds a {mt!r} model, but embedder kind {self.kind!r} expects "
                f"{' or '.join(self.model_types)}; pick the matching kind ({sorted(EMBEDDERS)})."
            )
        if weights:
            model = self._load(self.path, local_files_only=local_files_only, dtype=dtype)
        else:  # the architecture on the meta device (FLOP accounting): no weights read
            with torch.device("meta"):
                model = self._from_config(config)
        self.lora = dict(lora) if lora else None
        self.model = apply_lora(model, self.lora, self.lora_targets) if self.lora else model
        # after LoRA, so adapters peft attached inside unused modules are frozen with them
        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}
        self._freeze_unused(self.base_model())
        # what that froze (names under this module): no model.freeze asks for it, and the
        # doctor's frozen-part check leaves it out (vltrain.diagnostics.probe.frozen_by_design)
        self.frozen_by_design = tuple(
            n for n, p in self.named_parameters() if id(p) in trainable and not p.requires_grad
        )
        self.trainable_params, self.total_params = count_parameters(self.model)

    def _load(self, path: str, **kw: Any) -> nn.Module:
        raise NotImplementedError

    def _from_config(self, config: Any) -> nn.Module:
        raise NotImplementedError(f"{type(self).__name__} is built with its weights only")

    def _freeze_unused(self, model: nn.Module) -> None:
        """Freeze parameters the embedding never uses, so DDP sees no unused parameters."""

    def base_model(self) -> nn.Module:
        """The transformers model (LoRA layers stay injected in it)."""
        return self.model.get_base_model() if self.lora else self.model

    def describe(self) -> str:
        """One line for the run log: kind, path and trainable-parameter count."""
        pct = 100.0 * self.trainable_params / max(self.total_params, 1)
        return (
            f"{self.kind} from {self.path}: {self.trainable_params:,} of "
            f"{self.total_params:,} parameters trainable ({pct:.2f}%)"
            + (f", LoRA {self.lora}" if self.lora else "")
        )

    def save_pretrained(self, out_dir: str | Path, merge_lora: bool = True) -> Path:
        """Write an HF-loadable directory: weights, config and the source's processor files.

        With LoRA and ``merge_lora=True`` (default) the adapters are merged into a copy of the
        model first, so the directory is a plain transformers model (the copy costs one model's
        memory; call it on rank 0 only). With ``merge_lora=False`` only the peft adapter is
        written (``adapter_config.json`` + ``adapter_model.safetensors``, pointing at the base
        path); load it with ``peft.PeftModel.from_pretrained(base_model, out_dir)``.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.lora and merge_lora:
            copy.deepcopy(self.model).merge_and_unload().save_pretrained(out)
        else:
            self.model.save_pretrained(out)
        if not copy_processor_files(self.path, out):
            self._save_processor(out)
        return out

    def _save_processor(self, out: Path) -> None:
        """Hub-id sources: re-save the tokenizer (and image processor) through transformers."""
        from transformers import AutoImageProcessor, AutoTokenizer

        kw = {"local_files_only": self.local_files_only}
        AutoTokenizer.from_pretrained(self.path, **kw).save_pretrained(out)
        AutoImageProcessor.from_pretrained(self.path, backend="pil", **kw).save_pretrained(out)


class HFClipEmbedder(_HFEmbedder):
    """A transformers ``CLIPModel``: projected pooled image / text features, unit norm.

    The loss should start from the model's own temperature: ``build_loss(name,
    **emb.loss_init(name), ...)`` (see `loss_init`).
    """

    kind = "hf_clip"
    model_types = ("clip",)
    default_loss = "infonce"

    def _load(self, path: str, **kw: Any) -> nn.Module:
        from transformers import CLIPModel

        return CLIPModel.from_pretrained(path, **kw)

    def _freeze_unused(self, model: nn.Module) -> None:
        """The loss owns temperature (and bias): the model's copies get no gradient."""
        for name in ("logit_scale", "logit_bias"):
            if isinstance(getattr(model, name, None), nn.Parameter):
                getattr(model, name).requires_grad_(False)

    @property
    def embed_dim(self) -> int:
        """Embedding size E (the projection dim)."""
        return int(self.base_model().config.projection_dim)

    @staticmethod
    def _pooled(out: Any) -> Tensor:
        return out if torch.is_tensor(out) else out.pooler_output

    def encode_image(self, images: Tensor, normalize: bool = True) -> Tensor:
        """Processor pixel values (B, 3, S, S) -> (B, E) fp32."""
        x = self._pooled(self.base_model().get_image_features(pixel_values=images))  # (B, E)
        return F.normalize(x.float(), dim=-1) if normalize else x.float()

    def encode_text(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, normalize: bool = True
    ) -> Tensor:
        """Token ids (B, T) + mask (B, T) -> (B, E) fp32."""
        out = self.base_model().get_text_features(
            input_ids=input_ids, attention_mask=attention_mask
        )
        x = self._pooled(out)  # (B, E)
        return F.normalize(x.float(), dim=-1) if normalize else x.float()

    def forward(
        self, images: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Both embeddings in one call (one forward for DDP)."""
        return self.encode_image(images), self.encode_text(input_ids, attention_mask)

    def logit_scale(self) -> float:
        """The model's learned multiplier ``exp(logit_scale)`` (CLIP: about 100 when trained)."""
        return float(self.base_model().logit_scale.detach().float().exp())

    def logit_bias(self) -> float | None:
        """The model's sigmoid-loss bias (SigLIP only; CLIP has none)."""
        return None

    @torch.no_grad()
    def set_logit_params(self, log_scale: Tensor, bias: Tensor | None = None) -> None:
        """Write the loss's trained log-scale (and bias, where the model has one) into the
        model's own copies, so an exported model produces the logits training ended with."""
        m = self.base_model()
        m.logit_scale.copy_(log_scale.detach().reshape(m.logit_scale.shape))
        if bias is not None and isinstance(getattr(m, "logit_bias", None), Tensor):
            m.logit_bias.copy_(bias.detach().reshape(m.logit_bias.shape))

    def loss_init(self, loss: str | None = None) -> dict[str, float]:
        """Kwargs for `build_loss(loss, ...)` that reproduce the pretrained logits at step 0.

        ``infonce``: ``temperature = 1 / exp(logit_scale)``; ``siglip``: ``init_scale`` (and
        ``init_bias`` when the model has one). ``max_logit_scale`` is raised when the model's
        scale is above the losses' default clamp of 100 (trained SigLIP sits near 117).
        Default loss: ``infonce`` for CLIP, ``siglip`` for SigLIP.
        """
        loss = loss or self.default_loss
        scale, bias = self.logit_scale(), self.logit_bias()
        if loss == "infonce":
            out = {"temperature": 1.0 / scale}
        elif loss == "siglip":
            out = {"init_scale": scale} | ({} if bias is None else {"init_bias": bias})
        else:
            raise KeyError(
                f"loss_init: no initialisation known for loss {loss!r}; "
                "known: ['infonce', 'siglip']"
            )
        if scale > 100.0:
            out["max_logit_scale"] = float(math.ceil(scale))
        return out


class HFSiglipEmbedder(HFClipEmbedder):
    """A transformers ``SiglipModel``; also exposes the sigmoid loss's ``logit_bias``.

    SigLIP's text tower pools the LAST position, so texts must be padded to ``max_length``
    (the collate does this for this kind); ``loss_init("siglip")`` carries scale and bias.
    """

    kind = "hf_siglip"
    model_types = ("siglip",)
    default_loss = "siglip"

    def _load(self, path: str, **kw: Any) -> nn.Module:
        from transformers import SiglipModel

        return SiglipModel.from_pretrained(path, **kw)

    @property
    def embed_dim(self) -> int:
        """Embedding size E (SigLIP has no separate projection: the text hidden size)."""
        return int(self.base_model().config.text_config.hidden_size)

    def logit_bias(self) -> float:
        """The model's learned sigmoid-loss bias (about -10 at init for SigLIP)."""
        return float(self.base_model().logit_bias.detach().float())


def last_token_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Hidden state at each row's last non-padding position; left or right padding. (B, D)."""
    t = attention_mask.shape[1]
    last = t - 1 - attention_mask.flip(1).to(torch.long).argmax(1)  # (B,)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of hidden states over non-padding positions. (B, T, D) -> (B, D)."""
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


POOLINGS = {"eos": last_token_pool, "mean": mean_pool}


def _no_modules(model: nn.Module) -> list[nn.Module]:
    return []


def llava_unused_vision(model: nn.Module) -> list[nn.Module]:
    """Vision-tower modules a LLaVA model runs but never reads (so they get no gradient).

    The projector reads the tower's hidden states at ``vision_feature_layer`` (LLaVA-1.5: -2,
    the penultimate layer), never its pooled output: later layers and the pooling head
    (``post_layernorm``, SigLIP's ``head``) are dead ends. Towers without ``encoder.layers``
    (e.g. Pixtral) are left alone.
    """
    tower = model.model.vision_tower
    tower = getattr(tower, "vision_model", tower)  # transformers 4.x wraps the transformer
    layers = getattr(getattr(tower, "encoder", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return []
    picked = model.config.vision_feature_layer
    picked = [picked] if isinstance(picked, int) else list(picked)
    # hidden_states[k] is the output of the first k layers (k = 0: the embeddings)
    used = max(k if k >= 0 else len(layers) + 1 + k for k in picked)
    heads = [getattr(tower, name, None) for name in ("post_layernorm", "head")]
    return [*layers[used:], *(m for m in heads if isinstance(m, nn.Module))]


# model_type -> modules of the loaded model that never reach the embedding (frozen at load)
UNUSED_VISION = {"llava": llava_unused_vision}


class VLMEmbedder(_HFEmbedder):
    """An image-text-to-text model used as an embedder (VLM2Vec / GME style).

    The embedding is the decoder's last-layer hidden state at the last non-padding token
    (``pooling="eos"``) or its masked mean (``"mean"``), fp32, unit norm. The prompts
    (chat template, ``instruction_doc`` on the image side, ``instruction_query`` on the text
    side) are built by the collate; the embedder keeps the strings so both use the same ones.
    ``matryoshka_dims`` lists prefix sizes to train / serve; `truncate` re-normalises.
    """

    kind = "vlm"
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(
        self,
        path: str | Path,
        pooling: str = "eos",
        instruction_query: str = "",
        instruction_doc: str = "",
        matryoshka_dims: Sequence[int] = (),
        *,
        local_files_only: bool = True,
        lora: Mapping[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
        weights: bool = True,
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {sorted(POOLINGS)}, got {pooling!r}")
        super().__init__(
            path, local_files_only=local_files_only, lora=lora, dtype=dtype, weights=weights
        )
        self.pooling = pooling
        self.instruction_query = instruction_query
        self.instruction_doc = instruction_doc
        dims = sorted({int(d) for d in matryoshka_dims})
        if dims and (dims[0] <= 0 or dims[-1] > self.embed_dim):
            raise ValueError(
                f"matryoshka_dims {list(matryoshka_dims)} must lie in [1, {self.embed_dim}] "
                f"(the hidden size of {self.path})."
            )
        self.matryoshka_dims = dims

    def _load(self, path: str, **kw: Any) -> nn.Module:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(path, **kw)

    def _from_config(self, config: Any) -> nn.Module:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_config(config)

    def _freeze_unused(self, model: nn.Module) -> None:
        """Freeze what never reaches the embedding: the LM head (unless tied to the input
        embeddings) and the vision layers a LLaVA projector does not read."""
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and head.weight is not emb.weight:
            head.requires_grad_(False)
        for module in UNUSED_VISION.get(model.config.model_type, _no_modules)(model):
            module.requires_grad_(False)

    @property
    def embed_dim(self) -> int:
        """Hidden size of the language model (the full embedding size)."""
        cfg = self.base_model().config
        return int(cfg.get_text_config().hidden_size)

    def _decoder(self) -> nn.Module:
        """The multimodal model without its LM head (no (B, T, vocab) logits are computed)."""
        return self.base_model().model

    def _embed(self, inputs: Mapping[str, Tensor], normalize: bool) -> Tensor:
        hidden = self._decoder()(**inputs, use_cache=False).last_hidden_state  # (B, T, D)
        x = POOLINGS[self.pooling](hidden, inputs["attention_mask"]).float()  # (B, D)
        return F.normalize(x, dim=-1) if normalize else x

    def encode_image(self, images: Mapping[str, Tensor], normalize: bool = True) -> Tensor:
        """Image-side inputs from `HFCollate` (input_ids, attention_mask, pixel_values, ...)."""
        return self._embed(images, normalize)

    def encode_text(
        self,
        input_ids: Tensor | Mapping[str, Tensor],
        attention_mask: Tensor | None = None,
        normalize: bool = True,
    ) -> Tensor:
        """Text-only prompts: ids (B, T) + mask (B, T), or one dict holding both -> (B, D)."""
        if isinstance(input_ids, Mapping):
            input_ids, attention_mask = input_ids["input_ids"], input_ids["attention_mask"]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        return self._embed({"input_ids": input_ids, "attention_mask": attention_mask}, normalize)

    def forward(
        self, images: Mapping[str, Tensor], input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Both embeddings in one call (one forward for DDP)."""
        return self.encode_image(images), self.encode_text(input_ids, attention_mask)

    @staticmethod
    def truncate(emb: Tensor, dim: int) -> Tensor:
        """Matryoshka prefix: the first `dim` features, re-normalised to unit norm. (B, dim)."""
        if not 0 < dim <= emb.shape[-1]:
            raise ValueError(f"truncate: dim must be in [1, {emb.shape[-1]}], got {dim}")
        return F.normalize(emb[..., :dim].float(), dim=-1)

    def matryoshka(self, emb: Tensor) -> dict[int, Tensor]:
        """Every configured prefix of `emb` (plus the full size), each unit norm."""
        return {d: self.truncate(emb, d) for d in [*self.matryoshka_dims, emb.shape[-1]]}


EMBEDDERS: dict[str, type[_HFEmbedder]] = {
    "hf_clip": HFClipEmbedder,
    "hf_siglip": HFSiglipEmbedder,
    "vlm": VLMEmbedder,
}


def build_embedder(kind: str, path: str | Path, **opts: Any) -> _HFEmbedder:
    """An HF embedder by registry key: ``build_embedder("vlm", "/models/qwen2-vl", lora={...})``."""
    if kind not in EMBEDDERS:
        raise KeyError(f"unknown embedder kind {kind!r}; known: {sorted(EMBEDDERS)}")
    return EMBEDDERS[kind](path, **opts)
