"""Collated batches: what crosses the stage seam, moving it to a device, cutting it in row chunks.

A stage's collate builds one of the typed batches below from the good samples of a micro-batch
(the engine's bookkeeping travels beside it in `vltrain.data.loaders.Batch`, never inside);
the engine moves it to the device (`to_device`) and hands it to ``Stage.forward_backward``.
They are plain dicts at run time: the types say which keys a stage may read.

GradCache (`vltrain.objectives.grad_cache`) and the grouped text pass of the contrastive
model (`vltrain.models.contrastive.encode_text_sets`) encode a batch side in row chunks:
`split_rows` cuts by row, `length_sorted_chunks` groups right-padded token rows by length.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

import torch
from torch import Tensor


class ImageTextBatch(TypedDict):
    """Image-caption records through a backbone batcher (`vltrain.models.backbones`,
    `vltrain.data.hf_collate`): one image and one caption per row."""

    images: Any  # (B, 3, S, S) pixels, or a VLM's dict of image-side inputs
    input_ids: Tensor  # (B, T) captions, right-padded
    attention_mask: Tensor  # (B, T)
    index: NotRequired[Tensor]  # (B,) sample indices
    neg_ids: NotRequired[Tensor]  # (M, T) hard-negative texts, any owner
    neg_mask: NotRequired[Tensor]  # (M, T)
    pair_ids: NotRequired[Tensor]  # (B, T) second captions (objective.caption_contrast)
    pair_mask: NotRequired[Tensor]  # (B, T)
    visual_tokens: NotRequired[Tensor]  # (B,) tokens or patches each image costs


class PairSide(TypedDict):
    """One side of a pair batch: one modality, one encoder call."""

    modality: str  # text | image | image_text
    inputs: Any  # text: (ids (B, T), mask (B, T)); image / image_text: pixels or a VLM dict


class PairBatch(TypedDict):
    """Query/positive records (`vltrain.data.pairs.PairCollate`)."""

    query: PairSide
    positive: PairSide
    index: Tensor  # (B,)
    negatives: NotRequired[PairSide]  # (M rows) hard negatives, any owner
    visual_tokens: NotRequired[Tensor]  # per image of every side
    reading: NotRequired[Tensor]  # (B + M, P) or (B + M, 2, P): objective.reading's targets


class CaptionBatch(TypedDict):
    """Caption and chat records (`vltrain.data.caption_data.CaptionCollate`; the HF kinds:
    `vltrain.data.vlm_caption_data.VLMCaptionCollate`)."""

    images: Any  # (B, 3, S, S); HF kinds: a dict of pixel inputs (pixel_values, ...)
    input_ids: Tensor  # (B, T) right-padded
    attention_mask: Tensor  # (B, T)
    labels: Tensor  # (B, T), -100 where nothing is learned
    index: Tensor  # (B,)
    prompt_ids: NotRequired[list[list[int]]]  # eval-style samples: the prompt to decode from
    refs: NotRequired[list[list[str]]]  # eval-style samples: every reference caption
    visual_tokens: NotRequired[Tensor]  # (B,) HF kinds: image tokens of each image


class DraftBatch(TypedDict):
    """Drafter sequences (`vltrain.data.draft_data.DraftCollate`)."""

    input_ids: Tensor  # (B, T) right-padded
    labels: Tensor  # (B, T), -100 where nothing is learned
    attention_mask: Tensor  # (B, T)
    anchors: Tensor  # (B, J) block starts
    anchor_valid: Tensor  # (B, J)
    index: Tensor  # (B,)
    images: NotRequired[Tensor]  # (B, 3, S, S) a captioner target's images
    vision: NotRequired[dict[str, Tensor]]  # an HF VLM target's image inputs (pixel_values, ...)


def to_device(obj: Any, device: torch.device) -> Any:
    """Move tensors (also inside dicts, lists and tuples) to `device`."""
    if torch.is_tensor(obj):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def _rows(x: Any) -> set[int]:
    """Leading sizes of the tensors in a (nested) input."""
    if torch.is_tensor(x):
        return {x.shape[0]}
    items = x.values() if isinstance(x, Mapping) else x if isinstance(x, (list, tuple)) else []
    return {n for item in items for n in _rows(item)}


def _split_patch_grid(x: Mapping[str, Any], chunk: int) -> list[dict[str, Any]]:
    """Qwen-VL style inputs: `pixel_values` holds every image's patches back to back
    (sum of t*h*w over images, D); split it by the images' patch counts, the rest by row."""
    counts = x["image_grid_thw"].prod(-1)  # (B,) patches per image
    rest = {k: v for k, v in x.items() if k != "pixel_values"}
    sizes = [int(c.sum()) for c in counts.split(chunk)]
    pixels = x["pixel_values"].split(sizes)
    return [
        {**part, "pixel_values": px}
        for part, px in zip(split_rows(rest, chunk), pixels, strict=True)
    ]


def split_rows(x: Any, chunk: int) -> list[Any]:
    """Split a tensor, or a tuple/dict of tensors with the same rows, into row chunks.

    Dict entries that are not tensors (nor containers of them) are copied into every chunk.
    Tensors whose first dimension is not the batch (e.g. Qwen-VL's flattened patches) cannot
    be chunked by row: that raises instead of silently mis-splitting.
    """
    if chunk < 1:
        raise ValueError(f"GradCache chunk size must be >= 1, got {chunk}")
    if isinstance(x, Mapping) and "image_grid_thw" in x and "pixel_values" in x:
        return _split_patch_grid(x, chunk)
    if len(_rows(x)) > 1:
        raise ValueError(
            f"GradCache: the inputs to chunk have different leading sizes {sorted(_rows(x))}, "
            "so they cannot be split by row (inputs with flattened per-image patches are not "
            "supported); set objective.grad_cache_chunk=0 for this model"
        )
    if torch.is_tensor(x):
        return list(x.split(chunk))
    if isinstance(x, Mapping):  # non-tensor entries (e.g. a "modality" string) go to every chunk
        parts = {
            k: split_rows(v, chunk)
            for k, v in x.items()
            if torch.is_tensor(v) or isinstance(v, (Mapping, tuple, list))
        }
        n = len(next(iter(parts.values())))
        return [{k: parts[k][i] if k in parts else v for k, v in x.items()} for i in range(n)]
    if isinstance(x, (tuple, list)):
        return list(zip(*(split_rows(v, chunk) for v in x), strict=True))
    raise TypeError(
        f"split_rows: cannot split a {type(x).__name__}; pass tensors, tuples or dicts of tensors"
    )


def length_sorted_chunks(
    x: Mapping[str, Tensor] | tuple[Tensor, ...], chunk: int, mask_key: str | int = 1
) -> tuple[list[Any], Tensor]:
    """Right-padded token inputs in chunks of `chunk` rows, longest rows first, each chunk cut
    to its own longest row; also the row order (pass it to `grad_cache` as ``orders[s]``).

    GradCache may group the batch's rows into chunks any way it likes (the loss sees the whole
    batch), so grouping rows of similar length drops most of the padding work: with lengths
    spread like 8-20 words, about a quarter of the token positions. `x` is a dict (mask under
    "attention_mask") or a tuple (mask at index `mask_key`); every 2-D tensor as wide as the mask
    is cut. Only for encoders that ignore trailing padding (not ones that pool the last
    position of a fixed-length input, like SigLIP's text tower).
    """
    mask = x["attention_mask"] if isinstance(x, Mapping) else x[mask_key]  # (B, T)
    if mask.dim() != 2 or bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("length_sorted_chunks needs a right-padded (B, T) attention mask")
    lengths = mask.sum(1)  # (B,)
    # One chunk: keep the batch order (then it is exactly the uncached forward, dropout too).
    if mask.shape[0] <= chunk:
        order = torch.arange(mask.shape[0], device=mask.device)  # (B,)
    else:
        order = lengths.argsort(descending=True, stable=True)  # (B,)
    width = mask.shape[1]

    def rows(v: Any) -> Any:
        return v[order] if torch.is_tensor(v) else v

    sorted_x = (
        {k: rows(v) for k, v in x.items()}
        if isinstance(x, Mapping)
        else x.__class__(rows(v) for v in x)
    )
    out = []
    for c, n in zip(split_rows(sorted_x, chunk), lengths[order].split(chunk), strict=True):
        keep = max(int(n.max()), 1)

        def cut(v: Any, keep: int = keep) -> Any:
            return v[:, :keep] if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == width else v

        out.append(
            {k: cut(v) for k, v in c.items()} if isinstance(c, Mapping) else tuple(map(cut, c))
        )
    return out, order
