"""Tar sample -> training sample: the streaming counterpart of `ImageTextDataset.__getitem__`.

Same safe image decode, text checks, bad-sample reasons and per-sample randomness
(``(seed, epoch, index)``) as map-style records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vltrain.data.images import (
    DEFAULT_MAX_PIXELS,
    BadSample,
    check_text,
    load_image,
    load_image_native,
)
from vltrain.data.readers import caption_negatives_fit
from vltrain.data.records import training_texts
from vltrain.data.rng import sample_seed
from vltrain.data.shards import IMAGE_EXTS, RawSample, parse_meta
from vltrain.data.streaming import Entry


def sample_index(key: str) -> int:
    """The integer that per-sample randomness uses: a decimal key itself (so shards written by
    `vltrain data shard` pick the captions a map-style run of the same records picks), else a
    63-bit hash of the key. Never the position in the stream, the rank or the worker."""
    return int(key) if key.isdigit() else sample_seed(0, 0, 0, salt=key)


class SampleDecoder:
    """Raw tar sample -> training sample, the way `ImageTextDataset` builds one (picklable).

    Bad data never raises: a missing/undecodable image, an empty caption or an unreadable
    shard comes back as a ``{"bad": reason}`` marker with the reasons of vltrain.data.images.
    """

    def __init__(
        self,
        image_size: int,
        seed: int,
        hard_negatives: int = 0,
        native: bool = False,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        second_caption: bool = False,
    ) -> None:
        self.image_size, self.seed, self.hard_negatives = image_size, seed, hard_negatives
        self.native, self.max_pixels = native, max_pixels
        self.second_caption = second_caption  # also `text2` (objective.caption_contrast)

    def __call__(self, entry: Entry, shard: str) -> dict[str, Any]:
        key = (entry.epoch, entry.key)
        if entry.sample is None:  # the rest of a shard could not be read
            return {"bad": "corrupt", "path": entry.key, "key": key, "index": -1}
        label = f"{Path(shard).name}:{entry.key}"
        index = sample_index(entry.key)
        try:
            return self._sample(entry.sample, label, entry.epoch, index, key)
        except BadSample as e:
            return {"bad": e.reason, "path": label, "detail": e.detail, "key": key, "index": index}

    def _sample(
        self, raw: RawSample, label: str, epoch: int, index: int, key: Any
    ) -> dict[str, Any]:
        meta = parse_meta(raw)
        if meta is None:
            raise BadSample("bad_text", label, "the sample's .json is not a JSON object")
        texts = [check_text(t, label) for t in meta.get("text") or []]
        if not texts:
            raise BadSample("bad_text", label, "sample has no caption (.json text or .txt)")
        negs = meta.get("negatives") or []
        if self.hard_negatives and negs:
            negs = [check_text(t, label) for t in negs]
        ext = next((e for e in IMAGE_EXTS if e in raw.members), None)
        if ext is None:
            raise BadSample("missing", label, f"no image member ({', '.join(IMAGE_EXTS)})")
        data = raw.members[ext]
        if self.native:
            image = load_image_native(label, self.max_pixels, data=data)  # PIL RGB
        else:
            image = load_image(label, self.image_size, self.max_pixels, data=data)  # (3, S, S)
        per_caption = meta.get("caption_negatives")
        if not caption_negatives_fit(per_caption, len(texts)):
            raise BadSample("bad_text", label, "caption_negatives must hold one list per caption")
        return {
            "image": image,
            **training_texts(
                texts,
                negs,
                per_caption,
                self.hard_negatives,
                self.second_caption,
                (self.seed, epoch, index),
                label,
            ),
            "index": index,
            "key": key,
            "id": str(meta.get("id", raw.key)),
        }
