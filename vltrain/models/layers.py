"""Shared transformer pieces: pre-norm block, attention masks, KV cache, weight init.

Masks are boolean ``(B or 1, 1, T, S)`` tensors, True = attend, over ``S = past + T`` keys
(the cached positions, then the T new ones): ``causal_mask``, ``padding_mask``,
``block_causal_mask`` (blocks of new positions see everything before their anchor and their
whole block) and ``tree_mask`` (each node sees the prefix, its ancestors and itself). Combine
them with ``&``; ``additive_mask`` turns one into the 0 / -inf float form.

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

    def crop(self, n: int) -> KVCache:
        """A cache of the first ``n`` positions (roll back rejected draft tokens).

        Returns a new cache of views; ``self`` is unchanged and later steps never write into it.
        """
        if not 0 <= n <= self.length:
            raise ValueError(f"crop({n}): keep between 0 and {self.length} cached positions")
        layers = [(k[:, :, :n], v[:, :, :n]) for k, v in self.layers]
        return KVCache(layers=layers, mask=self.mask[:, :n])

    def select(self, index: Tensor, valid: Tensor | None = None) -> KVCache:
        """Keep chosen positions per row, in the order given (compact a tree to its accepted path).

        ``index`` is ``(B, N)`` (or ``(N,)`` for every row) long positions into the cache.
        ``valid`` (same shape, bool) marks entries that are real: rows with a shorter path pad
        their index with any position and set ``valid`` False there; padding entries are never
        attended to and do not count in ``next_positions``.
        """
        b = self.mask.shape[0]
        index = index.to(device=self.mask.device, dtype=torch.long)
        if index.ndim == 1:
            index = index.expand(b, -1)
        if index.ndim != 2 or index.shape[0] != b:
            raise ValueError(f"select: index must be (N,) or (B={b}, N), got {tuple(index.shape)}")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.length):
            raise ValueError(f"select: positions must lie in [0, {self.length})")
        mask = self.mask.gather(1, index)  # (B, N)
        if valid is not None:
            mask = mask & valid.to(device=mask.device, dtype=torch.bool).expand_as(mask)
        layers = []
        for k, v in self.layers:
            idx = index[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])  # (B, H, N, Dh)
            layers.append((k.gather(2, idx), v.gather(2, idx)))
        return KVCache(layers=layers, mask=mask)

    def reorder(self, index: Tensor) -> KVCache:
        """Rows selected along the batch dim (beam search); same as ``reorder_cache``."""
        return reorder_cache(self, index)


def kept_prefix(index: Tensor) -> int:
    """How many leading entries of ``index`` (B, N) equal their own column in every row: the
    cached positions a compaction to ``index`` leaves where they are."""
    n = index.shape[1]
    same = (index == torch.arange(n, device=index.device)).all(0)  # (N,)
    return int(same.long().cumprod(0).sum())


def move_kept(t: Tensor, index: Tensor, start: int) -> None:
    """Write positions ``index[:, start:]`` (B, N - start) of ``t`` (B, H, S, Dh) to
    ``t[:, :, start:N]`` in place (the entries before ``start`` are already in place)."""
    n = index.shape[1]
    if n > start:
        tail = index[:, start:]
        idx = tail[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])  # (B, H, N - p, Dh)
        t[:, :, start:n] = t.gather(2, idx)


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


def _key_mask_and_diag(allowed: Tensor, key_mask: Tensor | None, past_len: int) -> Tensor:
    """``allowed`` (B or 1, T, S) & real keys, with every query's own key kept -> 4D.

    ``key_mask`` is (B, S), or (B, past_len) for the cache alone (the new positions are real).
    """
    t, s_len = allowed.shape[-2:]
    if key_mask is not None:
        if key_mask.shape[-1] == past_len != s_len:
            new = torch.ones(key_mask.shape[0], t, dtype=torch.bool, device=key_mask.device)
            key_mask = torch.cat([key_mask.bool(), new], dim=1)  # (B, S)
        if key_mask.shape[-1] != s_len:
            raise ValueError(
                f"key mask covers {key_mask.shape[-1]} positions, expected {s_len} (cache + new) "
                f"or {past_len} (cache)"
            )
        allowed = allowed & key_mask.to(device=allowed.device).bool()[:, None, :]  # (B, T, S)
        own = torch.arange(t, device=allowed.device)
        diag = torch.zeros(t, s_len, dtype=torch.bool, device=allowed.device)
        diag[own, past_len + own] = True  # a padding query never sees an all-masked row (NaN)
        allowed = allowed | diag
    return allowed[:, None]  # (B or 1, 1, T, S)


def causal_mask(
    q_len: int,
    past_len: int = 0,
    key_mask: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Causal bool mask (B or 1, 1, T, S), S = past_len + T: query t sees keys <= past_len + t.

    ``key_mask`` (B, S) or (B, past_len) (nonzero = real) also hides padding keys, as
    ``build_attention_mask`` does (every query keeps its own key).
    """
    device = key_mask.device if key_mask is not None else device
    q_pos = torch.arange(past_len, past_len + q_len, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(past_len + q_len, device=device)[None, :]  # (1, S)
    return _key_mask_and_diag((k_pos <= q_pos)[None], key_mask, past_len)


def padding_mask(key_mask: Tensor, q_len: int = 1) -> Tensor:
    """(B, S) real-token mask -> bool (B, 1, q_len, S): every query sees every real key."""
    return key_mask.bool()[:, None, None, :].expand(-1, 1, q_len, -1)


def block_causal_mask(
    q_len: int,
    block_size: int,
    past_len: int = 0,
    key_mask: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Block-bidirectional bool mask (B or 1, 1, T, S) for T new positions in blocks.

    The new positions form consecutive blocks of ``block_size`` (the first block's anchor is
    position ``past_len``; the last block may be shorter). A query sees every key strictly
    before its block's anchor (the cache and earlier blocks) and its whole block, including
    later positions of the block (a DFlash-style drafter's denoising block).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    device = key_mask.device if key_mask is not None else device
    q_block = torch.arange(q_len, device=device) // block_size  # (T,)
    k_new = torch.arange(q_len, device=device) // block_size  # (T,)
    new = k_new[None, :] <= q_block[:, None]  # (T, T): earlier blocks and own block
    past = torch.ones(q_len, past_len, dtype=torch.bool, device=device)  # (T, past)
    return _key_mask_and_diag(torch.cat([past, new], dim=1)[None], key_mask, past_len)


def tree_depths(parents: Tensor) -> Tensor:
    """Depth of every tree node (roots 0) from ``parents`` (B, N) or (N,); parents[i] < i."""
    parents = _check_parents(parents)
    depth = torch.zeros_like(parents)
    for i in range(1, parents.shape[1]):
        p = parents[:, i]
        depth[:, i] = torch.where(p >= 0, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1, 0)
    return depth  # (B, N)


def tree_mask(parents: Tensor, past_len: int = 0, key_mask: Tensor | None = None) -> Tensor:
    """Ancestor bool mask (B, 1, N, S), S = past_len + N, for N tree nodes after a cache.

    ``parents`` (B, N) or (N,) gives each node's parent index among the nodes, -1 for a root
    (a root continues the cached prefix); nodes are topologically ordered (parents[i] < i).
    Node i sees every cached key, its ancestors and itself. Feed the nodes with position ids
    ``cache.next_positions()[:, None] + tree_depths(parents)``.
    """
    parents = _check_parents(parents)
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    anc = eye.expand(b, n, n).clone()  # (B, N, N): anc[b, i, j] = j is i or an ancestor of i
    rows = torch.arange(b, device=parents.device)
    for i in range(n):
        p = parents[:, i]
        has = p >= 0
        anc[has, i] |= anc[rows[has], p[has]]
    past = torch.ones(b, n, past_len, dtype=torch.bool, device=parents.device)  # (B, N, past)
    return _key_mask_and_diag(torch.cat([past, anc], dim=2), key_mask, past_len)


def _check_parents(parents: Tensor) -> Tensor:
    parents = parents.long()
    if parents.ndim == 1:
        parents = parents[None]
    n = parents.shape[-1]
    if parents.ndim != 2 or bool((parents >= torch.arange(n, device=parents.device)).any()):
        raise ValueError(
            "parents must be (N,) or (B, N) with parents[i] < i (topological order; -1 = root), "
            f"got {parents.tolist() if parents.numel() <= 32 else tuple(parents.shape)}"
        )
    if bool((parents < -1).any()):
        raise ValueError("parents must be >= -1 (-1 marks a root)")
    return parents


def additive_mask(mask: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Bool mask (True = attend) -> additive float mask: 0 where allowed, -inf elsewhere."""
    zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return zeros.masked_fill(~mask.bool(), float("-inf"))


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
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(q.dtype)  # an additive mask follows autocast's dtype
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

    vltrain_block = True  # the unit FSDP shards, activation checkpointing recomputes, compile

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
