"""Text towers: a bidirectional encoder (for dual encoders) and a causal LM decoder.

Positions are derived from the attention mask (``cumsum(mask) - 1``), so a left-padded row gets
the same positions, and the same outputs at its real tokens, as the unpadded sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.models.layers import (
    KVCache,
    build_attention_mask,
    check_dims,
    init_weights,
    make_blocks,
)


@dataclass
class TextTowerConfig:
    """Dimensions of a text transformer (encoder or decoder)."""

    vocab_size: int
    """Number of token ids (the tokenizer's vocab_size)."""
    context_length: int
    """Maximum number of positions (for the decoder: prefix tokens + text tokens)."""
    width: int
    """Hidden size of every token."""
    layers: int
    """Number of transformer blocks."""
    heads: int
    """Attention heads; must divide width."""
    mlp_ratio: float = 4.0
    """MLP hidden size as a multiple of width."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches."""
    causal: bool = False
    """Encoder: each token attends only to itself and earlier tokens (CLIP's text transformer),
    so the pooled last token depends on word order by construction; the decoder is always
    causal."""
    pool: str = "last"
    """Encoder: what ``pooled`` returns. ``last``: the hidden state at the last real token
    (CLIP's end-of-text token). ``mean``: the mean over the real tokens, so every token's own
    state reaches the embedding; with ``causal`` each token has seen only the words before it,
    which is what lets a one-block encoder bind "A left of B" to its objects (a token of B has
    seen the relation word, A's have not; bench/RESULTS.md, "Quickstart CLIP recipe, round
    4")."""
    rel_pos: int = 0
    """Encoder: a learned attention bias per head for each signed token distance, clipped to
    +-rel_pos (T5's relative positions, without its log buckets), on top of the absolute
    position embeddings. A head can then attend to "the relation word after me" and "the one
    before me" differently, so both objects of "A left of B" can learn their role in one
    block. 0: off."""

    def __post_init__(self) -> None:
        check_dims("TextTowerConfig", self.width, self.heads, self.layers, self.mlp_ratio)
        if self.pool not in ("last", "mean"):
            raise ValueError(f"TextTowerConfig: pool must be 'last' or 'mean', got {self.pool!r}")
        if self.rel_pos < 0:
            raise ValueError(f"TextTowerConfig: rel_pos must be >= 0, got {self.rel_pos}")
        if self.vocab_size <= 0 or self.context_length <= 0:
            raise ValueError(
                f"TextTowerConfig: vocab_size ({self.vocab_size}) and context_length "
                f"({self.context_length}) must be positive"
            )


LayerHook = Callable[[int, Tensor], Tensor]
"""``hook(i, x) -> x``: runs before decoder block i on its input (B, T, W) (cross-attention)."""


@dataclass
class DecoderOutput:
    """What one run of the decoder loop returns."""

    hidden: Tensor
    """Final-LN hidden states (B, P + T, W) of the new positions."""
    cache: KVCache | None
    """The cache extended by the new positions (None unless ``use_cache``)."""
    taps: dict[int, Tensor] = field(default_factory=dict)
    """Requested block index -> that block's output (B, P + T, W), before the final LN."""


def mask_positions(mask: Tensor, offset: Tensor | None = None) -> Tensor:
    """Position ids (B, T) from a (B, T) 0/1 mask: real tokens count up from ``offset`` (B,)."""
    pos = mask.long().cumsum(dim=1) - 1  # (B, T)
    if offset is not None:
        pos = pos + offset[:, None]
    return pos.clamp(min=0)


class _TextBase(nn.Module):
    """Token + position embeddings, blocks and final LayerNorm, shared by both towers."""

    def __init__(self, cfg: TextTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.width = cfg.width
        self.token_embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos_embed = nn.Parameter(torch.zeros(cfg.context_length, cfg.width))
        self.blocks = make_blocks(cfg.width, cfg.layers, cfg.heads, cfg.mlp_ratio, cfg.dropout)
        self.norm = nn.LayerNorm(cfg.width)

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, zero biases, unit LayerNorms."""
        self.apply(init_weights)
        nn.init.normal_(self.pos_embed, std=0.02)

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The token embedding module: ``embed_tokens(input_ids) -> (B, T, W)``."""
        return self.token_embed

    def _check_length(self, n: int) -> None:
        if n > self.cfg.context_length:
            raise ValueError(
                f"sequence of {n} positions exceeds context_length {self.cfg.context_length}; "
                "truncate the input (tokenizer max_len) or build the model with a larger "
                "context_length"
            )


class TextTower(_TextBase):
    """Bidirectional text encoder: ``forward(input_ids, attention_mask) -> (B, T, W)``."""

    def __init__(self, cfg: TextTowerConfig) -> None:
        super().__init__(cfg)
        # (2 * rel_pos + 1, heads): bias of distance j - i, clipped; zero at init
        self.rel_bias = (
            nn.Parameter(torch.zeros(2 * cfg.rel_pos + 1, cfg.heads)) if cfg.rel_pos else None
        )
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Hidden states (B, T, W); padding (mask 0) is never attended to by real tokens."""
        b, t = input_ids.shape
        self._check_length(t)
        if attention_mask is None:
            pos = torch.arange(t, device=input_ids.device).expand(b, t)  # (B, T)
        else:
            pos = mask_positions(attention_mask)  # (B, T)
        x = self.token_embed(input_ids) + F.embedding(pos, self.pos_embed)  # (B, T, W)
        attn_mask, is_causal = build_attention_mask(attention_mask, t, causal=self.cfg.causal)
        if self.rel_bias is not None:
            attn_mask, is_causal = self._with_rel_bias(pos, attn_mask, is_causal), False
        for block in self.blocks:
            x, _ = block(x, attn_mask, is_causal)
        return self.norm(x)

    def no_weight_decay(self) -> list[str]:
        """The relative-position bias is a table of logit offsets, like a bias: no decay."""
        return ["rel_bias"] if self.rel_bias is not None else []

    def _with_rel_bias(self, pos: Tensor, allowed: Tensor | None, is_causal: bool) -> Tensor:
        """Additive mask (B, H, T, T): the relative-position bias where attending is allowed,
        -inf elsewhere. Distances come from the mask positions, so padding does not shift them."""
        assert self.rel_bias is not None
        n = self.cfg.rel_pos
        dist = (pos[:, None, :] - pos[:, :, None]).clamp(-n, n) + n  # (B, T, S): key - query
        bias = self.rel_bias[dist].permute(0, 3, 1, 2)  # (B, H, T, S)
        if allowed is None:
            t = pos.shape[1]
            allowed = torch.ones(t, t, dtype=torch.bool, device=pos.device)
            allowed = allowed.tril() if is_causal else allowed
        return bias.masked_fill(~allowed, float("-inf"))

    def pooled(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """One vector per row (B, W): the last real token's hidden state (``pool: last``) or
        the mean over the real tokens (``pool: mean``); left or right padding."""
        h = self.forward(input_ids, attention_mask)  # (B, T, W)
        if self.cfg.pool == "mean":
            if attention_mask is None:
                return h.mean(dim=1)
            m = attention_mask.to(h.dtype)[..., None]  # (B, T, 1)
            return (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        if attention_mask is None:
            return h[:, -1]
        t = input_ids.shape[1]
        idx = (attention_mask.bool() * torch.arange(1, t + 1, device=h.device)).argmax(dim=1)
        return h[torch.arange(h.shape[0], device=h.device), idx]  # (B, W)


class CausalDecoder(_TextBase):
    """GPT-style causal LM with optional prefix embeddings (visual tokens) and a KV cache.

    With ``tie_weights`` the output projection reuses ``token_embed.weight`` (no ``lm_head``
    key in the state dict, so checkpoints hold no shared tensors).
    """

    def __init__(self, cfg: TextTowerConfig, tie_weights: bool = True) -> None:
        super().__init__(cfg)
        self.tie_weights = tie_weights
        self.lm_head = None if tie_weights else nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def logits(self, hidden: Tensor) -> Tensor:
        """Project hidden states (B, T, W) to vocabulary logits (B, T, V)."""
        if self.lm_head is None:
            return F.linear(hidden, self.token_embed.weight)
        return self.lm_head(hidden)

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        prefix_embeds: Tensor | None = None,
        kv_cache: KVCache | None = None,
        use_cache: bool = False,
    ) -> tuple[Tensor, KVCache | None]:
        """Final-LN hidden states (B, P + T, W) for ``[prefix_embeds, tokens]`` and the cache."""
        out = self.run(input_ids, attention_mask, prefix_embeds, kv_cache, use_cache)
        return out.hidden, out.cache

    def run(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        prefix_embeds: Tensor | None = None,
        kv_cache: KVCache | None = None,
        use_cache: bool = False,
        *,
        position_ids: Tensor | None = None,
        attn_mask: Tensor | None = None,
        layer_hook: LayerHook | None = None,
        taps: Sequence[int] = (),
    ) -> DecoderOutput:
        """The decoder loop: embed, then ``[layer_hook(i, x)], block i`` for every block, LN.

        ``attention_mask`` (B, T) marks real tokens of ``input_ids`` (prefix tokens are always
        real); it is what the returned cache records. ``position_ids`` (B, P + T) override the
        positions derived from the masks (``cumsum - 1`` continuing the cache). ``attn_mask``
        (B or 1, 1 or H, P + T, S), S = cache length + P + T, bool (True = attend) or additive
        float, replaces the causal + padding mask (see the mask builders in ``layers``).
        ``taps`` are block indices whose outputs (B, P + T, W), before the final LN and any
        later hook, are returned in ``DecoderOutput.taps``.
        """
        x, new_mask, masked = self._embed(input_ids, attention_mask, prefix_embeds)
        past_len = 0 if kv_cache is None else kv_cache.length
        if position_ids is None:
            self._check_length(past_len + x.shape[1])
            offset = None if kv_cache is None else kv_cache.next_positions()
            position_ids = mask_positions(new_mask, offset)  # (B, P + T)
        else:
            position_ids = self._check_positions(position_ids, x.shape[:2])
        x = x + F.embedding(position_ids, self.pos_embed).to(x.dtype)
        full_mask = new_mask if kv_cache is None else torch.cat([kv_cache.mask, new_mask], 1)
        if attn_mask is None:
            # Without a mask or a cache SDPA's is_causal is exact (and takes the fast kernels).
            key_mask = None if (kv_cache is None and not masked) else full_mask
            mask, is_causal = build_attention_mask(key_mask, x.shape[1], True, past_len)
        else:
            mask, is_causal = self._check_attn_mask(attn_mask, x.shape[:2], past_len), False
        wanted = self._tap_indices(taps)
        tapped: dict[int, Tensor] = {}
        new_layers = []
        for i, block in enumerate(self.blocks):
            if layer_hook is not None:
                x = layer_hook(i, x)
            past = None if kv_cache is None else kv_cache.layers[i]
            x, kv = block(x, mask, is_causal, past)
            new_layers.append(kv)
            if i in wanted:
                tapped[i] = x
        cache = KVCache(layers=new_layers, mask=full_mask) if use_cache else None
        return DecoderOutput(self.norm(x), cache, {t: tapped[wanted[t]] for t in taps})

    def _embed(
        self, input_ids: Tensor, attention_mask: Tensor | None, prefix_embeds: Tensor | None
    ) -> tuple[Tensor, Tensor, bool]:
        """Token (+ prefix) embeddings (B, P + T, W), their real mask (B, P + T), mask given."""
        b, t = input_ids.shape
        x = self.token_embed(input_ids)  # (B, T, W)
        masked = attention_mask is not None
        if attention_mask is None:
            attention_mask = torch.ones(b, t, dtype=torch.bool, device=x.device)
        new_mask = attention_mask.bool()  # (B, T)
        if prefix_embeds is not None:
            if prefix_embeds.shape[0] != b or prefix_embeds.shape[2] != self.width:
                raise ValueError(
                    f"prefix_embeds must be (B={b}, P, W={self.width}), "
                    f"got {tuple(prefix_embeds.shape)}"
                )
            x = torch.cat([prefix_embeds.to(x.dtype), x], dim=1)  # (B, P + T, W)
            prefix_mask = torch.ones(prefix_embeds.shape[:2], dtype=torch.bool, device=x.device)
            new_mask = torch.cat([prefix_mask, new_mask], dim=1)  # (B, P + T)
        return x, new_mask, masked

    def _check_positions(self, position_ids: Tensor, shape: torch.Size) -> Tensor:
        if tuple(position_ids.shape) != tuple(shape):
            raise ValueError(
                f"position_ids must be (B, P + T) = {tuple(shape)}, got {tuple(position_ids.shape)}"
            )
        if position_ids.numel() and not 0 <= int(position_ids.min()) <= int(position_ids.max()) < (
            self.cfg.context_length
        ):
            raise ValueError(
                f"position_ids must lie in [0, context_length={self.cfg.context_length}), got "
                f"[{int(position_ids.min())}, {int(position_ids.max())}]"
            )
        return position_ids.long()

    @staticmethod
    def _check_attn_mask(attn_mask: Tensor, shape: torch.Size, past_len: int) -> Tensor:
        b, t = shape
        s_len = past_len + t
        ok = (
            attn_mask.ndim == 4
            and attn_mask.shape[0] in (1, b)
            and attn_mask.shape[2:]
            == (
                t,
                s_len,
            )
        )
        if not ok:
            raise ValueError(
                f"attn_mask must be (B={b} or 1, 1 or H, T={t}, S={s_len}) over cached + new "
                f"positions, got {tuple(attn_mask.shape)}"
            )
        return attn_mask

    def _tap_indices(self, taps: Sequence[int]) -> dict[int, int]:
        """Requested tap -> block index (negative taps count from the last block)."""
        n = len(self.blocks)
        bad = [t for t in taps if not -n <= t < n]
        if bad:
            raise ValueError(f"taps {bad} are not block indices of a {n}-block decoder")
        return {t: t % n for t in taps}

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        prefix_embeds: Tensor | None = None,
        kv_cache: KVCache | None = None,
        use_cache: bool = False,
    ) -> Tensor | tuple[Tensor, KVCache]:
        """Logits (B, P + T, V); with ``use_cache`` also the updated cache.

        ``attention_mask`` (B, T) covers ``input_ids`` only (prefix tokens are always real);
        earlier positions' masks live in ``kv_cache``. Positions continue per row from the
        cache, so incremental decoding equals a full forward at every real position.
        """
        h, cache = self.hidden_states(input_ids, attention_mask, prefix_embeds, kv_cache, use_cache)
        logits = self.logits(h)  # (B, P + T, V)
        if use_cache:
            return logits, cache
        return logits
