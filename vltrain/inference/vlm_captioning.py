"""Caption decoding for the HF VLM kinds (hf_vlm, llava) of the caption stage.

`decode_vlm_captions` is the one place the caption stage decodes an HF VLM: the one decoder
loop (`vltrain.inference.decoding.generate`) over an ``HFVLMTarget`` of the transformers model,
token for token what HF ``generate`` gives (tests/inference/test_vlm_target.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from vltrain.inference.decoding import generate
from vltrain.inference.vlm_target import HFVLMTarget


def left_pad_prompts(prompt_ids: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded ids (B, T) and attention mask (B, T) of prompts of unequal lengths."""
    t = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), t), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        ids[i, t - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, t - len(p) :] = 1
    return ids, mask


def prompt_inputs(
    model: Any, images: Mapping[str, Tensor], prompt_ids: list[list[int]], pad_id: int
) -> dict[str, Any]:
    """`HFVLMTarget.prefill` inputs of a batch: the prompts left-padded, on the model's device,
    with the collate's image inputs (``images``) and the model's own keys (`HFVLM.model_inputs`)."""
    dev = next(model.parameters()).device
    ids, mask = left_pad_prompts(prompt_ids, pad_id)
    return dict(model.model_inputs(images, ids.to(dev), mask.to(dev)))


def caption_target(model: Any, pad_id: int, layer_ids: tuple[int, ...] = ()) -> HFVLMTarget:
    """The `HFVLMTarget` of an `HFVLM` the caption stage decodes with (its end tokens,
    `end_tokens`); ``layer_ids``: the blocks a drafter reads."""
    base = model.base_model()
    return HFVLMTarget(base, layer_ids, eos_token_id=end_tokens(base, pad_id))


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
    **sampling: Any,
) -> list[list[int]]:
    """New token ids per row (up to and including the end token), decoded by the one decoder
    loop (`vltrain.inference.decoding.generate`) over an `HFVLMTarget` of the transformers model.

    `model` is an `HFVLM`; greedy (``strategy="greedy"``), beam search (``"beam"``) or sampling
    (``"sample"``, with ``temperature`` / ``top_k`` / ``top_p`` / ``generator`` in ``sampling``).
    The target uses the model's generation config (end tokens, pad), as HF ``generate`` does."""
    if strategy not in ("greedy", "beam", "sample"):
        raise ValueError(f"strategy must be greedy, beam or sample, got {strategy!r}")
    target = caption_target(model, pad_id)
    inputs = prompt_inputs(model, images, prompt_ids, pad_id)
    room = target.room(inputs["input_ids"].shape[1])
    out = generate(
        target,
        inputs,
        strategy,  # type: ignore[arg-type]
        max_new_tokens=max_new_tokens if room is None else max(1, min(max_new_tokens, room)),
        num_beams=num_beams,
        length_penalty=length_penalty,
        **sampling,
    )
    return [s[: int(n)].tolist() for s, n in zip(out.sequences, out.lengths, strict=True)]


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


def end_tokens(model: Any, pad_id: int) -> tuple[int, ...]:
    """The ids that end a caption: the generation config's (or config's) EOS, every id of a list
    (HF ``generate`` stops at any); the pad id when the model defines none, which is where a
    caption of such a model ends in HF ``generate``'s right-padded output too."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None)
        values = value if isinstance(value, (list, tuple)) else [value]
        ids = tuple(dict.fromkeys(int(v) for v in values if v is not None))
        if ids:
            return ids
    return (pad_id,)
