"""Hugging Face image-text-to-text models (``AutoModelForImageTextToText``) as a ``DecodeTarget``.

``HFVLMTarget`` is ``hf_target.HFTarget`` (the model's own forward, fed what HF ``generate``
feeds it) with the image side made explicit: ``prefill`` takes the processor's outputs for a
left-padded batch (``input_ids``, ``attention_mask``, ``pixel_values`` and the model's own image
keys: ``image_grid_thw`` and ``mm_token_type_ids`` for Qwen2-VL / Qwen3-VL,
``pixel_attention_mask`` for Idefics3 / SmolVLM, ...), images enter at the prefill only, and every
later call is text against the KV cache. Qwen-VL's multimodal rope positions come from the model's
own generation helper at the prefill (its ``rope_deltas``) and then step per channel, as in
``generate``; ``verify`` / ``select`` keep each channel's offset, so speculative decoding runs with
the image prefix in the context and text drafted.

``decode_vlm_captions`` is the evaluation entry point (captions of a batch of processor outputs);
``vlm_inputs`` builds those outputs for image files from a model directory (no torchvision),
``load_hf_vlm`` loads such a directory, ``is_hf_vlm`` tells one from a causal LM by its config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.inference.decoding import generate
from vltrain.inference.hf_target import HFCache, HFTarget
from vltrain.inference.target import Context


class HFVLMTarget(HFTarget):
    """An ``AutoModelForImageTextToText`` model as a ``DecodeTarget`` (module doc).

    Arguments as ``HFTarget``'s: ``layer_ids`` are the language model's blocks a drafter reads.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] = (), **kwargs: Any) -> None:
        super().__init__(model, layer_ids, **kwargs)
        self.max_positions = max_positions(model.config)

    @torch.no_grad()
    def prefill(
        self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, **inputs: Any
    ) -> tuple[Tensor, HFCache, Context]:
        """The processor's outputs of a left-padded batch: ``input_ids`` (B, T) with the image
        placeholders, ``attention_mask`` (B, T), ``pixel_values`` and the model's image keys."""
        if attention_mask is not None and not bool(attention_mask[:, -1].all()):
            raise ValueError(
                "HFVLMTarget.prefill needs left-padded prompts (every row's last position real); "
                "pass the processor's outputs through vlm_target.left_align first"
            )
        return super().prefill(input_ids, attention_mask, **inputs)

    def room(self, prompt_len: int) -> int | None:
        """New tokens that fit after a prompt of ``prompt_len`` positions (None: no limit)."""
        return None if self.max_positions is None else self.max_positions - prompt_len


def max_positions(config: Any) -> int | None:
    """The language model's ``max_position_embeddings`` of an HF config (None: unbounded)."""
    value = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return value if isinstance(value, int) else None


def left_align(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The processor's outputs with every row's padding moved to the left (generation pads on
    the left; processors and vltrain's collate pad on the right): each tensor whose first two
    dims are the attention mask's (``input_ids``, ``mm_token_type_ids``, ...) is rolled per row."""
    mask = inputs["attention_mask"]
    out = dict(inputs)
    if bool(mask[:, -1].all()):  # already left-padded (or not padded)
        return out
    t = mask.shape[1]
    lengths = mask.long().sum(1)  # (B,)
    right = torch.arange(t, device=mask.device)[None, :] < lengths[:, None]  # (B, T)
    if not torch.equal(mask.bool(), right):
        raise ValueError("left_align takes right-padded rows (real tokens first, then padding)")
    cols = (torch.arange(t, device=mask.device)[None, :] + lengths[:, None]) % t  # (B, T)
    for key, value in inputs.items():
        if isinstance(value, Tensor) and value.shape[:2] == mask.shape:
            idx = cols.to(value.device).view(*cols.shape, *[1] * (value.ndim - 2))
            out[key] = value.gather(1, idx.expand_as(value))
    return out


def decode_vlm_captions(
    model: nn.Module,
    processor_or_tokenizer: Any,
    inputs: Mapping[str, Any],
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
    """One caption per row of ``inputs`` (the processor's outputs, left- or right-padded, on the
    model's device) by greedy, beam or sampled decoding; ``max_new_tokens`` is cut to the
    positions the model has left after the prompt. Text is decoded without special tokens."""
    batch = left_align(inputs)
    target = HFVLMTarget(model)
    room = target.room(batch["input_ids"].shape[1])
    if room is not None and room < 1:
        raise ValueError(
            f"the prompt takes {batch['input_ids'].shape[1]} of the model's {target.max_positions} "
            "positions: no room for a caption; use fewer visual tokens or a shorter prompt"
        )
    out = generate(
        target,
        batch,
        strategy,  # type: ignore[arg-type]
        max_new_tokens=max_new_tokens if room is None else min(max_new_tokens, room),
        num_beams=num_beams,
        length_penalty=length_penalty,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        generator=generator,
    )
    rows = [s[: int(n)].tolist() for s, n in zip(out.sequences, out.lengths, strict=True)]
    tok = getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)
    return [t.strip() for t in tok.batch_decode(rows, skip_special_tokens=True)]


# ----------------------------------------------------------------------------- directories


def is_hf_vlm(path: str | Path) -> bool:
    """Whether the local directory ``path`` holds an ``AutoModelForImageTextToText`` model
    (by its config.json; a ``.gguf`` file or a causal LM is not one)."""
    import json

    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    try:  # the key AutoConfig dispatches on; a folder without one is the loader's to refuse
        c = json.loads((p / "config.json").read_text())
    except (ValueError, OSError):
        return False
    return isinstance(c, dict) and c.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


#: model.kind of caption runs whose model is an HF VLM (vltrain.stages.caption_hf)
VLM_RUN_KINDS = ("hf_vlm", "llava")


def vlm_run(path: str | Path) -> tuple[Path, Any] | None:
    """(checkpoint folder, run config) when ``path`` is a caption or rl run of an HF VLM kind
    (a run dir, its checkpoints/ or a step folder); None for anything else."""
    from vltrain.config.schema import load_config
    from vltrain.core.checkpoint import resolve_loadable

    p = Path(path)
    found = [q / "config.yaml" for q in (p, *p.parents[:3]) if (q / "config.yaml").is_file()]
    if not p.exists() or not found:
        return None
    cfg = load_config(found[0])
    if cfg.stage not in ("caption", "rl") or cfg.model.kind not in VLM_RUN_KINDS:
        return None
    return resolve_loadable(p)[0], cfg


def load_hf_vlm(path: str | Path, attn: str = "sdpa") -> nn.Module:
    """The ``AutoModelForImageTextToText`` model of a local directory, fp32, in eval mode."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation=attn, local_files_only=True
    )
    model.requires_grad_(False)
    return model.eval()


def vlm_inputs(collate: Any, images: Sequence[Any], prompt: str) -> dict[str, Any]:
    """Left-padded processor outputs of one chat prompt per image (the image, then ``prompt``),
    built by ``data.hf_collate.HFCollate`` (kind ``vlm``) of the model's directory."""
    inputs, _ = collate.image_batch(list(images), instructions=[prompt] * len(images))
    return left_align(inputs)
