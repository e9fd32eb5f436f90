"""A lean inference forward for HF Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3).

Speculative decoding on a CPU lives or dies by the cost of the target's forward, and HF's
module stack spends most of a small model's decode step outside its matrix products
(SmolLM2-135M on a 2-core Xeon: 39.5 ms a token inside ``generate``, 21 ms of it in the
linears). ``NativeLlama`` runs the same weights (the HF module's own tensors, not copies)
through a flat loop: RMSNorm, rotary embedding from the model's own ``rotary_emb`` (so every
RoPE scaling HF implements is honoured), grouped-query SDPA over a pre-allocated KV buffer
written in place, SwiGLU. It is an inference kernel, not a second model definition: weights,
config and RoPE come from the loaded HF model; no training goes through it.

``NativeTarget`` is a ``DecodeTarget`` (``vltrain.inference.target``), so
``vltrain.inference.decoding.generate`` and ``speculative_generate`` drive it exactly as they
drive ``HFTarget``; ``causal_lm_target`` picks the native forward where it covers the model
and ``HFTarget`` elsewhere. Positions follow HF's convention for left-padded prompts
(``cumsum - 1`` of the mask).

Numerics: float32 end to end like HF's eager/sdpa path; logits agree with HF's to ~1e-5
(different kernels, reduction order), the same order as HF's own difference between scoring a
token alone and inside a 17-token verify. Greedy output is checked token for token against HF
``generate`` in the tests and the drafter bench.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vltrain.inference.hf_target import HFTarget, special_tokens
from vltrain.inference.target import Context, StopIds
from vltrain.models.layers import kept_prefix, move_kept, tree_depths, tree_mask
from vltrain.models.packed import PackedLinears
from vltrain.models.text import mask_positions

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
PACK_BYTES = 2 * 2**30  # NativeTarget packs a verify's weights by default up to this size


@dataclass
class NativeCache:
    """Keys/values of every layer in buffers with spare room, and which positions are real.

    ``keys[i]`` / ``values[i]`` are (B, Hkv, capacity, Dh); positions ``[0, length)`` are
    filled. ``mask`` (B, length) is True at real (non-padding) positions.
    """

    keys: list[Tensor]
    values: list[Tensor]
    mask: Tensor  # (B, length) bool

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def next_positions(self) -> Tensor:
        """Position of each row's next real token (B,): HF's ``cumsum - 1`` continued."""
        return self.mask.sum(dim=1)

    def reserve(self, extra: int) -> None:
        """Grow the buffers (doubling) so that ``extra`` more positions fit."""
        need, cap = self.length + extra, self.keys[0].shape[2]
        if need <= cap:
            return
        cap = max(need, 2 * cap)
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                grown = t.new_empty((*t.shape[:2], cap, t.shape[3]))
                grown[:, :, : self.length] = t[:, :, : self.length]
                store[i] = grown


@dataclass
class _Layer:
    """One decoder layer's tensors: the HF module's, q/k/v and gate/up fused (see ``_fuse``)."""

    norm1: Tensor
    qkv: Tensor  # (H * Dh + 2 * Hkv * Dh, W)
    qkv_bias: Tensor | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    norm2: Tensor
    gate_up: Tensor  # (2 * I, W)
    down: Tensor


def _param(module: Any, name: str) -> Tensor | None:
    sub = getattr(module, name, None)
    return None if sub is None else sub.detach()


@torch.no_grad()
def _fuse(owner: Any, name: str, params: list[Any]) -> Tensor | None:
    """One tensor holding ``params`` stacked along dim 0; each parameter becomes a view of it.

    A fused product costs one GEMM call instead of two or three (each output column is the
    same dot product, bit for bit), and the HF module keeps working on the same memory, so
    the fusion adds no copy of the weights. The fused tensor is kept on ``owner`` as ``name``:
    a second native forward over the same model reuses it instead of fusing again.
    """
    if any(p is None for p in params):
        if not all(p is None for p in params):
            raise ValueError("q/k/v projections must all have a bias or none")
        return None
    fused = getattr(owner, name, None)
    if fused is not None and _views_of(fused, params):
        return fused
    fused = torch.cat([p.detach() for p in params])
    lo = 0
    for p in params:
        p.data = fused[lo : lo + p.shape[0]]
        lo += p.shape[0]
    object.__setattr__(owner, name, fused)  # a plain attribute: not in the state dict
    return fused


def _views_of(fused: Tensor, params: list[Any]) -> bool:
    """Whether ``params`` are still consecutive row blocks of ``fused``, in order."""
    step = fused.stride(0) * fused.element_size()
    at = fused.data_ptr()
    for p in params:
        if p.dtype != fused.dtype or p.device != fused.device or p.data_ptr() != at:
            return False
        at += p.shape[0] * step
    return True


def unsupported(cfg: Any) -> str:
    """Why the native forward cannot run a model of this (text) config; "" when it can."""
    kind = getattr(cfg, "model_type", "")
    if kind not in SUPPORTED:
        return (
            f"the native forward covers model types {SUPPORTED}, not {kind!r}; "
            "run it through HF's modules (--forward hf)"
        )
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "mlp_bias", False):
        return "the native forward needs a SwiGLU MLP (hidden_act silu, no MLP bias)"
    types = getattr(cfg, "layer_types", None)
    if types:  # HF decides by layer_types where the config has them (Qwen2, Qwen3)
        other = sorted(set(types) - {"full_attention"})
        if other:
            return f"the native forward has full attention only; this model has {other} layers"
        return ""
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True):
        return f"the native forward has full attention only; this model has sliding_window={window}"
    return ""


class NativeLlama:
    """The forward of an HF ``LlamaForCausalLM``-shaped model over a ``NativeCache``."""

    def __init__(self, model: Any) -> None:
        cfg = model.config.get_text_config(decoder=True)
        reason = unsupported(cfg)
        if reason:
            raise ValueError(reason)
        base = model.model
        self.rotary = base.rotary_emb
        self.embed = base.embed_tokens.weight.detach()
        self.final_norm = base.norm.weight.detach()
        self.eps = float(cfg.rms_norm_eps)
        head = model.get_output_embeddings()
        self.head_weight = head.weight.detach()
        self.head_bias = _param(head, "bias")
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = self.head_dim**-0.5
        self._watch: list[Tensor] = []  # the HF parameters this forward reads (see stale())
        self.layers = [self._layer(block) for block in base.layers]
        self._watch += [base.embed_tokens.weight, base.norm.weight, head.weight]
        self._seen = [(p.data_ptr(), p._version) for p in self._watch]
        self.packed = PackedLinears(keep=2)  # verify row counts (vltrain.models.packed)
        self._pack_now = False

    def _layer(self, block: Any) -> _Layer:
        a, m = block.self_attn, block.mlp
        projections = (a.q_proj, a.k_proj, a.v_proj)
        self._watch += [
            p
            for mod in (*projections, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            for p in mod.parameters()
        ]
        return _Layer(
            norm1=block.input_layernorm.weight.detach(),
            qkv=_fuse(a, "_vltrain_qkv", [p.weight for p in projections]),
            qkv_bias=_fuse(a, "_vltrain_qkv_bias", [getattr(p, "bias", None) for p in projections]),
            q_norm=None if getattr(a, "q_norm", None) is None else a.q_norm.weight.detach(),
            k_norm=None if getattr(a, "k_norm", None) is None else a.k_norm.weight.detach(),
            o=a.o_proj.weight.detach(),
            o_bias=_param(a.o_proj, "bias"),  # Llama with attention_bias; Qwen2 has none
            norm2=block.post_attention_layernorm.weight.detach(),
            gate_up=_fuse(m, "_vltrain_gate_up", [m.gate_proj.weight, m.up_proj.weight]),
            down=m.down_proj.weight.detach(),
        )

    def stale(self) -> bool:
        """Whether the HF model's weights changed since this forward was built: updated in place
        (``load_state_dict``, an optimizer step), moved (``.to``) or fused again by another
        ``NativeLlama``. Packed copies and fused tensors would then be out of date."""
        now = [(p.data_ptr(), p._version) for p in self._watch]
        return now != self._seen

    def new_cache(self, batch: int, capacity: int) -> NativeCache:
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        n = len(self.layers)
        return NativeCache(
            [self.embed.new_empty(shape) for _ in range(n)],
            [self.embed.new_empty(shape) for _ in range(n)],
            torch.zeros(batch, 0, dtype=torch.bool, device=self.embed.device),
        )

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        # HF's RMSNorm, op for op: x * rsqrt(mean(x^2) + eps) in float32, then the weight
        y = x.float()  # a no-op for float32 weights
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * y.to(x.dtype)

    @torch.no_grad()
    def forward(
        self,
        ids: Tensor,
        positions: Tensor,
        cache: NativeCache,
        attn: Tensor | None = None,
        real: Tensor | None = None,
        taps: tuple[int, ...] = (),
        packed: bool = False,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Feed ids (B, M) at positions (B, M) after the cache; the cache takes them in place.

        ``attn`` is a bool (B or 1, 1, M, length + M) mask, True = attend. None means: one new
        token that sees the whole cache, or a prompt into an empty cache, causal (either way
        without padding). ``real`` (B, M) bool marks the new positions that are real tokens
        (default all). Returns the final-normed hidden states (B, M, W) and ``taps``: layer
        i's output (before the final norm) for each i asked for, as ``HFTarget`` reads them.
        ``packed`` runs the linears on MKL-packed weights for this row count
        (``vltrain.models.packed``): worth it for a count that recurs, as a verify's does.
        """
        b, m = ids.shape
        self._pack_now = packed
        if attn is None and m > 1 and cache.length > 0:
            raise ValueError("several tokens after a cache need an explicit attention mask")
        cache.reserve(m)
        causal = attn is None and m > 1
        x = F.embedding(ids, self.embed)  # (B, M, W)
        cos, sin = self.rotary(x, positions)  # (B, M, Dh) each
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, M, Dh)
        wanted, out = set(taps), {}
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer.norm1)
            x = x + self._attention(layer, h, (cos, sin), cache, i, attn, causal)
            h = self._norm(x, layer.norm2)
            gate, up = self._lin(h, layer.gate_up).chunk(2, dim=-1)
            x = x + self._lin(F.silu(gate) * up, layer.down)
            if i in wanted:
                out[i] = x
        if real is None:
            real = torch.ones(b, m, dtype=torch.bool, device=ids.device)
        cache.mask = torch.cat([cache.mask, real.bool()], dim=1)
        return self._norm(x, self.final_norm), out

    def _attention(
        self,
        layer: _Layer,
        h: Tensor,
        rope: tuple[Tensor, Tensor],
        cache: NativeCache,
        i: int,
        attn: Tensor | None,
        causal: bool,
    ) -> Tensor:
        b, m, _ = h.shape
        cos, sin = rope
        nq, nk = self.heads, self.kv_heads
        qkv = self._lin(h, layer.qkv, layer.qkv_bias).view(b, m, nq + 2 * nk, self.head_dim)
        qk, v = qkv[:, :, : nq + nk], qkv[:, :, nq + nk :]
        if layer.q_norm is not None:  # Qwen3: RMSNorm per head before the rotation
            q, k = self._norm(qk[:, :, :nq], layer.q_norm), self._norm(qk[:, :, nq:], layer.k_norm)
            qk = torch.cat([q, k], dim=2)
        qk = qk.transpose(1, 2)  # (B, H + Hkv, M, Dh): q and k rotated together
        qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk[:, :nq], qk[:, nq:]
        past, end = cache.length, cache.length + m
        cache.keys[i][:, :, past:end] = k
        cache.values[i][:, :, past:end] = v.transpose(1, 2)
        keys, values = cache.keys[i][:, :, :end], cache.values[i][:, :, :end]
        gqa = self.heads != self.kv_heads
        o = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=attn, is_causal=causal, scale=self.scale, enable_gqa=gqa
        )  # (B, H, M, Dh)
        return self._lin(o.transpose(1, 2).reshape(b, m, -1), layer.o, layer.o_bias)

    def logits(self, hidden: Tensor, packed: bool = False) -> Tensor:
        """LM head; ``packed``: through MKL-packed weights (a recurring row count)."""
        if packed:
            return self.packed.linear(hidden, self.head_weight, self.head_bias)
        return F.linear(hidden, self.head_weight, self.head_bias)

    def _lin(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if self._pack_now:
            return self.packed.linear(x, weight, bias)
        return F.linear(x, weight, bias)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class NativeTarget(StopIds):
    """An HF Llama-family causal LM through ``NativeLlama``: a ``DecodeTarget``.

    It replaces ``HFTarget`` in ``speculative_generate`` and in plain greedy / sampled / beam
    ``generate`` alike, with the same forward. ``layer_ids``: the blocks a drafter reads.
    """

    def __init__(
        self,
        model: Any,
        layer_ids: Sequence[int] = (),
        pack: bool | None = None,
        **token_ids: Any,
    ) -> None:
        self.native = NativeLlama(model)
        if pack is None:  # each packed row count copies the weights: small targets only
            pack = sum(p.numel() * p.element_size() for p in model.parameters()) <= PACK_BYTES
        self.pack = pack  # verify through MKL-packed weights (vltrain.models.packed)
        eos, pad, bos = special_tokens(model, **token_ids)  # resolved as HFTarget does
        self.eos_token_ids, self.pad_token_id, self.bos_token_id = eos, pad, bos
        text = model.config.get_text_config(decoder=True)
        self.num_layers, self.width = text.num_hidden_layers, text.hidden_size
        self.vocab_size = self.native.head_weight.shape[0]
        self.layer_ids = list(layer_ids)

    def release(self) -> None:
        """Drop the packed weight copies (one copy of the weights per verify row count):
        for a target that stays in memory between decodings, as a training run's eval does."""
        self.native.packed.clear()

    def embed(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.native.embed)

    def head(self, hidden: Tensor) -> Tensor:
        return self.native.logits(hidden, self.pack)  # a full-vocabulary drafter's rows recur

    def head_params(self) -> tuple[Tensor, Tensor | None]:
        return self.native.head_weight, self.native.head_bias

    def _features(self, taps: dict[int, Tensor], hidden: Tensor) -> Tensor:
        """The drafter's context features (B, S, n * W); (B, S, 0) without a drafter."""
        if not self.layer_ids:
            return hidden[..., :0]
        return torch.cat([taps[i] for i in self.layer_ids], dim=-1)

    def prefill(
        self, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, NativeCache, Context]:
        """Left-padded prompts (B, T): next-token logits (B, V), the cache, the prompt context."""
        if self.native.stale():
            raise RuntimeError(
                "the HF model's weights changed after its NativeTarget was built (updated in "
                "place, moved or fused again): build a new NativeTarget"
            )
        mask = torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is not None:
            mask = attention_mask.bool()
        b, t = input_ids.shape
        cache = self.native.new_cache(b, t + 128)
        pos = mask_positions(mask)  # (B, T): HF's cumsum - 1 over real tokens
        attn = None
        if not bool(mask.all()):
            attn = tree_mask(torch.arange(-1, t - 1, device=mask.device), 0, key_mask=mask)
        hidden, taps = self.native.forward(input_ids, pos, cache, attn, mask, tuple(self.layer_ids))
        logits = self.native.logits(hidden[:, -1]).float()
        feats = self._features(taps, hidden)
        return logits, cache, Context(feats, pos, mask)

    def step(self, tokens: Tensor, cache: NativeCache) -> tuple[Tensor, NativeCache]:
        """One token per row (B,) -> next-token logits (B, V) float32."""
        pos = cache.next_positions()[:, None]  # (B, 1)
        attn = None
        if not bool(cache.mask.all()):
            seen = torch.cat([cache.mask, cache.mask.new_ones(cache.mask.shape[0], 1)], 1)
            attn = seen[:, None, None, :]  # (B, 1, 1, S + 1)
        hidden, _ = self.native.forward(tokens[:, None], pos, cache, attn)
        return self.native.logits(hidden[:, -1]).float(), cache

    def verify(
        self, tokens: Tensor, parents: Tensor, cache: NativeCache, logits: bool = True
    ) -> tuple[Tensor, NativeCache, Context]:
        """Tree nodes (B, N) with parents (B, N) after the cache, in one forward: logits
        (B, N, V), or the final hidden states (B, N, W) with ``logits=False``."""
        pos = cache.next_positions()[:, None] + tree_depths(parents)  # (B, N)
        attn = tree_mask(parents, cache.length, key_mask=cache.mask)
        taps = tuple(self.layer_ids)
        hidden, taps = self.native.forward(tokens, pos, cache, attn, None, taps, self.pack)
        scores = self.native.logits(hidden, self.pack).float() if logits else hidden
        ones = torch.ones_like(tokens, dtype=torch.bool)
        feats = self._features(taps, hidden)
        return scores, cache, Context(feats, pos, ones)

    def select(self, cache: NativeCache, index: Tensor, valid: Tensor | None = None) -> NativeCache:
        """Keep cached positions ``index`` (B, N) per row, in place; ``valid`` False = padding.

        Positions that stay where they are (the old cache of a speculative round) are not
        copied: only the entries after the longest kept prefix move.
        """
        b, n = cache.mask.shape[0], index.shape[1]
        index = index.to(device=cache.mask.device, dtype=torch.long).expand(b, -1)
        if n > cache.length or (index.numel() and int(index.max()) >= cache.length):
            raise ValueError(f"select: positions must lie in [0, {cache.length})")
        p = kept_prefix(index)
        for t in (*cache.keys, *cache.values):
            move_kept(t, index, p)
        mask = cache.mask.gather(1, index)
        if valid is not None:
            mask = mask & valid.to(mask.device).bool().expand_as(mask)
        cache.mask = mask
        return cache

    def crop(self, cache: NativeCache, n: int) -> NativeCache:
        """Keep the first ``n`` cached positions (in place: the buffers keep their room)."""
        if not 0 <= n <= cache.length:
            raise ValueError(f"crop({n}): keep between 0 and {cache.length} cached positions")
        cache.mask = cache.mask[:, :n]
        return cache

    def reorder(self, cache: NativeCache, rows: Tensor) -> NativeCache:
        """Rows selected along the batch dim (beam search): row i <- row rows[i]."""
        keys = [k.index_select(0, rows) for k in cache.keys]
        values = [v.index_select(0, rows) for v in cache.values]
        return NativeCache(keys, values, cache.mask.index_select(0, rows))

    def next_positions(self, cache: NativeCache) -> Tensor:
        return cache.next_positions()


def causal_lm_target(
    model: Any, layer_ids: Sequence[int], forward: str, pad: int
) -> HFTarget | NativeTarget:
    """An HF causal LM as a ``DecodeTarget``, for plain and speculative decoding alike.

    ``forward``: "native" (``NativeTarget``: vltrain's loop over the HF weights, the same
    logits with less overhead), "hf" (``HFTarget``: the HF modules) or "auto" (native where
    the model has it: Llama, Mistral, Qwen2, Qwen3 with full attention; the others, and a
    sliding window, run on HF's modules).
    """
    from vltrain.config.core import ConfigError

    if forward not in ("auto", "native", "hf"):
        raise ConfigError(f"--forward must be auto, native or hf, not {forward!r}")
    reason = unsupported(model.config.get_text_config(decoder=True))
    if forward == "native" and reason:
        raise ConfigError(f"--forward native: {reason}")
    if forward == "hf" or reason:  # auto: HF's modules where the native forward cannot go
        return HFTarget(model, layer_ids, pad_token_id=pad)
    return NativeTarget(model, layer_ids, pad_token_id=pad)
