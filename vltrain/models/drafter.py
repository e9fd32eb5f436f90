"""A DFlash-style block drafter (arXiv 2602.06036) for speculative decoding.

Shapes: B rows, S context positions of the target, J blocks per row, K = block_size positions
per block, N = J * K draft queries, W the target's width, F = n_taps * W target features.

The drafter reads the frozen target's hidden states at ``n`` layers (``target_layer_ids``),
concatenated (B, S, F), projected by ``fc`` and normalised (``hidden_norm``); in every draft
layer these context states are keys and values next to the block's own. A block is the last
accepted token (the anchor, at position p) followed by K - 1 mask positions; its queries see
the target context strictly before p and their whole block (bidirectional), never another
block (``draft_attention_mask``). The token embeddings and the LM head are the target's, shared
and frozen: the drafter holds them by reference (``SharedParts``), so they are neither in its
state dict, nor in the optimizer, nor in a DDP wrapper.

Mask positions get a learned embedding chosen *by position* (k > 0), never by token value, so
an anchor equal to ``mask_token_id`` stays itself (the z-lab #73 class of bug).

A reduced draft vocabulary (``draft_vocab`` > 0, EAGLE-3's device): the drafter scores only
``vocab_ids`` (the most frequent tokens of its training labels, a saved buffer) through the same
frozen head rows, so its LM head costs draft_vocab / V of the full one in training and in every
decoding round. It never drafts a token outside them (the target still verifies every token:
decoding stays lossless); such labels carry no loss and count as misses in every metric.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.models.packed import PackedLinears

DRAFTER_ARCHS = {  # drafter.arch -> the DrafterConfig fields it sets
    "vltrain": {},
    "dflash": {"qk_norm": True, "learned_mask": False, "norm_eps": 1e-6},
}


def drafter_arch(arch: str, target_kind: str) -> str:
    """``drafter.arch`` resolved: auto is dflash (the serving engines' architecture) for an HF
    causal LM target (``hf_lm``), vltrain for a captioner's or an HF VLM's, which the formats
    do not describe."""
    if arch != "auto":
        return arch
    return "dflash" if target_kind == "hf_lm" else "vltrain"


def arch_fields(arch: str, target_kind: str) -> dict[str, object]:
    """The DrafterConfig fields of ``drafter.arch`` (auto resolved for ``target_kind``)."""
    return DRAFTER_ARCHS[drafter_arch(arch, target_kind)]


@dataclass
class DrafterConfig:
    """Dimensions of a drafter; ``width`` and ``vocab_size`` are the target's."""

    width: int
    """Hidden size (the target's: embeddings and LM head are shared)."""
    vocab_size: int
    """The target's vocabulary."""
    target_layer_ids: list[int]
    """Target blocks whose outputs (after the block) feed the drafter."""
    layers: int = 1
    """Draft decoder layers."""
    heads: int = 4
    """Attention heads of a draft layer; must divide width."""
    mlp_ratio: float = 2.0
    """SwiGLU hidden size as a multiple of width."""
    block_size: int = 8
    """Positions per block (anchor + block_size - 1 drafted tokens)."""
    rope_theta: float = 10000.0
    """RoPE base of the draft attention."""
    mask_token_id: int = 0
    """Token id whose embedding initialises the learned mask embedding (any id is safe)."""
    draft_vocab: int = 0
    """Tokens the drafter scores (``Drafter.vocab_ids``); 0 = the target's whole vocabulary."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3's; the DFlash formats' layers)."""
    learned_mask: bool = True
    """A learned mask embedding; False: the target's embedding of ``mask_token_id`` (what the
    DFlash formats feed the mask slots)."""
    norm_eps: float | None = None
    """Epsilon of every RMSNorm; None: torch's default (the dtype's machine epsilon)."""

    def __post_init__(self) -> None:
        if self.width % self.heads or (self.width // self.heads) % 2:
            raise ValueError(
                f"drafter width {self.width} must split into {self.heads} heads of even size"
            )
        if self.block_size < 2:
            raise ValueError(f"drafter block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("drafter needs at least one target layer id")
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(
                f"draft_vocab {self.draft_vocab} must lie in [0, vocab_size {self.vocab_size}]"
            )

    def to_dict(self) -> dict:
        """Plain JSON-able dict (saved beside every drafter checkpoint)."""
        return asdict(self)


def target_layer_ids(num_layers: int, n: int) -> list[int]:
    """DFlash's convention: ``n`` target blocks evenly spaced over [1, L - 3] ([L // 2] for one).

    Shallow targets (L < 5) fall back to evenly spaced blocks over [0, L - 1]. The drafter
    reads each block's *output* (HF ``hidden_states[i + 1]``; vltrain ``DecoderOutput.taps[i]``).
    """
    if n < 1 or num_layers < 1:
        raise ValueError(f"need n >= 1 target layers of a >= 1-layer target, got {n}, {num_layers}")
    if n == 1:
        return [num_layers // 2]
    lo, hi = (1, num_layers - 3) if num_layers >= 5 else (0, num_layers - 1)
    if hi - lo + 1 < n:
        raise ValueError(f"cannot space {n} distinct layers over a {num_layers}-layer target")
    return [int(round(lo + i * (hi - lo) / (n - 1))) for i in range(n)]


def draft_attention_mask(
    anchor_pos: Tensor, ctx_pos: Tensor, ctx_valid: Tensor, block_size: int
) -> Tensor:
    """Bool (B, 1, N, S + N) mask, True = attend, for J blocks of ``block_size`` queries.

    ``anchor_pos`` (B, J) positions of the anchors, ``ctx_pos`` / ``ctx_valid`` (B, S) the
    positions and realness of the context. A query of block j sees a context key iff the key
    is real and its *position* is strictly below anchor j (positions, not block ids: dense,
    overlapping anchors must not leak context), and every key of block j, none of another.
    """
    b, j = anchor_pos.shape
    n = j * block_size
    ctx = ctx_valid[:, None, :] & (ctx_pos[:, None, :] < anchor_pos[:, :, None])  # (B, J, S)
    ctx = ctx.repeat_interleave(block_size, dim=1)  # (B, N, S)
    blk = torch.arange(n, device=anchor_pos.device) // block_size  # (N,)
    own = (blk[:, None] == blk[None, :]).expand(b, n, n)  # (B, N, N)
    return torch.cat([ctx, own], dim=2)[:, None]  # (B, 1, N, S + N)


def rotate(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """RoPE (half-split) of x (B, H, T, Dh) at integer positions pos (B, T)."""
    half = x.shape[-1] // 2
    # transformers' rotary frequencies, to the last bit: the engines serving an export compute
    # them so (theta ** (-i / half) differs by an ulp, 4e-6 rad at position 60 for Dh 144)
    even = torch.arange(0, 2 * half, 2, device=x.device, dtype=torch.int64).float()
    freq = 1.0 / (theta ** (even / (2 * half)))  # (Dh/2,)
    ang = pos.float()[:, None, :, None] * freq  # (B, 1, T, Dh/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DraftLayer(nn.Module):
    """Pre-norm layer whose attention keys/values are [context states; the block's own]."""

    def __init__(
        self,
        width: int,
        heads: int,
        mlp_ratio: float,
        theta: float,
        qk_norm: bool = False,
        eps: float | None = None,
    ) -> None:
        super().__init__()
        self.heads, self.theta = heads, theta
        self.norm1, self.norm2 = nn.RMSNorm(width, eps=eps), nn.RMSNorm(width, eps=eps)
        dh = width // heads
        self.q_norm = nn.RMSNorm(dh, eps=eps) if qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(dh, eps=eps) if qk_norm else nn.Identity()
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        hidden = int(width * mlp_ratio)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, False)
        self.down = nn.Linear(hidden, width, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, w = x.shape
        return x.view(b, t, self.heads, w // self.heads).transpose(1, 2)  # (B, H, T, Dh)

    def context_kv(self, ctx: Tensor, ctx_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated keys and values (B, H, S, Dh) of context states ctx (B, S, W)."""
        k = self.k_norm(self._heads(self.k(ctx)))
        return rotate(k, ctx_pos, self.theta), self._heads(self.v(ctx))

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        pos: Tensor,
        ctx_pos: Tensor,
        mask: Tensor,
        ctx_kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x (B, N, W) block states, ctx (B, S, W) context states -> (B, N, W).

        ``ctx_kv``: the context's keys and values already computed (decoding's
        ``DraftContextCache``); then ``ctx`` is not read.
        """
        h = self.norm1(x)
        q = rotate(self.q_norm(self._heads(self.q(h))), pos, self.theta)
        ck, cv = self.context_kv(ctx, ctx_pos) if ctx_kv is None else ctx_kv
        kb, vb = self.context_kv(h, pos)  # the block's own keys and values
        k, v = torch.cat([ck, kb], dim=2), torch.cat([cv, vb], dim=2)  # (B, H, S + N, Dh)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, N, Dh)
        x = x + self.o(att.transpose(1, 2).flatten(2))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


@dataclass
class SharedParts:
    """The target's frozen token embedding and LM head, used by the drafter by reference."""

    embed: Callable[[Tensor], Tensor]
    """Token ids (B, T) -> embeddings (B, T, W)."""
    head: Callable[[Tensor], Tensor]
    """Hidden states (..., W) -> logits (..., V)."""
    head_params: Callable[[], tuple[Tensor, Tensor | None]] | None = None
    """The head as (weight (V, W), bias (V,) or None): ``head(h) == h @ weight.T + bias``;
    needed by a reduced draft vocabulary, which keeps only its rows."""


def draft_vocab_ids(counts: Tensor, n: int, always: tuple[int, ...] = ()) -> Tensor:
    """The ``n`` token ids (sorted) a reduced draft vocabulary keeps: ``always`` first, then
    the highest ``counts`` (V,) (label frequencies), ties to the lower id."""
    v = counts.shape[0]
    if not 0 < n <= v:
        raise ValueError(f"a draft vocabulary of {n} tokens does not fit a vocabulary of {v}")
    score = counts.double().clone()
    keep = [t for t in dict.fromkeys(always) if 0 <= t < v]
    score[keep] = float("inf")
    order = torch.sort(-score, stable=True).indices  # descending count, then ascending id
    return order[:n].sort().values


@dataclass
class DraftContextCache:
    """Decoding state of a drafter: each layer's keys/values of the context seen so far.

    The context only grows during speculative decoding (prompt, then each round's accepted
    positions), so a round projects only the new rows (``fc`` + norm + each layer's k/v)
    instead of the whole context: the drafter's cost per round stops growing with the length.
    """

    n: int = 0
    """Context rows already projected."""
    kv: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    """Per layer (keys, values) (B, H, n, Dh)."""


class Drafter(nn.Module):
    """The draft network: ``fc`` + ``hidden_norm`` over target features, N layers, a norm."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_feat = len(cfg.target_layer_ids) * cfg.width
        self.fc = nn.Linear(n_feat, cfg.width, bias=False)
        self.hidden_norm = nn.RMSNorm(cfg.width, eps=cfg.norm_eps)
        if cfg.learned_mask:
            self.mask_embed = nn.Parameter(torch.zeros(cfg.width))
        self.layers = nn.ModuleList(
            DraftLayer(
                cfg.width, cfg.heads, cfg.mlp_ratio, cfg.rope_theta, cfg.qk_norm, cfg.norm_eps
            )
            for _ in range(cfg.layers)
        )
        self.norm = nn.RMSNorm(cfg.width, eps=cfg.norm_eps)
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                nn.init.normal_(mod.weight, std=1 / math.sqrt(mod.in_features))
        self._shared: SharedParts | None = None
        # derived from vocab_ids and the shared head when first needed (never saved, never
        # broadcast): target token id -> draft index (-1 outside), and the head's rows
        self._vocab_index: Tensor | None = None
        self._sub_head: tuple[Tensor, Tensor | None] | None = None
        self._rest_head: tuple[Tensor, Tensor, Tensor | None] | None = None
        # the head rows, MKL-packed (decoding, CPU) for two row counts: the drafted slots,
        # and the verified nodes that greedy speculative decoding scores over them
        self._packed = PackedLinears(keep=2)
        if cfg.draft_vocab:
            # a draft index -> target token id; set by set_vocab (training) or the checkpoint
            self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab))

    def _check_vocab(self, ids: Tensor, where: str) -> None:
        n, v = self.cfg.draft_vocab, self.cfg.vocab_size
        if not n or ids.shape != (n,):
            raise ValueError(f"{where}: {tuple(ids.shape)} ids for a draft vocabulary of {n}")
        if len(set(ids.tolist())) != n or int(ids.min()) < 0 or int(ids.max()) >= v:
            raise ValueError(f"{where}: draft vocabulary ids must be {n} distinct ids below {v}")

    def _forget(self) -> None:
        self._vocab_index, self._sub_head, self._rest_head = None, None, None
        self._packed.clear()

    def set_vocab(self, ids: Tensor) -> None:
        """Use the token ids (draft_vocab,) as the draft vocabulary."""
        self._check_vocab(ids, "set_vocab")
        with torch.no_grad():
            self.vocab_ids.copy_(ids)
        self._forget()

    def _load_from_state_dict(self, state, prefix, *args) -> None:
        super()._load_from_state_dict(state, prefix, *args)
        if self.cfg.draft_vocab:  # the derived index and head rows follow the loaded ids
            self._check_vocab(self.vocab_ids, f"checkpoint key {prefix}vocab_ids")
            self._forget()

    def share(self, parts: SharedParts) -> Drafter:
        """Attach the target's embeddings and LM head (not registered: never saved/trained)."""
        object.__setattr__(self, "_shared", parts)
        self._sub_head = self._rest_head = None  # another head: its rows are gathered again
        self._packed.clear()
        return self

    @property
    def shared(self) -> SharedParts:
        if self._shared is None:
            raise RuntimeError("drafter has no target parts: call drafter.share(SharedParts(...))")
        return self._shared

    def init_mask_embed(self) -> None:
        """Start the mask embedding at the target's embedding of ``mask_token_id``."""
        if not self.cfg.learned_mask:
            return  # the mask slots read the target's embedding itself (block_inputs)
        ids = torch.tensor([[self.cfg.mask_token_id]], device=self.mask_embed.device)
        with torch.no_grad():
            self.mask_embed.copy_(self.shared.embed(ids)[0, 0].float())

    def block_inputs(self, anchor_ids: Tensor) -> Tensor:
        """Anchors (B, J) -> block input states (B, J * K, W): anchor, then K - 1 mask slots."""
        b, j = anchor_ids.shape
        k = self.cfg.block_size
        dtype = self.fc.weight.dtype
        emb = self.shared.embed(anchor_ids).to(dtype)  # (B, J, W)
        if self.cfg.learned_mask:
            mask = self.mask_embed
        else:
            ids = torch.full((1, 1), self.cfg.mask_token_id, device=anchor_ids.device)
            mask = self.shared.embed(ids)[0, 0].to(dtype)
        x = mask.expand(b, j, k, -1).clone()  # (B, J, K, W)
        x[:, :, 0] = emb  # by position: slot 0 is the anchor whatever its id
        return x.flatten(1, 2)

    def context(self, features: Tensor) -> Tensor:
        """Target features (B, S, F) -> context states (B, S, W)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(
        self,
        features: Tensor,
        ctx_pos: Tensor,
        ctx_valid: Tensor,
        anchor_ids: Tensor,
        anchor_pos: Tensor,
        mask_fn: Callable[..., Tensor] = draft_attention_mask,
        cache: DraftContextCache | None = None,
    ) -> Tensor:
        """Final draft states (B, J, K, W) of J blocks per row.

        ``features`` (B, S, F) at positions ``ctx_pos`` (B, S) (``ctx_valid`` marks real ones);
        ``anchor_ids`` / ``anchor_pos`` (B, J) the anchors. Slot k of block j is at position
        ``anchor_pos + k`` and predicts the token there. ``cache`` (decoding): the context
        rows before ``cache.n`` were projected in an earlier call and are not read again.
        """
        k = self.cfg.block_size
        if cache is None:
            ctx, kvs = self.context(features), [None] * len(self.layers)  # ctx (B, S, W)
        else:
            ctx, kvs = None, self._grow(cache, features, ctx_pos)
        x = self.block_inputs(anchor_ids)  # (B, N, W)
        offs = torch.arange(k, device=anchor_pos.device)
        pos = (anchor_pos[:, :, None] + offs).flatten(1)  # (B, N)
        mask = mask_fn(anchor_pos, ctx_pos, ctx_valid, k)
        for layer, kv in zip(self.layers, kvs, strict=True):
            x = layer(x, ctx, pos, ctx_pos, mask, kv)
        return self.norm(x).view(*anchor_ids.shape, k, -1)

    def _grow(
        self, cache: DraftContextCache, features: Tensor, ctx_pos: Tensor
    ) -> list[tuple[Tensor, Tensor]]:
        """Project the context rows the cache has not seen; every layer's full context k/v."""
        s = features.shape[1]
        if s < cache.n:
            raise ValueError(f"the context shrank ({cache.n} -> {s} rows): start a new cache")
        if s > cache.n:
            new = self.context(features[:, cache.n :])  # (B, S - n, W)
            parts = [layer.context_kv(new, ctx_pos[:, cache.n :]) for layer in self.layers]
            if cache.kv:
                parts = [
                    (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                    for (k0, v0), (k1, v1) in zip(cache.kv, parts, strict=True)
                ]
            cache.kv, cache.n = parts, s
        return cache.kv

    def logits(self, hidden: Tensor) -> Tensor:
        """Draft states (..., W) -> logits (..., V) through the target's LM head; over the
        draft vocabulary (..., draft_vocab) when it is reduced (``to_token`` maps back)."""
        if not self.cfg.draft_vocab:
            return self.shared.head(hidden)
        w, b = self.head_rows()
        if torch.is_grad_enabled():
            return F.linear(hidden.to(w.dtype), w, b)
        return self._packed.linear(hidden.to(w.dtype), w, b)  # decoding: rows recur each round

    def head_rows(self) -> tuple[Tensor, Tensor | None]:
        """The head's rows of the draft vocabulary, gathered once (the head is frozen)."""
        if self._sub_head is None or self._sub_head[0].device != self.vocab_ids.device:
            self._sub_head = self._gather_head(self.vocab_ids)
        return self._sub_head

    def _gather_head(self, ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """Rows ``ids`` of the shared head's weight and bias, on ``ids``' device."""
        if self.shared.head_params is None:
            raise RuntimeError("a reduced draft vocabulary needs SharedParts.head_params")
        w, b = self.shared.head_params()
        with torch.no_grad():
            rows = w.detach()[ids.to(w.device)].to(ids.device)
            bias = None if b is None else b.detach()[ids.to(b.device)].to(ids.device)
        return rows, bias

    def complete_logits(self, hidden: Tensor, sub: Tensor) -> Tensor:
        """Full-vocabulary logits (R, V) of states ``hidden`` (R, W) whose draft-vocabulary
        logits ``sub`` (R, draft_vocab) (``logits``) are at hand: only the head's other rows
        are scored here, so the head's weight is read once in all."""
        ids, w, b = self._rest_rows()
        rest = F.linear(hidden.to(w.dtype), w, b)  # (R, V - draft_vocab)
        return self.full_vocab(sub).index_copy_(-1, ids.to(sub.device), rest.to(sub.dtype))

    def _rest_rows(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """Token ids outside the draft vocabulary and the head's rows for them (gathered once:
        (V - draft_vocab) x W more floats held while decoding)."""
        if self._rest_head is None or self._rest_head[0].device != self.vocab_ids.device:
            rest = torch.ones(self.cfg.vocab_size, dtype=torch.bool, device=self.vocab_ids.device)
            rest[self.vocab_ids] = False
            ids = rest.nonzero()[:, 0]
            self._rest_head = (ids, *self._gather_head(ids))
        return self._rest_head

    def to_token(self, idx: Tensor) -> Tensor:
        """Draft-vocabulary indices -> target token ids (the identity for the full vocabulary)."""
        return self.vocab_ids[idx] if self.cfg.draft_vocab else idx

    def to_draft(self, tokens: Tensor) -> Tensor:
        """Target token ids -> draft-vocabulary indices, -1 for tokens outside it."""
        if not self.cfg.draft_vocab:
            return tokens
        ids = self.vocab_ids
        if self._vocab_index is None or self._vocab_index.device != ids.device:
            idx = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long, device=ids.device)
            idx[ids] = torch.arange(len(ids), device=ids.device)
            self._vocab_index = idx
        return self._vocab_index[tokens.to(ids.device)].to(tokens.device)

    def full_vocab(self, logq: Tensor) -> Tensor:
        """Draft-vocabulary scores (..., draft_vocab: log-probs or logits) -> (..., V), -inf
        outside the draft vocabulary."""
        if not self.cfg.draft_vocab:
            return logq
        out = logq.new_full((*logq.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab_ids.to(logq.device), logq)


DRAFTER_FILE = "drafter.json"
"""Written beside ``model.safetensors`` in every drafter checkpoint: config + target."""


#: config keys that name the file, the dtype, the library version or runtime switches, not the
#: network: left out of `config_sha256` (as is every key starting with "_")
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
    }
)


def _network_keys(value: object) -> object:
    if isinstance(value, dict):
        return {
            k: _network_keys(v)
            for k, v in value.items()
            if k not in VOLATILE_CONFIG_KEYS and not str(k).startswith("_")
        }
    return value


def config_sha256(config: object) -> str:
    """sha256 of a target's config (an HF config's ``to_diff_dict()``, the keys its config.json
    holds, or a dict) as sorted JSON, without `VOLATILE_CONFIG_KEYS`: the same for one model
    wherever its folder lies, whichever transformers version saved it."""
    import hashlib

    if hasattr(config, "to_diff_dict"):  # what save_pretrained writes to config.json
        tree = config.to_diff_dict()
    else:
        tree = dict(config)  # type: ignore[call-overload]
    text = json.dumps(_network_keys(tree), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def run_config_sha256(cfg: object) -> str:
    """`config_sha256` of a vltrain captioner's run config: the sections that make its network
    (``model``, ``caption``, ``data.image_size``, ``data.max_text_len``)."""
    from vltrain.config.core import to_dict

    d = to_dict(cfg)
    net = {"model": d["model"], "caption": d.get("caption")}
    net.update({k: d["data"][k] for k in ("image_size", "max_text_len")})
    return config_sha256(net)


def target_record(kind: str, target: str, folder: Path, sha: str) -> dict:
    """What ``drafter.json`` says of its target: its kind, its HF id (a hub id target) or its
    path relative to ``folder`` (the export travels with its target), and `config_sha256`."""
    import os

    from vltrain.config.hub_ids import is_model_id

    if is_model_id(target):
        return {"kind": kind, "id": str(target), "config_sha256": sha}
    rel = os.path.relpath(Path(target).resolve(), Path(folder).resolve())
    return {"kind": kind, "path": rel, "config_sha256": sha}


def target_name(target: dict) -> str:
    """The target a loaded ``drafter.json`` names (its HF id, or its resolved path)."""
    return str(target.get("id") or target.get("path") or "")


def check_target_config(target: dict, sha: str, where: str) -> None:
    """Refuse a drafter whose recorded target config hash is not ``sha`` (one line)."""
    from vltrain.config.core import ConfigError

    want = target.get("config_sha256")
    if want and want != sha:
        raise ConfigError(
            f"the drafter {where} was trained for another target: its config sha256 "
            f"{want[:12]} is not this model's ({sha[:12]}); pass the target it names "
            f"({target_name(target) or 'see its drafter.json'})"
        )


def save_drafter_meta(
    folder: Path, cfg: DrafterConfig, target: dict, decode: dict | None = None
) -> None:
    """Write the drafter's config, its target (`target_record`) and its latest measured
    decoding (``eval``: tau_decode, tau_decode_tree, tree_budget) into a checkpoint folder."""
    tree = {"drafter": cfg.to_dict(), "target": target}
    if decode:
        tree["eval"] = decode
    (Path(folder) / DRAFTER_FILE).write_text(json.dumps(tree, indent=2))
