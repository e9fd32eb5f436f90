"""Generative Hugging Face VLMs for the caption stage: the ``hf_vlm`` and ``llava`` model kinds.

- ``hf_vlm``: any ``AutoModelForImageTextToText`` directory (Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
  LLaVA, Idefics3/SmolVLM, ...), loaded by `load_hf_vlm`.
- ``llava``: a real ``transformers.LlavaForConditionalGeneration`` assembled by `assemble_llava`
  from an HF CLIP or SigLIP vision model, an HF causal LM (a directory or a ``.gguf`` file) and a
  freshly initialised projector MLP; the pretrained tower and LM weights are copied in.

Both are held by one wrapper, `HFVLM`: teacher-forced cross-entropy over the labelled tokens
(``forward``), the parts ``vision`` / ``connector`` / ``decoder`` for ``model.freeze`` and
``optim.lr_scale`` (`part_of`), optional LoRA on the language model (peft), and
``save_pretrained`` (LoRA merged) that plain transformers loads.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.models.captioner import IGNORE_INDEX, token_loss
from vltrain.models.hf_embedders import UNUSED_VISION, _no_modules, check_model_path

#: the parts of a generative VLM, as model.freeze and optim.lr_scale name them
PARTS = ("vision", "connector", "decoder")
# parameter-name segments of each part, over the families transformers ships; the connector is
# looked for first (Qwen-VL's merger lives inside its vision tower)
CONNECTOR_NAMES = ("multi_modal_projector", "merger", "deepstack_merger_list", "connector")
VISION_NAMES = ("vision_tower", "visual", "vision_model")
#: config.model_type of patch-grid VLMs (image tokens from the grid, see data/visual_tokens.py)
GRID_VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def part_of(name: str) -> str:
    """The part (`PARTS`) a parameter of a transformers VLM belongs to, from its name."""
    segments = name.split(".")
    if any(s in CONNECTOR_NAMES for s in segments):
        return "connector"
    if any(s in VISION_NAMES for s in segments):
        return "vision"
    return "decoder"


def model_parts(model: nn.Module) -> set[str]:
    """The parts a model has (a part with no parameter is missing)."""
    return {part_of(n) for n, _ in model.named_parameters()}


def lora_module_names(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Full names of the decoder's ``nn.Linear`` modules whose name ends with a target (LoRA
    goes on the language model only); empty when nothing matches."""
    out = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and last in targets and part_of(name + ".w") == "decoder":
            if "lm_head" not in name:
                out.append(name)
    return out


def decoder_linear_names(model: nn.Module) -> list[str]:
    """The distinct last names of the decoder's Linear modules LoRA can target (for error
    messages: `lora_module_names` leaves the LM head out)."""
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and part_of(n + ".w") == "decoder" and "lm_head" not in n
    }
    return sorted(names)


class HFVLM(nn.Module):
    """A transformers image-text-to-text model trained with teacher-forced CE.

    ``forward(images, input_ids, attention_mask, labels)``: ``images`` is the dict of image-side
    inputs the collate built (``pixel_values`` and, by family, ``image_grid_thw`` or
    ``pixel_attention_mask``); returns ``loss`` (mean CE over labelled next tokens),
    ``token_acc`` and ``n_tokens``, like the built-in captioner; without ``labels``, ``logits``
    (B, T, V) only (``position_ids`` as HF ``generate`` builds them, for the rl stage).
    """

    def __init__(self, model: nn.Module, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lora: dict[str, Any] | None = None
        self.model = model
        self.model_type = model.config.model_type
        image_id = getattr(model.config, "image_token_id", None)
        if image_id is None:
            image_id = getattr(model.config, "image_token_index", None)
        self.image_token_id = int(image_id) if image_id is not None else None
        self._freeze_unused()

    def add_lora(self, lora: Mapping[str, Any]) -> None:
        """LoRA adapters (peft) on the language model's Linear modules named by
        ``lora["target_modules"]``; the base weights freeze, the adapters train."""
        from peft import LoraConfig, get_peft_model

        targets = lora_module_names(self.model, lora["target_modules"])
        r = int(lora["r"])
        cfg = LoraConfig(
            r=r,
            lora_alpha=float(lora.get("alpha", 2 * r)),
            lora_dropout=float(lora.get("dropout", 0.0)),
            target_modules=targets,
        )
        self.model = get_peft_model(self.model, cfg)
        self.lora = dict(lora)
        self._freeze_unused()

    def merge_lora(self) -> None:
        """Fold the adapters into the base weights: every weight trainable again, as before
        `add_lora` (a run started from a LoRA run's checkpoint)."""
        self.model = self.model.merge_and_unload().requires_grad_(True)
        self.lora = None
        self._freeze_unused()

    def base_model(self) -> nn.Module:
        """The transformers model (LoRA layers stay injected in it)."""
        return self.model.get_base_model() if self.lora else self.model

    def _freeze_unused(self) -> None:
        """Vision layers a LLaVA projector never reads get no gradient: frozen (DDP refuses
        trainable parameters without gradients)."""
        base = self.base_model()
        for module in UNUSED_VISION.get(self.model_type, _no_modules)(base):
            module.requires_grad_(False)

    @property
    def frozen_by_design(self) -> tuple[str, ...]:
        """The parameters `_freeze_unused` froze (names under this module): the doctor's
        frozen-part check leaves them out (vltrain.diagnostics.probe.frozen_by_design)."""
        unused = UNUSED_VISION.get(self.model_type, _no_modules)(self.base_model())
        ids = {id(p) for m in unused for p in m.parameters()}
        return tuple(n for n, p in self.named_parameters() if id(p) in ids)

    @staticmethod
    def part_of(name: str) -> str:
        """The part of a parameter of this wrapper (`optim.lr_scale` keys match parts too)."""
        return part_of(name)

    def parts(self) -> set[str]:
        return model_parts(self.base_model())

    def freeze(self, parts: Sequence[str]) -> None:
        """No gradient for the named parts (`PARTS`); LoRA already froze the base weights."""
        for name, p in self.model.named_parameters():
            if part_of(name) in parts:
                p.requires_grad_(False)

    def model_inputs(
        self, images: Mapping[str, Tensor], input_ids: Tensor, attention_mask: Tensor
    ) -> dict[str, Tensor]:
        """Keyword inputs of the transformers forward / generate."""
        out = {"input_ids": input_ids, "attention_mask": attention_mask, **images}
        if self.model_type in GRID_VLMS:  # Qwen-VL: which tokens are image tokens
            out["mm_token_type_ids"] = (input_ids == self.image_token_id).to(torch.int)
        return out

    def forward(
        self,
        images: Mapping[str, Tensor],
        input_ids: Tensor,
        attention_mask: Tensor,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
    ) -> dict[str, Tensor]:
        inputs = self.model_inputs(images, input_ids, attention_mask)
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        if labels is None:  # the rl stage's teacher-forced logits
            return {"logits": self.model(**inputs, use_cache=False).logits}  # (B, T, V)
        # the LM head runs only where some row predicts a label (not on the image tokens and
        # the prompt): position t predicts labels[:, t + 1]
        keep = (labels[:, 1:] != IGNORE_INDEX).any(0).nonzero().squeeze(1)
        out = self.model(**inputs, use_cache=False, logits_to_keep=keep).logits  # (B, K, V)
        loss, acc, n = token_loss(out, labels[:, keep + 1])  # the captioner's loss
        return {"loss": loss, "token_acc": acc, "n_tokens": n}

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """A directory plain transformers loads (LoRA merged into a copy of the model)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        model = copy.deepcopy(self.model).merge_and_unload() if self.lora else self.model
        model.save_pretrained(out)
        return out


# ---- the hf_vlm kind ---------------------------------------------------------------------


def load_hf_vlm(path: str, local_files_only: bool = True) -> nn.Module:
    """An ``AutoModelForImageTextToText`` from a local directory (fp32)."""
    from transformers import AutoModelForImageTextToText

    path = check_model_path(path, local_files_only)
    return AutoModelForImageTextToText.from_pretrained(
        path, local_files_only=local_files_only, dtype=torch.float32
    )


def meta_hf_vlm(path: str, local_files_only: bool = True) -> nn.Module:
    """The architecture of `path` on the meta device (config checks; no weights read)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path, local_files_only=local_files_only)
    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(config)


# ---- the llava kind ----------------------------------------------------------------------


def vision_config(path: str) -> Any:
    """The vision config of an HF CLIP or SigLIP directory (full model or vision-only)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    if cfg.model_type in ("clip", "siglip"):
        return cfg.vision_config
    if cfg.model_type in ("clip_vision_model", "siglip_vision_model"):
        return cfg
    from vltrain.config.core import ConfigError

    raise ConfigError(
        f"model.vision_path {path} holds a {cfg.model_type!r} model; the llava kind takes an HF "
        "CLIP or SigLIP model (or its vision model), or a contrastive run of hf_clip / hf_siglip"
    )


def llava_config(
    vision_path: str,
    text_config: Any,
    image_token_id: int,
    select_strategy: str = "default",
    feature_layer: int = -2,
) -> Any:
    """The ``LlavaConfig`` joining a vision tower and an LM (the projector: Linear-GELU-Linear).
    The parts name their source by folder name, never by an absolute path (the export keeps
    them)."""
    from transformers import LlavaConfig

    vision, text = vision_config(vision_path).to_dict(), text_config.to_dict()
    for part in (vision, text):
        if part.get("_name_or_path"):
            part["_name_or_path"] = Path(part["_name_or_path"]).name
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        vision_feature_select_strategy=select_strategy,
        vision_feature_layer=feature_layer,
        projector_hidden_act="gelu",
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)),
    )


def load_causal_lm(path: str) -> nn.Module:
    """An HF causal LM from a directory or a ``.gguf`` file (dequantised by transformers)."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    kw: dict[str, Any] = {"local_files_only": True, "dtype": torch.float32}
    if p.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
    return AutoModelForCausalLM.from_pretrained(str(p), **kw)


def assemble_llava(config: Any, vision_path: str, lm_path: str, vocab_size: int) -> nn.Module:
    """A ``LlavaForConditionalGeneration`` of `config` with the pretrained vision tower and LM
    copied in; the LM's embeddings are resized to `vocab_size` (config.text_config's: room for
    the added image token) and the
    projector keeps its fresh initialisation (seeded by the run)."""
    from transformers import AutoModel, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(config)
    tower_cls = type(AutoModel.from_config(vision_config(vision_path)))
    model.model.vision_tower.load_state_dict(load_vision_tower(tower_cls, vision_path).state_dict())
    lm = load_causal_lm(lm_path)
    lm.resize_token_embeddings(vocab_size, mean_resizing=False)
    model.model.language_model.load_state_dict(lm.get_decoder().state_dict())
    model.lm_head.load_state_dict(lm.get_output_embeddings().state_dict())
    return model.float()


def load_vision_tower(tower_cls: Any, vision_path: str) -> nn.Module:
    """The vision model of an HF CLIP / SigLIP folder, full model or vision-only, in fp32.

    From a full model the text tower's weights are left behind: transformers' table of them
    ("UNEXPECTED", one line per weight: hundreds for a real CLIP) is not printed. A weight of
    the vision tower that the folder lacks or holds in another shape is an error, not a
    warning: it would start from random values.
    """
    from transformers.utils import logging as hf_logging

    from vltrain.config.core import ConfigError

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tower, info = tower_cls.from_pretrained(
            vision_path,
            local_files_only=True,
            dtype=torch.float32,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, by name, with the missing ones
        )
    finally:
        hf_logging.set_verbosity(level)
    bad = [
        *info.get("missing_keys", ()),
        *(str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys", ())),
    ]
    if bad:
        raise ConfigError(
            f"model.vision_path {vision_path}: the vision tower's weights {sorted(bad)[:4]}"
            f"{' ...' if len(bad) > 4 else ''} ({len(bad)} in all) are missing or of another "
            "shape there; they would start random"
        )
    return tower


def lm_tokenizer_source(lm_path: str) -> tuple[str, dict[str, Any]]:
    """(folder, kwargs) that ``AutoTokenizer.from_pretrained`` reads an LM's tokenizer from."""
    p = Path(lm_path)
    if p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name, "local_files_only": True}
    return str(p), {"local_files_only": True}


def save_llava_processor(
    vision_path: str, lm_path: str, image_size: int, select_strategy: str, out: Path
) -> None:
    """A ``LlavaProcessor`` for an assembled model: the tower's image processor at
    `image_size`, the LM's tokenizer with ``<image>`` added (and a pad token), and the image-token
    count rule of the tower's patch grid; saved to `out` (what export and plain transformers
    load)."""
    from transformers import AddedToken, AutoImageProcessor, AutoTokenizer, LlavaProcessor

    ip = AutoImageProcessor.from_pretrained(vision_path, backend="pil", local_files_only=True)
    if hasattr(ip, "crop_size") and getattr(ip, "do_center_crop", False):
        ip.size = {"shortest_edge": image_size}
        ip.crop_size = {"height": image_size, "width": image_size}
    else:
        ip.size = {"height": image_size, "width": image_size}
    where, kw = lm_tokenizer_source(lm_path)
    tok = AutoTokenizer.from_pretrained(where, **kw)
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)], special_tokens=True)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    vc = vision_config(vision_path)
    LlavaProcessor(
        image_processor=ip,
        tokenizer=tok,
        patch_size=vc.patch_size,
        vision_feature_select_strategy=select_strategy,
        num_additional_image_tokens=1 if vc.model_type.startswith("clip") else 0,
        image_token="<image>",
        chat_template=tok.chat_template,
    ).save_pretrained(out)


def expected_image_tokens(config: Any) -> int | None:
    """Visual tokens one image becomes in the model's features, for fixed-size families
    (None: a patch-grid or other family, checked elsewhere)."""
    mt = config.model_type
    if mt == "llava":
        v = config.vision_config
        n = (v.image_size // v.patch_size) ** 2 + (1 if v.model_type.startswith("clip") else 0)
        return n - (1 if config.vision_feature_select_strategy == "default" else 0)
    if mt in ("idefics3", "smolvlm"):
        v = config.vision_config
        return int((v.image_size // v.patch_size) ** 2 / config.scale_factor**2)
    return None


def check_gguf(path: str) -> None:
    """Refuse a GGUF file transformers cannot load: the ``gguf`` package missing, or a tensor
    quantisation that gguf cannot dequantise (transformers dequantises every tensor to fp32)."""
    from vltrain.config import extras
    from vltrain.config.core import ConfigError

    if not extras.installed("gguf"):
        raise ConfigError(f"model.path={path} is a GGUF file: it needs gguf (pip install gguf)")
    import gguf
    from gguf import quants

    plain = {"F32", "F16"}  # gguf.dequantize reads these two directly
    known = set(getattr(quants, "_type_traits", {}))
    reader = gguf.GGUFReader(path)
    bad = sorted(
        {t.tensor_type.name for t in reader.tensors}
        - plain
        - {k.name for k in known if hasattr(k, "name")}
    )
    if bad:
        raise ConfigError(
            f"model.path={path} holds tensors quantised as {bad}, which transformers cannot "
            "dequantise; use a GGUF file in F16, BF16, F32 or a k-quant (Q4_K_M, Q8_0, ...)"
        )
