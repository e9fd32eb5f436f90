"""HF causal LMs and image-text-to-text models as a ``DecodeTarget`` (``inference.target``).

``HFTarget`` drives the model's own ``forward`` with a ``DynamicCache``, feeding it exactly what
HF ``generate`` feeds it, so that logits (and therefore tokens) agree bit for bit:

- position ids from the attention mask (``cumsum - 1``, padding at 0) via the model's own
  ``_prepare_position_ids_for_generation`` (Qwen2-VL's override builds its 3-D M-RoPE ids
  there); each step then uses ``last + 1``;
- an all-ones attention mask is dropped (HF does the same; SDPA then takes its causal path);
- ``logits_to_keep=1``; pixel values and other image inputs only at prefill.

``verify`` feeds a tree of N nodes (a chain is one) after the cache in one forward, with
positions by depth and a 4-D ancestor mask over cached + new positions
(``vltrain.models.layers.tree_mask``) and ``logits_to_keep=N``; HF uses a 4-D mask as given (no
causal or padding mask is added), so the mask hides cached padding itself. Multi-channel
positions (Qwen-VL's (4, B, T): the text position, then M-RoPE's three) step together after the
prompt: every channel keeps its offset to the text channel (channel 0), which is the position
that ``next_positions`` and the drafter's ``Context`` count. Limits: the 4-D mask needs the
``sdpa`` or ``eager`` attention implementation (not flash / flex), and ``verify`` / ``select``
a full-attention ``DynamicCache``. ``select`` moves only the positions after the longest kept
prefix, in place (a speculative round copies its accepted nodes, not the whole cache: 0.4
instead of 2.0 ms a round for SmolLM2-135M on a Xeon).

Drafter features are read *after* block i: HF's ``hidden_states[i + 1]`` (index 0 holds the
embeddings), except the last block: HF's last hidden state has the final norm applied, so
``HFTarget`` reads that block's own output with a forward hook (the native forward and the
captioner tap block outputs, and a drafter trained on one target's features is deployed on
another's). Hidden states are asked of the model only when features are read.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.config import extras
from vltrain.config.core import ConfigError
from vltrain.config.hub_ids import is_model_id
from vltrain.core import hub
from vltrain.inference.target import Context, StopIds
from vltrain.models.layers import kept_prefix, move_kept, tree_depths, tree_mask
from vltrain.models.text import mask_positions

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


class HFTarget(StopIds):
    """An HF ``*ForCausalLM`` / ``*ForConditionalGeneration`` model as a ``DecodeTarget``.

    ``layer_ids``: the blocks whose outputs a drafter reads (none for plain decoding).
    ``static_inputs`` are extra forward kwargs passed at every prefill (for example
    ``vision_feature_select_strategy``). Token ids default to the model's generation config
    (every eos id of its list ends a row: ``eos_token_ids``) and can be overridden by keyword.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_ids: Sequence[int] = (),
        *,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        **static_inputs: Any,
    ) -> None:
        self.model = model
        self.static_inputs = static_inputs
        self.eos_token_ids, self.pad_token_id, self.bos_token_id = special_tokens(
            model, eos_token_id, pad_token_id, bos_token_id
        )
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        text = model.config.get_text_config(decoder=True)
        self.num_layers, self.width = text.num_hidden_layers, text.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.layer_ids = list(layer_ids)
        self._last: Tensor | None = None  # the last block's output, when a drafter reads it
        self.reads_last = self.num_layers - 1 in self.layer_ids
        self._last_block = decoder_blocks(model, self.num_layers)[-1] if self.reads_last else None

    # ----------------------------------------------------------------------- decoding

    @torch.no_grad()
    def prefill(
        self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, **inputs: Any
    ) -> tuple[Tensor, HFCache, Context]:
        """Run the prompt (with images): ``input_ids`` (B, T), optional ``attention_mask``."""
        from transformers import DynamicCache

        if input_ids is None:
            raise ValueError(
                "HFTarget.prefill needs input_ids (B, T); got keys "
                f"{sorted(inputs)}. Pass the processor's output dict."
            )
        kwargs = {**self.static_inputs, **inputs}
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        positions = (
            self.prompt_positions(input_ids, mask, kwargs) if self._takes_positions else None
        )
        kv_mask = None if bool((mask == 1).all()) else mask
        cache = DynamicCache(config=self.model.config.get_text_config(decoder=True))
        if self.layer_ids:
            kwargs["output_hidden_states"] = True
        with self._reading():
            out = self._forward(input_ids, kv_mask, positions, cache, kwargs)
            feats = self._features(out, input_ids)
        last_pos = None if positions is None else positions[..., -1:]
        real = mask.bool()
        ctx = Context(feats, mask_positions(real), real)
        return out.logits[:, -1].float(), HFCache(out.cache, kv_mask, last_pos), ctx

    @torch.no_grad()
    def step(self, tokens: Tensor, cache: HFCache) -> tuple[Tensor, HFCache]:
        """Feed one token per row (B,); returns next-token logits (B, V) float32."""
        mask = cache.attention_mask
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        pos = None if cache.position_ids is None else cache.position_ids + 1
        out = self._forward(tokens[:, None], mask, pos, cache.kv, self._later_inputs())
        return out.logits[:, -1].float(), HFCache(out.cache, mask, pos)

    @torch.no_grad()
    def verify(
        self, tokens: Tensor, parents: Tensor, cache: HFCache, logits: bool = True
    ) -> tuple[Tensor, HFCache, Context]:
        """Tree nodes (B, N) with parents (B, N) after the cache, in one forward: logits
        (B, N, V), or the final hidden states (B, N, W) with ``logits=False``."""
        if tokens.ndim != 2:
            raise ValueError(f"verify takes (B, N) tokens, got {tuple(tokens.shape)}")
        if not self._takes_positions:
            raise ValueError("verify needs a model whose forward takes position_ids")
        self._check_positions(cache, "verify")
        n = tokens.shape[1]
        key_mask = self._key_mask(cache).to(tokens.device)
        text_pos = self.next_positions(cache)[:, None] + tree_depths(parents)  # (B, N)
        pos = _with_channels(text_pos, cache.position_ids)  # (B, N) or (C, B, N)
        attn = self._mask_4d(tree_mask(parents, key_mask.shape[1], key_mask=key_mask), n)
        mask2d = cache.attention_mask
        if mask2d is not None:
            mask2d = torch.cat([mask2d, mask2d.new_ones((mask2d.shape[0], n))], dim=-1)
        extra = self._later_inputs()
        if self.layer_ids or not logits:
            extra["output_hidden_states"] = True
        keep = n if logits else 1
        with self._reading():
            out = self._forward(tokens, attn, pos, cache.kv, extra, keep=keep)
            feats = self._features(out, tokens)
        # HF's last hidden state is after the final norm: what the head reads
        scores = out.logits[:, -keep:].float() if logits else out.hidden_states[-1][:, -n:]
        ones = torch.ones_like(tokens, dtype=torch.bool)
        ctx = Context(feats, text_pos, ones)
        return scores, HFCache(out.cache, mask2d, pos[..., -1:]), ctx

    def select(self, cache: HFCache, index: Tensor, valid: Tensor | None = None) -> HFCache:
        """Keep cached positions ``index`` (B, N) per row (in place on the KV tensors).

        Entries with ``valid`` False become padding. The next position is the number of real
        cached tokens, as HF counts positions of a padded prompt (``cumsum - 1``).
        """
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache.kv, "layers", [])
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            raise ValueError("select supports DynamicCache full-attention layers only")
        self._check_positions(cache, "select")
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
        pos = cache.position_ids
        if pos is not None:
            pos = _with_channels(mask.long().sum(-1, keepdim=True) - 1, pos)  # (B, 1) / (C, B, 1)
        keep = None if bool((mask == 1).all()) else mask
        return HFCache(cache.kv, keep, pos)

    def crop(self, cache: HFCache, n: int) -> HFCache:
        """Keep the first ``n`` cached positions (in place on the KV tensors).

        The next position steps back by the number of dropped positions, which is exact when
        those were a chain (a chain's nodes, or the tokens of ``step`` calls).
        """
        length = cache.kv.get_seq_length()
        if not 0 <= n <= length:
            raise ValueError(f"crop({n}): keep between 0 and {length} cached positions")
        cache.kv.crop(n - length)  # HF's crop takes minus the number of tokens to remove
        mask = None if cache.attention_mask is None else cache.attention_mask[:, :n]
        pos = None if cache.position_ids is None else cache.position_ids - (length - n)
        return HFCache(cache.kv, mask, pos)

    def reorder(self, cache: HFCache, rows: Tensor) -> HFCache:
        """Select/repeat batch rows (in place on the KV tensors; the old state is consumed)."""
        cache.kv.reorder_cache(rows)
        mask = None if cache.attention_mask is None else cache.attention_mask[rows]
        pos = cache.position_ids
        if pos is not None:
            pos = pos[rows] if pos.dim() == 2 else pos[:, rows]
        return HFCache(cache.kv, mask, pos)

    def next_positions(self, cache: HFCache) -> Tensor:
        """(B,) the text position of each row's next token (channel 0 of M-RoPE ids)."""
        self._check_positions(cache, "next_positions")
        pos = cache.position_ids
        return (pos if pos.dim() == 2 else pos[0])[:, 0] + 1

    # ----------------------------------------------------------------------- drafter

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.get_input_embeddings()(ids)

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(hidden)

    def head_params(self) -> tuple[Tensor, Tensor | None]:
        lin = self.model.get_output_embeddings()
        return lin.weight, getattr(lin, "bias", None)

    @torch.no_grad()
    def features(self, input_ids: Tensor, attention_mask: Tensor, **inputs: Any):
        """(Context of every position, logits (B, T, V), prefix length 0) of right-padded rows;
        ``inputs``: an image-text model's image inputs (its placeholders are in ``input_ids``)."""
        with self._reading():
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                output_hidden_states=True,
                use_cache=False,
                **self.static_inputs,
                **inputs,
            )
            feats = self._taps(out.hidden_states)
        mask = attention_mask.bool()
        ctx = Context(feats, mask_positions(mask), mask)
        return ctx, out.logits.float(), 0

    # ----------------------------------------------------------------------- internals

    def _keep_last(self, module: Any, args: Any, out: Any) -> None:
        self._last = out[0] if isinstance(out, tuple) else out

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Hook the last block for the length of one of this target's forwards (only when a
        drafter reads it): the model carries no hook, and holds no output, between calls."""
        if self._last_block is None:
            yield
            return
        handle = self._last_block.register_forward_hook(self._keep_last)
        try:
            yield
        finally:
            handle.remove()

    def _taps(self, hidden_states: tuple[Tensor, ...]) -> Tensor:
        """The drafter's features from HF's hidden states: block outputs, the last one raw."""
        if self.reads_last:
            if self._last is None:
                raise RuntimeError("the last decoder block's forward hook did not run")
            hidden_states = (*hidden_states[:-1], self._last)
            self._last = None
        return _concat(hidden_states, self.layer_ids, 1)

    def _features(self, out: Any, fed: Tensor) -> Tensor:
        """Features (B, S, F) of the fed positions of a forward; (B, S, 0) without a drafter."""
        if not self.layer_ids:
            return torch.empty((*fed.shape[:2], 0), device=fed.device, dtype=self.model.dtype)
        return self._taps(out.hidden_states)

    def _later_inputs(self) -> dict[str, Any]:
        """The static inputs that every call after the prefill takes too."""
        return {k: v for k, v in self.static_inputs.items() if k not in _PREFILL_ONLY}

    @staticmethod
    def _check_positions(cache: HFCache, what: str) -> None:
        if cache.position_ids is None or cache.position_ids.dim() not in (2, 3):
            raise ValueError(f"{what} needs a model whose forward takes position ids")

    def _key_mask(self, cache: HFCache) -> Tensor:
        n = cache.kv.get_seq_length()
        if cache.attention_mask is None:
            return torch.ones(cache.position_ids.shape[-2], n, dtype=torch.bool)
        return cache.attention_mask.bool()

    def _mask_4d(self, mask: Tensor, n: int) -> Tensor:
        """A bool (B, 1, N, S) mask in the form the model's attention implementation adds."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        if mask.ndim != 4 or mask.shape[2] != n:
            raise ValueError(f"verify needs a 4-D (B, 1, N={n}, S) mask, got {tuple(mask.shape)}")
        if impl == "sdpa":
            return mask.bool()
        if impl == "eager":
            dtype = next(self.model.parameters()).dtype
            zero = torch.zeros((), dtype=dtype, device=mask.device)
            return torch.where(mask.bool(), zero, torch.finfo(dtype).min)
        raise ValueError(
            f"verify's 4-D mask needs attn_implementation 'sdpa' or 'eager', not {impl!r}"
        )

    def prompt_positions(self, input_ids: Tensor, mask: Tensor, kwargs: dict[str, Any]) -> Tensor:
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


def _with_channels(text_pos: Tensor, last: Tensor) -> Tensor:
    """Text positions (B, N) in the layout of ``last``, the cache's last position ids: (B, 1)
    as they are, (C, B, 1) (M-RoPE) with each channel's offset to channel 0 added."""
    if last.dim() == 2:
        return text_pos
    return text_pos[None] + (last - last[:1])  # (C, B, N)


def _concat(hidden_states: tuple[Tensor, ...], ids: list[int], offset: int) -> Tensor:
    if not ids:  # a target without a drafter (plain decoding): no features
        return hidden_states[offset][..., :0]
    return torch.cat([hidden_states[i + offset] for i in ids], dim=-1)  # (B, S, n * W)


def _per_head(index: Tensor, like: Tensor) -> Tensor:
    """Position indices (B, N) as gather indices (B, H, N, Dh) over a (B, H, S, Dh) cache."""
    return index[:, None, :, None].expand(-1, like.shape[1], -1, like.shape[3])


def special_tokens(
    model: nn.Module,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> tuple[tuple[int, ...], int, int]:
    """(eos ids, pad, bos) of an HF model: explicit > generation_config > config. The eos ids
    are all that end a row (HF ``generate`` stops at any of a list); pad falls back to the
    first of them (as HF's does), bos to pad."""
    gen = getattr(model, "generation_config", None)
    eos = _ids(eos_token_id, gen, model, "eos_token_id")
    if not eos:
        raise ValueError("The model defines no eos_token_id; pass eos_token_id=<int> to HFTarget.")
    pad = _ids(pad_token_id, gen, model, "pad_token_id")
    pad = pad[0] if pad else eos[0]
    bos = _ids(bos_token_id, gen, model, "bos_token_id")
    return eos, pad, bos[0] if bos else pad


def _ids(explicit: Any, gen: Any, model: nn.Module, name: str) -> tuple[int, ...]:
    """A special token's ids (an int or a list): explicit > generation_config > config; ()
    where none defines it."""
    value = explicit
    for source in (gen, getattr(model, "config", None)):
        if value is None and source is not None:
            value = getattr(source, name, None)
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    return tuple(dict.fromkeys(int(v) for v in values if v is not None))


def decoder_blocks(model: Any, n: int) -> torch.nn.ModuleList:
    """The ``n`` decoder blocks of an HF causal LM (``model.model.layers`` in the Llama family,
    ``transformer.h`` in GPT-2): the first module list of that length in its decoder."""
    root = model.get_decoder() if hasattr(model, "get_decoder") else model
    for m in root.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return m
    raise ValueError(f"found no list of {n} decoder blocks in {type(model).__name__}")


def load_hf_causal_lm(path: str | Path, attn: str = "sdpa") -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) of a local HF directory, a ``.gguf`` file or a hub id in
    the HF cache, offline.

    A GGUF file is dequantised to fp32 by transformers (needs the ``gguf`` package).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if is_model_id(str(path)):
        hub.check_model_id(str(path), "model.target", local_files_only=True)
    elif not p.exists():
        raise FileNotFoundError(f"target model {p} does not exist (a local HF dir or .gguf file)")
    kw: dict[str, Any] = {"local_files_only": True}
    where: Path | str = str(path)
    if p.suffix == ".gguf":
        if not extras.installed("gguf"):  # transformers' own error names no package to install
            raise ModuleNotFoundError(f"{p} is a GGUF file: it needs gguf", name="gguf")
        where, kw["gguf_file"] = p.parent, p.name
    elif p.is_dir():
        _check_lm_folder(p)
    try:
        tok = AutoTokenizer.from_pretrained(where, **kw)
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=torch.float32, attn_implementation=attn, **kw
        )
    except (ValueError, OSError, RuntimeError) as e:  # transformers' own: many lines
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: transformers cannot load a causal LM from it ({first})") from e
    return model.eval(), tok


def _check_lm_folder(folder: Path) -> None:
    """A folder the target cannot be: none at all, or a drafter export (--model and --draft
    swapped). A config.json transformers cannot read is the loader's to report."""
    from vltrain.models import dflash_format

    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} holds no config.json: not a transformers model folder")
    if dflash_format.is_speculators(folder) or dflash_format.is_dflash(folder):
        raise ConfigError(
            f"{folder} is a drafter (a speculators or DFlash export): pass it as --draft, "
            "and its target model as --model"
        )
