"""Run `vltrain.inference.decoding.generate` on HF causal LMs and image-text-to-text models.

`HFDecodeAdapter` drives the model's own `forward` with a `DynamicCache`, feeding it exactly what
HF `generate` feeds it, so that logits (and therefore tokens) agree bit for bit:

- position ids from the attention mask (`cumsum - 1`, padding at 0) via the model's own
  `_prepare_position_ids_for_generation` (Qwen2-VL's override builds its 3-D M-RoPE ids there);
  each step then uses `last + 1`;
- an all-ones attention mask is dropped (HF does the same; SDPA then takes its causal path);
- `logits_to_keep=1`; pixel values and other image inputs only at prefill.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# Inputs consumed by the prefill only (HF's MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL, abridged).
_PREFILL_ONLY = frozenset(
    {
        "pixel_values",
        "pixel_mask",
        "image_sizes",
        "pixel_values_videos",
        "pixel_attention_mask",
        "mm_encoder_outputs",
        "image_grid_thw",
        "video_grid_thw",
        "mm_token_type_ids",
        "token_type_ids",
        "second_per_grid_ts",
    }
)


@dataclass
class HFCache:
    """Decode state for HF models: the KV cache plus the mask and positions that go with it."""

    kv: Any  # transformers.Cache (B, H, T, Dh) per layer
    attention_mask: Tensor | None  # (B, T) or None when there is no padding
    position_ids: Tensor | None  # (B, 1) or (C, B, 1): position of the last fed token


class HFDecodeAdapter:
    """Adapts an HF `*ForCausalLM` / `*ForConditionalGeneration` model to `DecodeModel`.

    `static_inputs` are extra forward kwargs passed at every prefill (for example
    `vision_feature_select_strategy`). Token ids default to the model's generation config and
    can be overridden by keyword.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        **static_inputs: Any,
    ) -> None:
        self.model = model
        self.static_inputs = static_inputs
        gen = getattr(model, "generation_config", None)
        self.eos_token_id = _token(eos_token_id, gen, model, "eos_token_id")
        self.pad_token_id = _token(pad_token_id, gen, model, "pad_token_id", self.eos_token_id)
        self.bos_token_id = _token(bos_token_id, gen, model, "bos_token_id", self.pad_token_id)
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params

    def prefill(self, **inputs: Any) -> tuple[Tensor, HFCache]:
        """Run the prompt (with images); needs `input_ids` (B, T), optional `attention_mask`."""
        from transformers import DynamicCache

        kwargs = {**self.static_inputs, **inputs}
        if "input_ids" not in kwargs:
            raise ValueError(
                "HFDecodeAdapter.prefill needs input_ids (B, T); got keys "
                f"{sorted(kwargs)}. Pass the processor's output dict."
            )
        input_ids = kwargs.pop("input_ids")
        mask = kwargs.pop("attention_mask", None)
        if mask is None:
            mask = torch.ones_like(input_ids)
        positions = self._positions(input_ids, mask, kwargs) if self._takes_positions else None
        kv_mask = None if bool((mask == 1).all()) else mask
        cache = DynamicCache(config=self.model.config.get_text_config(decoder=True))
        out = self._forward(input_ids, kv_mask, positions, cache, kwargs)
        last_pos = None if positions is None else positions[..., -1:]
        return out.logits[:, -1].float(), HFCache(out.cache, kv_mask, last_pos)

    def step(self, tokens: Tensor, cache: HFCache) -> tuple[Tensor, HFCache]:
        """Feed one token per row (B,); returns next-token logits (B, V) float32."""
        mask = cache.attention_mask
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        pos = None if cache.position_ids is None else cache.position_ids + 1
        extra = {k: v for k, v in self.static_inputs.items() if k not in _PREFILL_ONLY}
        out = self._forward(tokens[:, None], mask, pos, cache.kv, extra)
        return out.logits[:, -1].float(), HFCache(out.cache, mask, pos)

    def reorder_cache(self, cache: HFCache, index: Tensor) -> HFCache:
        """Select/repeat batch rows (in place on the KV tensors; the old state is consumed)."""
        cache.kv.reorder_cache(index)
        mask = None if cache.attention_mask is None else cache.attention_mask[index]
        pos = cache.position_ids
        if pos is not None:
            pos = pos[index] if pos.dim() == 2 else pos[:, index]
        return HFCache(cache.kv, mask, pos)

    def _positions(self, input_ids: Tensor, mask: Tensor, kwargs: dict[str, Any]) -> Tensor:
        """Prompt position ids (B, T) or (C, B, T), computed as HF generate computes them."""
        helper = getattr(self.model, "_prepare_position_ids_for_generation", None)
        if helper is not None:  # HF's own (private) helper; Qwen2-VL overrides it for M-RoPE
            return helper(input_ids, {"attention_mask": mask, **kwargs})
        return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)  # (B, T)

    def _forward(
        self, ids: Tensor, mask: Tensor | None, pos: Tensor | None, kv: Any, kwargs: dict[str, Any]
    ) -> Any:
        call = dict(kwargs)
        if pos is not None:
            call["position_ids"] = pos
        if self._takes_logits_to_keep:
            call["logits_to_keep"] = 1
        return self.model(
            input_ids=ids, attention_mask=mask, cache=kv, use_cache=True, return_dict=True, **call
        )


def _token(
    explicit: int | None, gen: Any, model: nn.Module, name: str, fallback: int | None = None
) -> int:
    """Resolve a special token id: explicit > generation_config > config > fallback."""
    value = explicit
    for source in (gen, getattr(model, "config", None)):
        if value is None and source is not None:
            value = getattr(source, name, None)
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(
                f"{name}={value}: vltrain decoding supports exactly one id; pass "
                f"{name}=<int> to HFDecodeAdapter."
            )
        value = value[0]
    if value is None:
        value = fallback
    if value is None:
        raise ValueError(f"The model defines no {name}; pass {name}=<int> to HFDecodeAdapter.")
    return int(value)
