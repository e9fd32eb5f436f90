"""Shared transformer pieces: pre-norm block, attention masks, KV cache, weight init.

State-dict keys of a block are stable and flat:
``norm1.{weight,bias}``, ``attn.qkv.{weight,bias}``, ``attn.proj.{weight,bias}``,
``norm2.{weight,bias}``, ``mlp.fc1.{weight,bias}``, ``mlp.fc2.{weight,bias}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KV = tuple[Tensor, Tensor]


@dataclass
class KVCache:
    """Keys/values of every block for the positions seen so far, plus which of them are real.

    ``layers[i]`` holds block i's ``(keys, values)``, each ``(B, H, S, Dh)``. ``mask`` is
    ``(B, S)`` bool, True where the cached position is a real (non-padding) token; it lets later
    steps keep ignoring padding and continue positions per row.
    """

    layers: list[KV]
    mask: Tensor  # (B, S) bool

    @property
    def length(self) -> int:
        """Number of cached positions (including padding)."""
        return int(self.mask.shape[1])

    def next_positions(self) -> Tensor:
        """Position index of the next real token of each row, ``(B,)`` long."""
        return self.mask.sum(dim=1)


def reorder_cache(cache: KVCache, index: Tensor) -> KVCache:
    """Select rows of ``cache`` along the batch dim (beam search: reorder, expand or prune).

    ``index`` is a 1-D long tensor of row ids into the current batch; it may repeat rows, so
    ``index = torch.arange(B).repeat_interleave(k)`` expands a batch to k beams per row.
    """
    index = index.to(device=cache.mask.device, dtype=torch.long)
    layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in cache.layers]
    return KVCache(layers=layers, mask=cache.mask.index_select(0, index))


def build_attention_mask(
    key_mask: Tensor | None, q_len: int, causal: bool, past_len: int = 0
) -> tuple[Tensor | None, bool]:
    """Make ``(attn_mask, is_causal)`` arguments for ``F.scaled_dot_product_attention``.

    ``key_mask`` is ``(B, S)`` (nonzero = real token) over all keys, ``S = past_len + q_len``;
    queries are the last ``q_len`` positions. Returns a bool mask ``(B, 1, T, S)`` (True =
    attend) or None when SDPA's own ``is_causal`` (or no mask at all) is exact. Every query may
    attend to its own position, so padding queries never see an all-masked row (which would
    give NaN); real queries are unaffected because their own key is real.
    """
    if key_mask is None:
        if not causal or q_len == 1:
            return None, False
        if past_len == 0:
            return None, True
    s_len = past_len + q_len
    device = key_mask.device if key_mask is not None else None
    q_pos = torch.arange(past_len, s_len, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(s_len, device=device)[None, :]  # (1, S)
    if causal:
        allowed = k_pos <= q_pos  # (T, S)
    else:
        allowed = torch.ones(q_len, s_len, dtype=torch.bool, device=device)
    if key_mask is None:
        return allowed[None, None], False  # (1, 1, T, S)
    if key_mask.shape[1] != s_len:
        raise ValueError(f"key mask covers {key_mask.shape[1]} positions, expected {s_len}")
    allowed = allowed[None, None] & key_mask.bool()[:, None, None, :]  # (B, 1, T, S)
    return allowed | (k_pos == q_pos)[None, None], False


class Attention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if width % heads != 0:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        past_kv: KV | None = None,
    ) -> tuple[Tensor, KV]:
        """Attend ``x`` (B, T, D) to itself (and to ``past_kv``); returns output and new kv."""
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads)  # (B, T, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, Dh)
        if past_kv is not None:
            k = torch.cat([past_kv[0].to(k.dtype), k], dim=2)  # (B, H, S, Dh)
            v = torch.cat([past_kv[1].to(v.dtype), v], dim=2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
        )  # (B, H, T, Dh)
        out = out.transpose(1, 2).reshape(b, t, d)  # (B, T, D)
        return self.proj(out), (k, v)


class MLP(nn.Module):
    """Two-layer GELU feed-forward."""

    def __init__(self, width: int, mlp_ratio: float = 4.0, dropout: float = 0.0) -> None:
        super().__init__()
        hidden = int(width * mlp_ratio)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, T, D) -> (B, T, D)."""
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(
        self, width: int, heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, dropout)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = MLP(width, mlp_ratio, dropout)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        past_kv: KV | None = None,
    ) -> tuple[Tensor, KV]:
        """(B, T, D) -> (B, T, D), plus this block's keys/values over all positions."""
        h, kv = self.attn(self.norm1(x), attn_mask, is_causal, past_kv)
        x = x + self.drop(h)
        x = x + self.mlp(self.norm2(x))
        return x, kv


def make_blocks(
    width: int, layers: int, heads: int, mlp_ratio: float = 4.0, dropout: float = 0.0
) -> nn.ModuleList:
    """A ``ModuleList`` of ``layers`` blocks (keys ``blocks.{i}.…`` when assigned as ``blocks``)."""
    return nn.ModuleList(Block(width, heads, mlp_ratio, dropout) for _ in range(layers))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """Normal(0, std) weights for linear/conv/embedding, zero biases, unit LayerNorm.

    Use as ``model.apply(init_weights)``; parameters owned directly by a model (class token,
    positional embeddings) are initialised by that model.
    """
    if isinstance(module, nn.Linear | nn.Conv2d | nn.Embedding):
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def check_dims(name: str, width: int, heads: int, layers: int, mlp_ratio: float) -> None:
    """Raise a readable ValueError for impossible transformer dimensions."""
    if width <= 0 or heads <= 0 or layers < 0 or mlp_ratio <= 0:
        raise ValueError(
            f"{name}: width, heads, mlp_ratio must be positive and layers >= 0 "
            f"(got width={width}, heads={heads}, layers={layers}, mlp_ratio={mlp_ratio})"
        )
    if width % heads != 0:
        raise ValueError(f"{name}: width {width} must be divisible by heads {heads}")
