"""Batched caption decoding for the built-in captioner (shared by evaluation, RL and generate)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vltrain.data.tokenizer import TextTokenizer
from vltrain.inference.captioner_target import CaptionerTarget
from vltrain.inference.decoding import generate
from vltrain.models.captioner import Captioner


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded (B, T) ids and mask: prompts end at the last column, as prefill wants."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, t - len(r) :] = torch.tensor(list(r))
            mask[i, t - len(r) :] = 1
    return ids, mask


def decode_captions(
    model: Captioner,
    tokenizer: TextTokenizer,
    images: Tensor,
    prompt_ids: Sequence[Sequence[int]],
    *,
    strategy: str = "greedy",
    num_beams: int = 3,
    max_new_tokens: int = 24,
    length_penalty: float = 1.0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[str]:
    """Captions for images (B, 3, S, S) continuing each prompt (``<bos>`` + prompt tokens)."""
    ids, mask = left_pad(prompt_ids, tokenizer.pad_id)
    room = model.max_text_len - ids.shape[1]
    if room < 1:
        raise ValueError(
            f"the prompt takes {ids.shape[1]} of the decoder's {model.max_text_len} text "
            "positions; shorten it or train with a larger data.max_text_len"
        )
    dev = images.device
    out = generate(
        CaptionerTarget(model),
        {"images": images, "input_ids": ids.to(dev), "attention_mask": mask.to(dev)},
        strategy=strategy,
        max_new_tokens=min(max_new_tokens, room),
        num_beams=num_beams,
        length_penalty=length_penalty,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    rows = [s[: int(n)].tolist() for s, n in zip(out.sequences, out.lengths, strict=True)]
    return tokenizer.decode_batch(rows)
