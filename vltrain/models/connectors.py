"""Connectors: how a captioner feeds vision-tower tokens to a causal text decoder.

A connector is picked by registry key (``CONNECTORS``) and owns every parameter that is new
relative to a pretrained vision tower and a pretrained decoder, so freezing or LR-scaling
``vision`` / ``connector`` / ``decoder`` by module name does what it says:

- ``projector`` (LLaVA): a linear layer or 2-layer GELU MLP maps the vision tokens
  (B, 1 + P, Wv) to decoder width; they are prepended to the text as ``prefix_embeds``.
  ``pool`` average-pools the patch grid first (pool=2 turns 1 + 64 tokens into 1 + 16), which
  shortens the decoder context the prefix needs.
- ``gated_xattn`` (Flamingo): a Perceiver Resampler squeezes the vision tokens into
  ``n_latents`` latents (B, L, Wd); a gated cross-attention block runs *before* decoder block
  i for every i with ``i % xattn_every == 0``. Its attention and FFN branches are scaled by
  ``tanh(gate)`` with gates initialised at 0, so the fused model equals the plain decoder at
  init. The blocks live under ``connector.xattn.<i>`` instead of inside the decoder's blocks,
  which leaves every decoder key untouched: a plain ``CausalDecoder`` state dict loads into
  ``captioner.decoder`` with ``strict=True`` (the idea of torchtune's FusionLayer, done by
  keeping the fusion modules beside the decoder rather than wrapping its layers).

Every connector implements ``forward(vision_tokens) -> visual`` (what the decoder conditions on)
and ``run(decoder, visual, ...)``, which runs the decoder's one loop (``CausalDecoder.run``)
conditioned on it: as a prefix, or as a layer hook. ``hidden_states`` is its short form.
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.models.layers import MLP, KVCache, init_weights
from vltrain.models.text import CausalDecoder, DecoderOutput


@dataclass(frozen=True)
class ConnectorDims:
    """The sizes of the two towers a connector joins."""

    vision_width: int
    """Hidden size Wv of the vision tokens."""
    vision_tokens: int
    """Tokens per image from the vision tower (1 class token + P patches)."""
    text_width: int
    """Hidden size Wd of the decoder."""
    text_layers: int
    """Number of decoder blocks."""
    text_heads: int
    """Attention heads of the decoder (the connector's attention uses the same)."""


class Connector(nn.Module):
    """Base class: maps vision tokens to what the decoder conditions on, and runs the decoder."""

    uses_prefix: ClassVar[bool] = True
    """True if ``forward`` returns tokens that are prepended to the text (they take context)."""

    def num_prefix_tokens(self) -> int:
        """Decoder positions the visual prefix occupies (0 for cross-attention connectors)."""
        raise NotImplementedError

    def forward(self, vision_tokens: Tensor) -> Tensor:
        """Vision tokens (B, 1 + P, Wv) -> visual conditioning (B, N, Wd)."""
        raise NotImplementedError

    def hidden_states(
        self,
        decoder: CausalDecoder,
        visual: Tensor | None,
        input_ids: Tensor,
        attention_mask: Tensor,
        kv_cache: KVCache | None = None,
        use_cache: bool = False,
    ) -> tuple[Tensor, KVCache | None]:
        """Decoder hidden states (B, N + T, Wd) for the text conditioned on ``visual``.

        ``visual`` is this connector's ``forward`` output. A prefix connector only needs it on
        the first call (``kv_cache is None``); afterwards the prefix lives in the cache.
        """
        out = self.run(decoder, visual, input_ids, attention_mask, kv_cache, use_cache)
        return out.hidden, out.cache

    def run(
        self,
        decoder: CausalDecoder,
        visual: Tensor | None,
        input_ids: Tensor,
        attention_mask: Tensor,
        kv_cache: KVCache | None = None,
        use_cache: bool = False,
        *,
        position_ids: Tensor | None = None,
        attn_mask: Tensor | None = None,
        taps: Sequence[int] = (),
    ) -> DecoderOutput:
        """``hidden_states`` with the loop's options: explicit positions, mask and taps.

        Shapes as in ``CausalDecoder.run``: ``position_ids`` (B, N + T) and ``attn_mask``
        (B or 1, 1 or H, N + T, S) cover the visual prefix too when it is fed (N = 0 otherwise).
        """
        raise NotImplementedError


CONNECTORS: dict[str, type[Connector]] = {}


def register_connector(name: str):
    """Class decorator: make a ``Connector`` subclass buildable as ``connector.kind: name``."""

    def deco(cls: type[Connector]) -> type[Connector]:
        if name in CONNECTORS:
            raise ValueError(f"connector {name!r} is already registered by {CONNECTORS[name]}")
        CONNECTORS[name] = cls
        return cls

    return deco


def build_connector(kind: str, dims: ConnectorDims, **kwargs: Any) -> Connector:
    """Build the connector registered as ``kind`` for towers of ``dims`` with its own options."""
    if kind not in CONNECTORS:
        close = difflib.get_close_matches(kind, list(CONNECTORS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown connector {kind!r}; choose one of {sorted(CONNECTORS)}.{hint}")
    check_connector_options(kind, kwargs)
    return CONNECTORS[kind](dims, **kwargs)


def check_connector_options(kind: str, options: dict[str, Any]) -> None:
    """ValueError naming the options connector ``kind`` does not take (checked at load)."""
    cls = CONNECTORS[kind]
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "dims")]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"connector {kind!r} has no option(s) {unknown}; its options are {allowed}"
        )


# --------------------------------------------------------------------------- projector (LLaVA)


@register_connector("projector")
class ProjectorConnector(Connector):
    """LLaVA-style projector: (optionally pooled) vision tokens -> Linear or MLP -> prefix."""

    uses_prefix = True

    def __init__(self, dims: ConnectorDims, projector_layers: int = 2, pool: int = 1) -> None:
        super().__init__()
        if projector_layers not in (1, 2):
            raise ValueError(f"projector_layers must be 1 or 2, got {projector_layers}")
        side = math.isqrt(dims.vision_tokens - 1)
        if side * side != dims.vision_tokens - 1:
            raise ValueError(
                f"projector expects 1 class token + a square patch grid, got "
                f"{dims.vision_tokens} vision tokens"
            )
        if pool < 1 or side % pool != 0:
            raise ValueError(
                f"pool {pool} must be >= 1 and divide the patch grid side {side} "
                f"(valid: {[p for p in range(1, side + 1) if side % p == 0]})"
            )
        self.grid, self.pool = side, pool
        wv, wd = dims.vision_width, dims.text_width
        mods: list[nn.Module] = [nn.Linear(wv, wd)]
        if projector_layers == 2:
            mods += [nn.GELU(), nn.Linear(wd, wd)]
        self.proj = nn.Sequential(*mods)
        self.apply(init_weights)

    def num_prefix_tokens(self) -> int:
        """1 class token + the pooled patch grid."""
        return 1 + (self.grid // self.pool) ** 2

    def forward(self, vision_tokens: Tensor) -> Tensor:
        """(B, 1 + P, Wv) -> prefix (B, 1 + P / pool^2, Wd)."""
        if self.pool > 1:
            b, _, w = vision_tokens.shape
            cls, patches = vision_tokens[:, :1], vision_tokens[:, 1:]
            grid = patches.transpose(1, 2).reshape(b, w, self.grid, self.grid)  # (B, Wv, s, s)
            pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)  # (B, P', Wv)
            vision_tokens = torch.cat([cls, pooled], dim=1)
        return self.proj(vision_tokens)

    def run(
        self,
        decoder: CausalDecoder,
        visual: Tensor | None,
        input_ids: Tensor,
        attention_mask: Tensor,
        kv_cache: KVCache | None = None,
        use_cache: bool = False,
        *,
        position_ids: Tensor | None = None,
        attn_mask: Tensor | None = None,
        taps: Sequence[int] = (),
    ) -> DecoderOutput:
        """Prefix + text through the unchanged decoder: (B, N + T, Wd) (N = 0 with a cache)."""
        if kv_cache is None and visual is None:
            raise ValueError("projector: the first decoder call needs the visual prefix")
        prefix = visual if kv_cache is None else None
        return decoder.run(
            input_ids,
            attention_mask,
            prefix,
            kv_cache,
            use_cache,
            position_ids=position_ids,
            attn_mask=attn_mask,
            taps=taps,
        )


# --------------------------------------------------------------------------- gated x-attn


class CrossAttention(nn.Module):
    """Multi-head attention of queries (B, T, D) to a memory (B, M, D); no mask (all real)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads != 0:
            raise ValueError(f"cross-attention width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        """(B, T, D) attending to (B, M, D) -> (B, T, D)."""
        b, t, d = x.shape
        h, dh = self.heads, d // self.heads
        q = self.q(x).view(b, t, h, dh).transpose(1, 2)  # (B, H, T, Dh)
        kv = self.kv(memory.to(x.dtype)).view(b, memory.shape[1], 2, h, dh)  # (B, M, 2, H, Dh)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, M, Dh)
        out = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, Dh)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class TanhGate(nn.Module):
    """Multiply by ``tanh(scale)``; ``scale`` starts at 0, so the gated branch starts closed.

    ``zero_init_gate`` is the marker the diagnostics recognise gates by (they never import
    models): any module carrying it and a ``scale`` parameter is watched as a gate."""

    zero_init_gate: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(1))

    def forward(self, x: Tensor) -> Tensor:
        """(..., D) -> (..., D) scaled by tanh(scale)."""
        return x * self.scale.tanh().to(x.dtype)


class GatedCrossAttentionBlock(nn.Module):
    """Flamingo's gated xattn-dense: ``x + g_a * xattn(ln(x), media)``, ``x + g_f * ffn(ln(x))``."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CrossAttention(width, heads)
        self.attn_gate = TanhGate()
        self.norm2 = nn.LayerNorm(width)
        self.mlp = MLP(width, mlp_ratio)
        self.mlp_gate = TanhGate()

    def forward(self, x: Tensor, media: Tensor) -> Tensor:
        """(B, T, D) text states conditioned on media (B, M, D) -> (B, T, D)."""
        x = x + self.attn_gate(self.attn(self.norm1(x), media))
        return x + self.mlp_gate(self.mlp(self.norm2(x)))


class ResamplerLayer(nn.Module):
    """Latents attend to ``concat(media, latents)`` (Flamingo), then a pre-norm FFN."""

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm_media = nn.LayerNorm(width)
        self.norm_latents = nn.LayerNorm(width)
        self.attn = CrossAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = MLP(width, mlp_ratio)

    def forward(self, latents: Tensor, media: Tensor) -> Tensor:
        """Latents (B, L, D), media (B, M, D) -> latents (B, L, D)."""
        q = self.norm_latents(latents)
        kv = torch.cat([self.norm_media(media), q], dim=1)  # (B, M + L, D)
        latents = latents + self.attn(q, kv)
        return latents + self.mlp(self.norm2(latents))


class PerceiverResampler(nn.Module):
    """A fixed number of learned latents that summarise a variable number of vision tokens."""

    def __init__(self, in_width: int, width: int, heads: int, n_latents: int, layers: int) -> None:
        super().__init__()
        if n_latents < 1 or layers < 1:
            raise ValueError(
                f"resampler needs n_latents >= 1 and resampler_layers >= 1, "
                f"got {n_latents} and {layers}"
            )
        self.in_proj = nn.Linear(in_width, width)
        self.latents = nn.Parameter(torch.zeros(n_latents, width))
        self.layers = nn.ModuleList(ResamplerLayer(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.apply(init_weights)
        # Small like every other init: the image, not the latents' identity, dominates the
        # resampled tokens from the start (std 1.0 learned visibly slower in tests).
        nn.init.normal_(self.latents, std=0.02)

    def no_weight_decay(self) -> list[str]:
        """Latents are learned queries, like embeddings: no weight decay."""
        return ["latents"]

    def forward(self, vision_tokens: Tensor) -> Tensor:
        """(B, M, Wv) -> (B, L, Wd)."""
        media = self.in_proj(vision_tokens)  # (B, M, Wd)
        x = self.latents.to(media.dtype).expand(media.shape[0], -1, -1)  # (B, L, Wd)
        for layer in self.layers:
            x = layer(x, media)
        return self.norm(x)


@register_connector("gated_xattn")
class GatedXAttnConnector(Connector):
    """Flamingo-style: Perceiver Resampler + tanh-gated cross-attention before decoder blocks."""

    uses_prefix = False

    def __init__(
        self,
        dims: ConnectorDims,
        n_latents: int = 64,
        resampler_layers: int = 2,
        xattn_every: int = 1,
    ) -> None:
        super().__init__()
        if xattn_every < 1 or dims.text_layers < 1:
            raise ValueError(
                f"gated_xattn needs xattn_every >= 1 and a decoder with >= 1 block, got "
                f"xattn_every={xattn_every}, decoder layers={dims.text_layers}"
            )
        wd, heads = dims.text_width, dims.text_heads
        self.resampler = PerceiverResampler(
            dims.vision_width, wd, heads, n_latents, resampler_layers
        )
        self.xattn_layers = [i for i in range(dims.text_layers) if i % xattn_every == 0]
        # Keyed by the index of the decoder block they precede: connector.xattn.<i>.*
        self.xattn = nn.ModuleDict(
            {str(i): GatedCrossAttentionBlock(wd, heads) for i in self.xattn_layers}
        )
        self.xattn.apply(init_weights)  # TanhGate has no Linear/LN: gates stay at 0

    def num_prefix_tokens(self) -> int:
        """Cross-attention takes no decoder positions."""
        return 0

    def forward(self, vision_tokens: Tensor) -> Tensor:
        """(B, 1 + P, Wv) -> resampled latents (B, n_latents, Wd)."""
        return self.resampler(vision_tokens)

    def run(
        self,
        decoder: CausalDecoder,
        visual: Tensor | None,
        input_ids: Tensor,
        attention_mask: Tensor,
        kv_cache: KVCache | None = None,
        use_cache: bool = False,
        *,
        position_ids: Tensor | None = None,
        attn_mask: Tensor | None = None,
        taps: Sequence[int] = (),
    ) -> DecoderOutput:
        """The decoder's own loop with gated cross-attention to ``visual`` before chosen blocks.

        The cross-attention is the loop's layer hook, so this is the plain decoder's computation
        plus the gated branches (at init, with the gates at 0, exactly the plain decoder).
        """
        if visual is None:
            raise ValueError("gated_xattn: every decoder call needs the visual latents")
        if len(decoder.blocks) <= self.xattn_layers[-1]:
            raise ValueError(
                f"gated_xattn was built for a decoder with more than {self.xattn_layers[-1]} "
                f"blocks, but this decoder has {len(decoder.blocks)}"
            )

        def cross_attend(i: int, x: Tensor) -> Tensor:
            return self.xattn[str(i)](x, visual) if i in self.xattn_layers else x

        return decoder.run(
            input_ids,
            attention_mask,
            None,
            kv_cache,
            use_cache,
            position_ids=position_ids,
            attn_mask=attn_mask,
            layer_hook=cross_attend,
            taps=taps,
        )
