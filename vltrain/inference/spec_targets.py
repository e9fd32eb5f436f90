"""Targets of speculative decoding and drafter training: the built-in captioner, HF causal LMs.

A ``SpecTarget`` is a frozen model seen the way a block drafter needs it:

- ``prefill(**inputs)`` -> next-token logits (B, V), the cache, and ``Context`` features of the
  prompt (the outputs of ``layer_ids`` blocks, concatenated: (B, S, F), F = n * W);
- ``verify(tokens, parents, cache)`` feeds a tree of nodes (a chain is the tree
  ``parents = [-1, 0, 1, ...]``) after the cache in one forward, with the ancestor-only mask
  and positions by depth; returns logits (B, N, V), the cache with all N nodes, and their
  features (B, N, F) and positions (B, N); with ``logits=False`` the final (normed) hidden
  states (B, N, W) in place of the logits, the head left to the caller (greedy speculative
  decoding scores only the nodes its walk visits over the whole vocabulary);
- ``keep(cache, index, valid)`` compacts the cache to the accepted path (``select_cache``);
- ``embed`` / ``head``: the frozen token embedding and LM head the drafter shares
  (``head_params``: the head's weight and bias, whose rows a reduced draft vocabulary keeps);
- ``features(...)``: the same features for whole training sequences (no cache).

Features are read *after* block i: vltrain's ``DecoderOutput.taps[i]``, HF's
``hidden_states[i + 1]`` (index 0 holds the embeddings), except the last block: HF's last
hidden state has the final norm applied, so ``HFTarget`` reads that block's own output with a
forward hook (the native forward and the captioner tap block outputs, and a drafter trained
on one target's features is deployed on another's).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from vltrain.config import extras
from vltrain.config.hub_ids import is_model_id
from vltrain.core import hub
from vltrain.inference.hf_adapter import HFCache, HFDecodeAdapter
from vltrain.models.captioner import Captioner, CaptionerCache
from vltrain.models.layers import tree_depths, tree_mask
from vltrain.models.text import mask_positions


@dataclass
class Context:
    """Target features of some positions, with their positions and realness."""

    features: Tensor  # (B, S, F)
    positions: Tensor  # (B, S) long
    valid: Tensor  # (B, S) bool

    def extend(self, other: Context) -> Context:
        """Append positions (along S)."""
        return Context(
            torch.cat([self.features, other.features], 1),
            torch.cat([self.positions, other.positions], 1),
            torch.cat([self.valid, other.valid], 1),
        )


class SpecTarget(Protocol):
    """What speculative decoding and the drafter stage need from a frozen target."""

    eos_token_id: int
    pad_token_id: int
    num_layers: int
    width: int
    vocab_size: int
    layer_ids: list[int]

    def prefill(self, **inputs: Any) -> tuple[Tensor, Any, Context]: ...

    def verify(
        self, tokens: Tensor, parents: Tensor, cache: Any, logits: bool = True
    ) -> tuple[Tensor, Any, Context]: ...

    def keep(self, cache: Any, index: Tensor, valid: Tensor) -> Any: ...

    def next_positions(self, cache: Any) -> Tensor: ...

    def embed(self, ids: Tensor) -> Tensor: ...

    def head(self, hidden: Tensor) -> Tensor: ...

    def head_params(self) -> tuple[Tensor, Tensor | None]: ...


def _concat(taps: dict[int, Tensor] | tuple[Tensor, ...], ids: list[int], offset: int) -> Tensor:
    if not ids:  # a target without a drafter (plain decoding): no features
        return taps[offset][..., :0]
    return torch.cat([taps[i + offset] for i in ids], dim=-1)  # (B, S, n * W)


class CaptionerTarget:
    """The built-in captioner (either connector) as a speculative-decoding target.

    The context includes the visual prefix positions of a ``projector`` captioner (image tokens
    are in the decoder context); drafting is text only.
    """

    def __init__(self, model: Captioner, layer_ids: list[int]) -> None:
        self.model = model.eval()
        dec = model.decoder
        self.num_layers, self.width = len(dec.blocks), dec.width
        self.vocab_size = dec.cfg.vocab_size
        self.layer_ids = list(layer_ids)
        self.eos_token_id, self.pad_token_id = model.eos_token_id, model.pad_token_id
        self.bos_token_id = model.bos_token_id

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.decoder.token_embed(ids)

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.decoder.logits(hidden)

    def head_params(self) -> tuple[Tensor, Tensor | None]:
        dec = self.model.decoder
        if dec.lm_head is None:  # tied to the token embedding
            return dec.token_embed.weight, None
        return dec.lm_head.weight, dec.lm_head.bias

    def _run(self, visual, ids, mask, kv, pos=None, attn=None):  # noqa: ANN001, ANN202
        m = self.model
        return m.connector.run(
            m.decoder,
            visual,
            ids,
            mask,
            kv,
            True,
            position_ids=pos,
            attn_mask=attn,
            taps=self.layer_ids,
        )

    @torch.no_grad()
    def features(self, images: Tensor, input_ids: Tensor, attention_mask: Tensor):
        """(Context over prefix + text positions, text logits (B, T, V), prefix length P)."""
        visual = self.model.encode_images(images)
        out = self._run(visual, input_ids, attention_mask.bool(), None)
        full = out.cache.mask  # (B, P + T)
        p = full.shape[1] - input_ids.shape[1]
        ctx = Context(_concat(out.taps, self.layer_ids, 0), mask_positions(full), full)
        return ctx, self.model.decoder.logits(out.hidden[:, p:]).float(), p

    @torch.no_grad()
    def prefill(self, images: Tensor, input_ids: Tensor, attention_mask: Tensor):
        """Left-padded prompts after the images: logits (B, V), cache, prompt context."""
        visual = self.model.encode_images(images)
        out = self._run(visual, input_ids, attention_mask.bool(), None)
        full = out.cache.mask
        ctx = Context(_concat(out.taps, self.layer_ids, 0), mask_positions(full), full)
        keep = None if self.model.connector.uses_prefix else visual
        logits = self.model.decoder.logits(out.hidden[:, -1]).float()
        return logits, CaptionerCache(kv=out.cache, visual=keep), ctx

    @torch.no_grad()
    def verify(self, tokens: Tensor, parents: Tensor, cache: CaptionerCache, logits: bool = True):
        kv = cache.kv
        pos = kv.next_positions()[:, None] + tree_depths(parents)  # (B, N)
        attn = tree_mask(parents, kv.length, key_mask=kv.mask)
        ones = torch.ones_like(tokens, dtype=torch.bool)
        out = self._run(cache.visual, tokens, ones, kv, pos, attn)
        scores = self.model.decoder.logits(out.hidden).float() if logits else out.hidden
        ctx = Context(_concat(out.taps, self.layer_ids, 0), pos, ones)
        return scores, CaptionerCache(kv=out.cache, visual=cache.visual), ctx

    def keep(self, cache: CaptionerCache, index: Tensor, valid: Tensor) -> CaptionerCache:
        return self.model.select_cache(cache, index, valid)

    def next_positions(self, cache: CaptionerCache) -> Tensor:
        return cache.kv.next_positions()


class HFTarget:
    """An HF causal LM (Llama, Qwen2, Qwen3, ... with (B, T) positions) as a target.

    Verification passes a 4-D ancestor mask, so the model must use ``sdpa`` or ``eager``
    attention (see ``HFDecodeAdapter``); the cache must be a full-attention ``DynamicCache``.
    """

    def __init__(self, model: Any, layer_ids: list[int], **token_ids: int) -> None:
        self.model = model.eval()
        self.adapter = HFDecodeAdapter(model, output_hidden_states=True, **token_ids)
        text = model.config.get_text_config(decoder=True)
        self.num_layers, self.width = text.num_hidden_layers, text.hidden_size
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.layer_ids = list(layer_ids)
        self.eos_token_id = self.adapter.eos_token_id
        self.pad_token_id = self.adapter.pad_token_id
        self.bos_token_id = self.adapter.bos_token_id
        self._last: Tensor | None = None  # the last block's output, when a drafter reads it
        self.reads_last = self.num_layers - 1 in self.layer_ids
        self._last_block = decoder_blocks(model, self.num_layers)[-1] if self.reads_last else None

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

    def embed(self, ids: Tensor) -> Tensor:
        return self.model.get_input_embeddings()(ids)

    def head(self, hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(hidden)

    def head_params(self) -> tuple[Tensor, Tensor | None]:
        lin = self.model.get_output_embeddings()
        return lin.weight, getattr(lin, "bias", None)

    @torch.no_grad()
    def features(self, input_ids: Tensor, attention_mask: Tensor):
        """(Context of every position, logits (B, T, V), prefix length 0) of right-padded rows."""
        with self._reading():
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True
            )
            feats = self._taps(out.hidden_states)
        mask = attention_mask.bool()
        ctx = Context(feats, mask_positions(mask), mask)
        return ctx, out.logits.float(), 0

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Tensor | None = None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        with self._reading():
            logits, cache = self.adapter.prefill(input_ids=input_ids, attention_mask=attention_mask)
            feats = self._taps(cache.hidden_states)
        mask = attention_mask.bool()
        cache.hidden_states = None
        return logits, cache, Context(feats, mask_positions(mask), mask)

    def _key_mask(self, cache: HFCache) -> Tensor:
        n = cache.kv.get_seq_length()
        if cache.attention_mask is None:
            return torch.ones(cache.position_ids.shape[0], n, dtype=torch.bool)
        return cache.attention_mask.bool()

    def next_positions(self, cache: HFCache) -> Tensor:
        return cache.position_ids[:, 0] + 1

    @torch.no_grad()
    def verify(self, tokens: Tensor, parents: Tensor, cache: HFCache, logits: bool = True):
        key_mask = self._key_mask(cache).to(tokens.device)
        pos = self.next_positions(cache)[:, None] + tree_depths(parents)  # (B, N)
        attn = tree_mask(parents, key_mask.shape[1], key_mask=key_mask)
        n = tokens.shape[1]
        with self._reading():
            scores, cache = self.adapter.verify(
                tokens, cache, position_ids=pos, attention_mask=attn, keep=n if logits else 1
            )
            feats = self._taps(cache.hidden_states)
        if not logits:  # HF's last hidden state is after the final norm: what the head reads
            scores = cache.hidden_states[-1][:, -n:]
        cache.hidden_states = None
        ones = torch.ones_like(tokens, dtype=torch.bool)
        return scores, cache, Context(feats, pos, ones)

    def keep(self, cache: HFCache, index: Tensor, valid: Tensor) -> HFCache:
        return self.adapter.select_cache(cache, index, valid)

    def decoder(self) -> HFDecodeAdapter:
        """The same model for plain decoding (``decoding.generate``), without hidden states."""
        a = self.adapter
        ids = {"eos_token_id": a.eos_token_id, "pad_token_id": a.pad_token_id}
        return HFDecodeAdapter(self.model, bos_token_id=a.bos_token_id, **ids)


def causal_lm_target(model: Any, layer_ids: list[int], forward: str, pad: int) -> Any:
    """An HF causal LM as a ``SpecTarget`` whose ``decoder()`` does plain decoding too.

    ``forward``: "native" (``NativeTarget``: vltrain's loop over the HF weights, the same
    logits with less overhead), "hf" (``HFTarget``: the HF modules) or "auto" (native where
    the model has it: Llama, Mistral, Qwen2, Qwen3 with full attention; the others, and a
    sliding window, run on HF's modules).
    """
    from vltrain.config.core import ConfigError
    from vltrain.inference.native_llama import NativeTarget, unsupported

    if forward not in ("auto", "native", "hf"):
        raise ConfigError(f"--forward must be auto, native or hf, not {forward!r}")
    reason = unsupported(model.config.get_text_config(decoder=True))
    if forward == "native" and reason:
        raise ConfigError(f"--forward native: {reason}")
    if forward == "hf" or reason:  # auto: HF's modules where the native forward cannot go
        return HFTarget(model, layer_ids, pad_token_id=pad)
    return NativeTarget(model, layer_ids, pad_token_id=pad)


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
    tok = AutoTokenizer.from_pretrained(where, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        where, dtype=torch.float32, attn_implementation=attn, **kw
    )
    return model.eval(), tok


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
