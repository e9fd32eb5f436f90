"""The built-in captioner (either connector) as a ``DecodeTarget`` (``inference.target``).

``prefill`` encodes the images and runs a left-padded prompt, ``step`` feeds one token per row,
``verify`` a tree of nodes (a chain is one) under the ancestor-only mask with positions by depth,
``select`` / ``crop`` keep accepted positions and ``reorder`` selects / repeats rows. The cache
(``CaptionerCache``) holds the decoder's KV cache with its padding mask and, for cross-attention
connectors, the visual latents of every row. The decoder context includes the visual prefix
positions of a ``projector`` captioner (image tokens are in the decoder context), so positions,
``crop`` lengths and ``select`` indices count them; drafting is text only.

Drafter features are the outputs of blocks ``layer_ids`` (the decoder loop's taps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vltrain.inference.target import Context
from vltrain.models.captioner import Captioner
from vltrain.models.layers import KVCache, tree_depths, tree_mask
from vltrain.models.text import DecoderOutput, mask_positions


@dataclass
class CaptionerCache:
    """Everything incremental decoding needs, row-aligned along the batch dim."""

    kv: KVCache
    """Decoder keys/values and the (B, S) real-token mask of every cached position."""
    visual: Tensor | None
    """Visual memory (B, L, Wd) the decoder cross-attends to each step; None for prefixes."""


class CaptionerTarget:
    """A ``Captioner`` as a decode target; ``layer_ids``: the blocks a drafter reads."""

    def __init__(self, model: Captioner, layer_ids: Sequence[int] = ()) -> None:
        self.model = model
        dec = model.decoder
        self.num_layers, self.width = len(dec.blocks), dec.width
        self.vocab_size = dec.cfg.vocab_size
        self.layer_ids = list(layer_ids)
        self.eos_token_id, self.pad_token_id = model.eos_token_id, model.pad_token_id
        self.bos_token_id = model.bos_token_id

    # ----------------------------------------------------------------------- decoding

    @torch.no_grad()
    def prefill(
        self, images: Tensor, input_ids: Tensor, attention_mask: Tensor
    ) -> tuple[Tensor, CaptionerCache, Context]:
        """Encode images (B, 3, H, W), run the left-padded prompts (B, T) (usually just <bos>).

        Returns the logits of the last position (B, V) float32, the cache and the context of the
        prefix + prompt positions.
        """
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"prefill needs input_ids and attention_mask of one (B, T) shape, got "
                f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        if not bool(attention_mask[:, -1].all()):
            raise ValueError(
                "prefill expects left-padded prompts (the last position of every row must be "
                "a real token); pad prompts on the left"
            )
        visual = self.model.encode_images(images)  # (B, N, Wd)
        out = self._run(visual, input_ids, attention_mask.bool(), None, taps=self.layer_ids)
        full = out.cache.mask  # (B, P + T)
        ctx = Context(self._features(out), mask_positions(full), full)
        keep = None if self.model.connector.uses_prefix else visual
        logits = self.model.decoder.logits(out.hidden[:, -1]).float()
        return logits, CaptionerCache(kv=out.cache, visual=keep), ctx

    @torch.no_grad()
    def step(self, tokens: Tensor, cache: CaptionerCache) -> tuple[Tensor, CaptionerCache]:
        """Feed one new token per row (B,); return next-token logits (B, V) float32, cache."""
        if tokens.ndim != 1 or tokens.shape[0] != cache.kv.mask.shape[0]:
            raise ValueError(
                f"step takes one token per cached row: expected shape "
                f"({cache.kv.mask.shape[0]},), got {tuple(tokens.shape)}"
            )
        ids = tokens[:, None]  # (B, 1)
        out = self._run(cache.visual, ids, torch.ones_like(ids, dtype=torch.bool), cache.kv)
        logits = self.model.decoder.logits(out.hidden[:, -1]).float()
        return logits, CaptionerCache(kv=out.cache, visual=cache.visual)

    @torch.no_grad()
    def verify(
        self, tokens: Tensor, parents: Tensor, cache: CaptionerCache, logits: bool = True
    ) -> tuple[Tensor, CaptionerCache, Context]:
        """Tree nodes (B, N) with parents (B, N) after the cache, in one forward: logits
        (B, N, V), or the final hidden states (B, N, W) with ``logits=False``."""
        kv = cache.kv
        rows = kv.mask.shape[0]
        if tokens.ndim != 2 or tokens.shape[0] != rows:
            raise ValueError(
                f"verify takes (B={rows}, N) tokens per cached row, got {tuple(tokens.shape)}"
            )
        pos = kv.next_positions()[:, None] + tree_depths(parents)  # (B, N)
        attn = tree_mask(parents, kv.length, key_mask=kv.mask)
        ones = torch.ones_like(tokens, dtype=torch.bool)
        out = self._run(cache.visual, tokens, ones, kv, pos, attn, taps=self.layer_ids)
        scores = self.model.decoder.logits(out.hidden).float() if logits else out.hidden
        ctx = Context(self._features(out), pos, ones)
        return scores, CaptionerCache(kv=out.cache, visual=cache.visual), ctx

    def select(
        self, cache: CaptionerCache, index: Tensor, valid: Tensor | None = None
    ) -> CaptionerCache:
        """Keep cached positions ``index`` (B, N) per row (see ``KVCache.select``)."""
        return CaptionerCache(kv=cache.kv.select(index, valid), visual=cache.visual)

    def crop(self, cache: CaptionerCache, n: int) -> CaptionerCache:
        """Keep the first ``n`` cached positions (prefix included) of every row."""
        return CaptionerCache(kv=cache.kv.crop(n), visual=cache.visual)

    def reorder(self, cache: CaptionerCache, rows: Tensor) -> CaptionerCache:
        """Select/reorder/repeat rows of the cache along batch (rows: LongTensor (B',))."""
        kv = cache.kv.reorder(rows)
        visual = cache.visual
        if visual is not None:
            visual = visual.index_select(0, rows.to(device=visual.device, dtype=torch.long))
        return CaptionerCache(kv=kv, visual=visual)

    def next_positions(self, cache: CaptionerCache) -> Tensor:
        return cache.kv.next_positions()

    # ----------------------------------------------------------------------- drafter

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.decoder.token_embed(ids)

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.decoder.logits(hidden)

    def head_params(self) -> tuple[Tensor, Tensor | None]:
        dec = self.model.decoder
        if dec.lm_head is None:  # tied to the token embedding
            return dec.token_embed.weight, None
        return dec.lm_head.weight, dec.lm_head.bias

    @torch.no_grad()
    def features(self, images: Tensor, input_ids: Tensor, attention_mask: Tensor):
        """(Context over prefix + text positions, text logits (B, T, V), prefix length P)."""
        visual = self.model.encode_images(images)
        out = self._run(visual, input_ids, attention_mask.bool(), None, taps=self.layer_ids)
        full = out.cache.mask  # (B, P + T)
        p = full.shape[1] - input_ids.shape[1]
        ctx = Context(self._features(out), mask_positions(full), full)
        return ctx, self.model.decoder.logits(out.hidden[:, p:]).float(), p

    # ----------------------------------------------------------------------- internals

    def _run(self, visual, ids, mask, kv, pos=None, attn=None, taps=()) -> DecoderOutput:
        m = self.model
        return m.connector.run(
            m.decoder, visual, ids, mask, kv, True, position_ids=pos, attn_mask=attn, taps=taps
        )

    def _features(self, out: DecoderOutput) -> Tensor:
        """The drafter's features (B, S, F) of the fed positions; (B, S, 0) without a drafter."""
        if not self.layer_ids:
            return out.hidden[..., :0]
        return torch.cat([out.taps[i] for i in self.layer_ids], dim=-1)


def load_captioner(path: str | Path) -> tuple[Captioner, Any, Any]:
    """(captioner in eval mode, its tokenizer, its run config) of a caption/rl run or checkpoint."""
    from vltrain.config.core import ConfigError
    from vltrain.config.schema import load_config
    from vltrain.core.checkpoint import load_weights, resolve_checkpoint
    from vltrain.data.tokenizer import TextTokenizer
    from vltrain.models.backbones import build_captioner

    ckpt = resolve_checkpoint(path)
    cfg_path = next(
        (q / "config.yaml" for q in (ckpt, *ckpt.parents[:3]) if (q / "config.yaml").is_file()),
        None,
    )
    if cfg_path is None:
        raise FileNotFoundError(f"no config.yaml above {ckpt}: pass a caption run or checkpoint")
    cfg = load_config(cfg_path)
    if cfg.stage not in ("caption", "rl"):
        raise ConfigError(f"model.target {path} is a '{cfg.stage}' run, not a caption or rl run")
    tok = TextTokenizer.load(ckpt / "tokenizer")
    model = build_captioner(cfg, tok)
    load_weights(model, ckpt)
    model.requires_grad_(False)
    return model.eval(), tok, cfg
