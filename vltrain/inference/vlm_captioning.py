"""Caption decoding for the HF VLM kinds (hf_vlm, llava) of the caption stage.

`decode_vlm_captions` is the one place the caption stage decodes an HF VLM; it calls the
transformers model's own ``generate`` (greedy or beam). It is kept apart so that the decoder
loop's HF VLM target (`vltrain.inference.decoding.generate` over an ``HFVLMTarget``) can
replace it without touching the stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


def left_pad_prompts(prompt_ids: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded ids (B, T) and attention mask (B, T) of prompts of unequal lengths."""
    t = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), t), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, t - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, t - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def decode_vlm_ids(
    model: Any,
    images: Mapping[str, Tensor],
    prompt_ids: list[list[int]],
    strategy: str,
    *,
    pad_id: int,
    num_beams: int = 3,
    max_new_tokens: int = 24,
    length_penalty: float = 1.0,
) -> list[list[int]]:
    """New token ids per row (up to and including the end token), decoded by HF ``generate``.

    `model` is an `HFVLM`; greedy (``strategy="greedy"``) or beam search (``"beam"``)."""
    if strategy not in ("greedy", "beam"):
        raise ValueError(f"strategy must be greedy or beam, got {strategy!r}")
    dev = next(model.parameters()).device
    ids, mask = left_pad_prompts(prompt_ids, pad_id)
    inputs = model.model_inputs(images, ids.to(dev), mask.to(dev))
    beams = num_beams if strategy == "beam" else 1
    extra = {"length_penalty": length_penalty} if beams > 1 else {}
    out = model.model.generate(
        **inputs,
        do_sample=False,
        num_beams=beams,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        **extra,
    )
    new = out[:, ids.shape[1] :].tolist()
    eos = model.base_model().generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos]) | {pad_id}
    rows = []
    for row in new:
        cut = next((i + 1 for i, t in enumerate(row) if t in ends), len(row))
        rows.append(row[:cut])
    return rows


def decode_vlm_captions(
    model: Any,
    tokenizer: Any,
    images: Mapping[str, Tensor],
    prompt_ids: list[list[int]],
    strategy: str,
    **kw: Any,
) -> list[str]:
    """One caption per row (special tokens dropped, whitespace stripped); see `decode_vlm_ids`."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = decode_vlm_ids(model, images, prompt_ids, strategy, pad_id=pad, **kw)
    return [tokenizer.decode(r, skip_special_tokens=True).strip() for r in rows]
