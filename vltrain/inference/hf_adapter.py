"""Run `vltrain.inference.decoding.generate` on HF causal LMs and image-text-to-text models.

`HFDecodeAdapter` drives the model's own `forward` with a `DynamicCache`, feeding it exactly what
HF `generate` feeds it, so that logits (and therefore tokens) agree bit for bit:

- position ids from the attention mask (`cumsum - 1`, padding at 0) via the model's own
  `_prepare_position_ids_for_generation` (Qwen2-VL's override builds its 3-D M-RoPE ids there);
  each step then uses `last + 1`;
- an all-ones attention mask is dropped (HF does the same; SDPA then takes its causal path);
- `logits_to_keep=1`; pixel values and other image inputs only at prefill.

`verify` feeds K tokens per row in one forward (`logits_to_keep=K`). By default they continue
the cache as a causal chain (positions `last + 1 ...`, the 2-D padding mask extended), which
equals K `step` calls. Explicit `position_ids` (B, K) and a 4-D mask (B or 1, 1, K, S + K) over
cached + new positions verify a tree or a block; HF uses a 4-D mask as given (no causal or
padding mask is added), so it must already hide cached padding. Limits: the 4-D mask needs the
`sdpa` or `eager` attention implementation (not flash / flex) and a text model whose positions
are (B, K) (M-RoPE models need (C, B, K) ids, built by the caller); `select_cache` supports
only `DynamicCache` full-attention layers and (B, T) position ids; it moves only the positions
after the longest kept prefix, in place (a speculative round copies its accepted nodes, not the
whole cache: 0.4 instead of 2.0 ms a round for SmolLM2-135M on a Xeon). With
`output_hidden_states=True` among the static inputs, `prefill` / `verify` keep the forward's
hidden states in `HFCache.hidden_states` (what a block drafter reads).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.models.layers import kept_prefix, move_kept

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
    hidden_states: tuple[Tensor, ...] | None = None  # the last call's, with output_hidden_states


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
        hidden = getattr(out, "hidden_states", None)
        return out.logits[:, -1].float(), HFCache(out.cache, kv_mask, last_pos, hidden)

    def step(self, tokens: Tensor, cache: HFCache) -> tuple[Tensor, HFCache]:
        """Feed one token per row (B,); returns next-token logits (B, V) float32."""
        mask = cache.attention_mask
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        pos = None if cache.position_ids is None else cache.position_ids + 1
        extra = {k: v for k, v in self.static_inputs.items() if k not in _PREFILL_ONLY}
        out = self._forward(tokens[:, None], mask, pos, cache.kv, extra)
        return out.logits[:, -1].float(), HFCache(out.cache, mask, pos)

    def verify(
        self,
        tokens: Tensor,
        cache: HFCache,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        keep: int | None = None,
    ) -> tuple[Tensor, HFCache]:
        """Feed `tokens` (B, K); return the logits after each (B, K, V) float32 and the cache.

        `position_ids` (B, K) default to the chain `last + 1 ... last + K`; `attention_mask`
        is an optional 4-D bool mask (B or 1, 1, K, S + K), True = attend (see module doc).
        `keep`: logits of the last `keep` tokens only (B, keep, V) (default all K), for a
        caller that applies the head itself to the hidden states.
        """
        if tokens.ndim != 2:
            raise ValueError(f"verify takes (B, K) tokens, got {tuple(tokens.shape)}")
        k = tokens.shape[1]
        mask2d = cache.attention_mask
        if mask2d is not None:
            mask2d = torch.cat([mask2d, mask2d.new_ones((mask2d.shape[0], k))], dim=-1)
        if position_ids is None and cache.position_ids is not None:
            step = torch.arange(1, k + 1, device=tokens.device)
            position_ids = cache.position_ids + step  # (B, K) or (C, B, K)
        if position_ids is not None and not self._takes_positions:
            raise ValueError("this model's forward takes no position_ids; verify without them")
        fed_mask = mask2d if attention_mask is None else self._mask_4d(attention_mask, k)
        extra = {kk: v for kk, v in self.static_inputs.items() if kk not in _PREFILL_ONLY}
        keep = k if keep is None else keep
        out = self._forward(tokens, fed_mask, position_ids, cache.kv, extra, keep=keep)
        last = None if position_ids is None else position_ids[..., -1:]
        hidden = getattr(out, "hidden_states", None)
        return out.logits[:, -keep:].float(), HFCache(out.cache, mask2d, last, hidden)

    def crop_cache(self, cache: HFCache, n: int) -> HFCache:
        """Keep the first `n` cached positions (in place on the KV tensors).

        The next position steps back by the number of dropped positions, which is exact when
        those were a chain (the tokens of a chain `verify` or of `step` calls).
        """
        length = cache.kv.get_seq_length()
        if not 0 <= n <= length:
            raise ValueError(f"crop_cache({n}): keep between 0 and {length} cached positions")
        cache.kv.crop(n - length)  # HF's crop takes minus the number of tokens to remove
        mask = None if cache.attention_mask is None else cache.attention_mask[:, :n]
        pos = None if cache.position_ids is None else cache.position_ids - (length - n)
        return HFCache(cache.kv, mask, pos)

    def select_cache(self, cache: HFCache, index: Tensor, valid: Tensor | None = None) -> HFCache:
        """Keep cached positions `index` (B, N) per row (in place on the KV tensors).

        Entries with `valid` False become padding. The next position is the number of real
        cached tokens, as HF counts positions of a padded prompt (`cumsum - 1`).
        """
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache.kv, "layers", [])
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            raise ValueError("select_cache supports DynamicCache full-attention layers only")
        if cache.position_ids is not None and cache.position_ids.dim() != 2:
            raise ValueError("select_cache supports (B, T) position ids only (not M-RoPE)")
        b, s_len = layers[0].keys.shape[0], layers[0].keys.shape[2]
        index = index.to(device=layers[0].keys.device, dtype=torch.long).expand(b, -1)
        # positions kept where they are (speculative decoding keeps the whole old cache) are
        # not copied: only the tail after the common prefix moves, into place, then a cut
        n = index.shape[1]
        p = kept_prefix(index) if n <= s_len else 0
        for layer in layers:
            if n > s_len:  # more kept than cached (repeated positions): new tensors
                idx = _per_head(index, layer.keys)
                layer.keys, layer.values = layer.keys.gather(2, idx), layer.values.gather(2, idx)
                continue
            move_kept(layer.keys, index, p)
            move_kept(layer.values, index, p)
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        mask = cache.attention_mask
        mask = (
            torch.ones((b, s_len), dtype=torch.long, device=index.device) if mask is None else mask
        )
        mask = mask.gather(1, index)  # (B, N)
        if valid is not None:
            mask = mask * valid.to(mask.device).expand_as(mask).to(mask.dtype)
        pos = None if cache.position_ids is None else mask.long().sum(-1, keepdim=True) - 1
        keep = None if bool((mask == 1).all()) else mask
        return HFCache(cache.kv, keep, pos)

    def _mask_4d(self, mask: Tensor, k: int) -> Tensor:
        """A bool (B, 1, K, S) mask in the form the model's attention implementation adds."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        if mask.ndim != 4 or mask.shape[2] != k:
            raise ValueError(f"verify needs a 4-D (B, 1, K={k}, S) mask, got {tuple(mask.shape)}")
        if impl == "sdpa":
            return mask.bool()
        if impl == "eager":
            dtype = next(self.model.parameters()).dtype
            zero = torch.zeros((), dtype=dtype, device=mask.device)
            return torch.where(mask.bool(), zero, torch.finfo(dtype).min)
        raise ValueError(
            f"verify with a custom mask needs attn_implementation 'sdpa' or 'eager', not {impl!r}"
        )

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
        self,
        ids: Tensor,
        mask: Tensor | None,
        pos: Tensor | None,
        kv: Any,
        kwargs: dict[str, Any],
        keep: int = 1,
    ) -> Any:
        call = dict(kwargs)
        if pos is not None:
            call["position_ids"] = pos
        if self._takes_logits_to_keep:
            call["logits_to_keep"] = keep
        return self.model(
            input_ids=ids, attention_mask=mask, cache=kv, use_cache=True, return_dict=True, **call
        )


def _per_head(index: Tensor, like: Tensor) -> Tensor:
    """Position indices (B, N) as gather indices (B, H, N, Dh) over a (B, H, S, Dh) cache."""
    return index[:, None, :, None].expand(-1, like.shape[1], -1, like.shape[3])


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
