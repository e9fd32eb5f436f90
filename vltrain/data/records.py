"""Image-text records, the dataset over them, bad-sample accounting.

Records come from any source `vltrain.data.sources.read_source` reads: JSONL, COCO captions
JSON, a captions CSV, an image folder with a captions file, parquet or a `datasets` folder.

Record (one JSON object per JSONL line)::

    {"image": "images/0001.png", "text": "..." or [...], "negatives": [...], "id": "..."}

`read_records` normalises every record to ``{"image": str, "text": list, "negatives": list,
"id": str, ...extra keys kept}``. Structural mistakes (invalid JSON, a line that is not an
object, no ``image``/``text`` key, wrong types for ``image``/``negatives``) raise `DataError`
naming ``file:line``. Content problems (a missing or broken image, an empty caption, an image
path that escapes the data folder) are not errors: `ImageTextDataset` returns a marker dict
``{"bad": reason, ...}`` that collate drops and `BadSampleTracker` counts.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from vltrain.data.images import (
    DEFAULT_MAX_PIXELS,
    REASONS,
    BadSample,
    check_text,
)
from vltrain.data.rng import sample_generator
from vltrain.data.sources import load_source_image, merge_repeated_images, read_source

SampleKey = tuple[int, int, int]  # (epoch, batch_in_epoch, index)


class DataQualityError(RuntimeError):
    """Too many bad samples: the run stops rather than train on a broken data set."""


def read_records(
    path: str | os.PathLike[str], image_column: str = "image", text_column: str = "text"
) -> list[dict[str, Any]]:
    """Records of any supported source (`vltrain.data.sources`). For parquet and `datasets`
    sources ``record["image"]`` is the row number (the image stays in the table)."""
    return read_source(path, image_column, text_column).records


def as_key(key: object) -> SampleKey:
    """Accept (epoch, batch_in_epoch, index) or a bare index; numpy/torch integers are fine."""
    try:
        if isinstance(key, (tuple, list)) and len(key) == 3:
            return (operator.index(key[0]), operator.index(key[1]), operator.index(key[2]))
        return (0, 0, operator.index(key))  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            "dataset key must be an int index or an (epoch, batch_in_epoch, index) tuple, "
            f"got {key!r}"
        ) from None


class ImageTextDataset(Dataset):
    """Image-text pairs; `__getitem__` never raises for bad data, it returns a marker dict.

    Caption choice (train) and hard-negative choice come from
    ``sample_generator(seed, epoch, index)`` only; with ``second_caption`` a training sample
    also carries ``text2``, another caption of the same image (`pick_caption_pair`), for the
    caption-caption loss (``objective.caption_contrast``). In eval mode (``train=False``) the
    sample has the first caption as ``text``, all captions as ``texts``, and the first
    ``hard_negatives`` negatives in file order, with their ``negative_kinds`` labels when the
    record has one per negative (e.g. the synthetic data's colour/shape/size/relation).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        image_size: int,
        seed: int,
        hard_negatives: int = 0,
        train: bool = True,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        native: bool = False,
        image_column: str = "image",
        text_column: str = "text",
        second_caption: bool = False,
        merge_images: bool = False,
    ) -> None:
        if hard_negatives < 0:
            raise ValueError(f"hard_negatives must be >= 0, got {hard_negatives}")
        self.source = read_source(path, image_column, text_column)
        if merge_images:  # one record per image path (`merge_repeated_images`)
            self.source.records = merge_repeated_images(self.source.records)
        self.path = self.source.path
        self.image_size = image_size
        self.seed = seed
        self.hard_negatives = hard_negatives
        self.train = train
        self.max_pixels = max_pixels
        self.native = native  # PIL images at native size, for models with their own processor
        self.second_caption = second_caption

    @property
    def records(self) -> list[dict[str, Any]]:
        """The records (assignable, e.g. to keep only the first N)."""
        return self.source.records

    @records.setter
    def records(self, value: list[dict[str, Any]]) -> None:
        self.source.records = value

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: SampleKey | int) -> dict[str, Any]:
        epoch, _, index = as_key(key)
        if not 0 <= index < len(self.records):
            raise IndexError(f"index {index} out of range for {len(self.records)} records")
        rec = self.records[index]
        try:
            return self._sample(rec, epoch, index, key)
        except BadSample as e:
            where = e.path or str(rec["image"])
            return {"bad": e.reason, "path": where, "detail": e.detail, "key": key, "index": index}

    def _sample(self, rec: dict[str, Any], epoch: int, index: int, key: Any) -> dict[str, Any]:
        label = f"{self.path}:id={rec['id']}"
        if not rec["text"]:
            raise BadSample("bad_text", label, "record has no captions")
        texts = [check_text(t, label) for t in rec["text"]]
        negs = rec["negatives"]
        if self.hard_negatives and negs:
            negs = [check_text(t, label) for t in negs]
        # (3, S, S), or with `native` a PIL RGB image at its own size
        image = load_source_image(
            self.source, rec["image"], self.image_size, label, self.native, self.max_pixels
        )
        out: dict[str, Any] = {"image": image, "index": index, "key": key}
        if self.train:
            out.update(
                training_texts(
                    texts,
                    negs,
                    rec.get("caption_negatives"),
                    self.hard_negatives,
                    self.second_caption,
                    (self.seed, epoch, index),
                    label,
                )
            )
        else:
            out["text"] = texts[0]
            out["texts"] = texts
            out["negatives"] = list(negs[: self.hard_negatives])
            kinds = rec.get("negative_kinds")
            if isinstance(kinds, list) and len(kinds) == len(negs):  # optional labels
                out["negative_kinds"] = [str(k) for k in kinds[: self.hard_negatives]]
        return out


def caption_index(n: int, seed: int, epoch: int, index: int) -> int:
    """Which of a record's `n` captions training draws, deterministic in (seed, epoch, index)
    (every stage draws through here, so length buckets can predict the draw)."""
    g = sample_generator(seed, epoch, index, salt="caption")
    return int(torch.randint(n, (1,), generator=g))


def _second_index(n: int, first: int, seed: int, epoch: int, index: int) -> int:
    """A caption other than `first`, uniform over the other n - 1 (`first` itself when n = 1)."""
    if n == 1:
        return first
    g = sample_generator(seed, epoch, index, salt="caption2")
    other = int(torch.randint(n - 1, (1,), generator=g))
    return other + (other >= first)


def pick_caption_pair(texts: list[str], seed: int, epoch: int, index: int) -> tuple[str, str]:
    """The training caption (`caption_index`'s, so length buckets still predict it) and a second,
    different one of the same record, uniform over the others; a one-caption record pairs its
    caption with itself. Deterministic in (seed, epoch, index)."""
    first = caption_index(len(texts), seed, epoch, index)
    return texts[first], texts[_second_index(len(texts), first, seed, epoch, index)]


def training_texts(
    texts: list[str],
    negs: list[str],
    per_caption: list[list[Any]] | None,
    k: int,
    second_caption: bool,
    key: tuple[int, int, int],
    label: str,
) -> dict[str, Any]:
    """A training sample's texts, deterministic in ``key = (seed, epoch, index)``: ``text``
    (`caption_index`'s draw), with `second_caption` also ``text2`` (`pick_caption_pair`'s), and
    up to `k` ``negatives``: the drawn caption's own ``caption_negatives`` first (minimal pairs
    of that very wording, e.g. its relation inverted), then the record's shared ``negatives``
    (`pick_negatives`). The map-style and the streamed datasets both draw here."""
    seed, epoch, index = key
    first = caption_index(len(texts), seed, epoch, index)
    out: dict[str, Any] = {"text": texts[first]}
    if second_caption:
        out["text2"] = texts[_second_index(len(texts), first, seed, epoch, index)]
    own: list[str] = []
    if k and per_caption:
        mine = [check_text(t, label) for t in per_caption[first]]
        g = sample_generator(seed, epoch, index, salt="caption_negatives")
        own = [mine[int(i)] for i in torch.randperm(len(mine), generator=g)[:k]]
    out["negatives"] = own + pick_negatives(negs, k - len(own), seed, epoch, index)
    return out


def pick_negatives(negs: list[str], k: int, seed: int, epoch: int, index: int) -> list[str]:
    """Up to `k` hard-negative texts, no replacement, deterministic in (seed, epoch, index)."""
    k = min(k, len(negs))
    if k == 0:
        return []
    g = sample_generator(seed, epoch, index, salt="negatives")
    order = torch.randperm(len(negs), generator=g)[:k]
    return [negs[int(i)] for i in order]


def split_bad(samples: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Separate good samples from bad markers; bad ones come back as (reason, path) pairs."""
    good = [s for s in samples if "bad" not in s]
    bad = [(str(s["bad"]), str(s.get("path", ""))) for s in samples if "bad" in s]
    return good, bad


ALL_BAD = 8
"""Samples that, all bad, stop a run before `BadSampleTracker.min_seen` were seen."""


class BadSampleTracker:
    """Counts bad samples by reason and stops the run when too many are bad.

    Single process: ``update(n_seen, bad)`` then ``check()``. Several ranks: each rank builds
    ``step_vector(n_seen, bad)``, the engine all-reduces (sums) it, and every rank calls
    ``merge_counts(summed, examples=local_bad)``; all ranks then hold the same counts, so
    ``check()`` raises on every rank at the same step (no rank is left waiting at a collective).
    """

    max_examples = 3

    def __init__(self, max_bad_fraction: float, min_seen: int = 50) -> None:
        if not 0.0 <= max_bad_fraction <= 1.0:
            raise ValueError(f"data.max_bad_fraction must be in [0, 1], got {max_bad_fraction}")
        if min_seen < 0:
            raise ValueError(f"min_seen must be >= 0, got {min_seen}")
        self.max_bad_fraction = float(max_bad_fraction)
        self.min_seen = int(min_seen)
        self.seen = 0
        self._counts: dict[str, int] = {}
        self._examples: dict[str, list[str]] = {}

    @property
    def total_bad(self) -> int:
        """All bad samples counted so far."""
        return sum(self._counts.values())

    def counts(self) -> dict[str, int]:
        """Bad-sample counts by reason (only reasons seen at least once)."""
        return dict(self._counts)

    def _note_examples(self, bad: Sequence[tuple[str, str]]) -> None:
        for reason, path in bad:
            ex = self._examples.setdefault(reason, [])
            if len(ex) < self.max_examples and path not in ex:
                ex.append(path)

    def update(self, n_seen: int, bad: Sequence[tuple[str, str]]) -> None:
        """Add `n_seen` samples looked at (good and bad); `bad` holds their (reason, path) pairs."""
        if n_seen < len(bad):
            raise ValueError(f"n_seen={n_seen} is smaller than the {len(bad)} bad samples given")
        self.seen += int(n_seen)
        for reason, _ in bad:
            self._counts[reason] = self._counts.get(reason, 0) + 1
        self._note_examples(bad)

    @staticmethod
    def step_vector(
        n_seen: int, bad: Sequence[tuple[str, str]], reasons: Sequence[str] = REASONS
    ) -> list[int]:
        """``[n_seen, count(reasons[0]), ...]`` for one step, ready to all-reduce as a sum."""
        index = {r: i for i, r in enumerate(reasons)}
        vec = [int(n_seen)] + [0] * len(reasons)
        for reason, _ in bad:
            if reason not in index:
                raise ValueError(f"bad-sample reason {reason!r} is not one of {tuple(reasons)}")
            vec[1 + index[reason]] += 1
        return vec

    def merge_counts(
        self,
        vector: Sequence[int],
        examples: Sequence[tuple[str, str]] = (),
        reasons: Sequence[str] = REASONS,
    ) -> None:
        """Add a (summed) `step_vector`; `examples` only feed the example paths in the error."""
        if len(vector) != len(reasons) + 1:
            raise ValueError(f"vector has {len(vector)} entries, expected {len(reasons) + 1}")
        self.seen += int(vector[0])
        for reason, n in zip(reasons, vector[1:], strict=True):
            if int(n):
                self._counts[reason] = self._counts.get(reason, 0) + int(n)
        self._note_examples(examples)

    def vector(self, reasons: Sequence[str] = REASONS) -> list[int]:
        """Cumulative ``[seen, count(reasons[0]), ...]``."""
        return [self.seen] + [self._counts.get(r, 0) for r in reasons]

    def check(self) -> None:
        """Raise DataQualityError if at least `min_seen` were seen and too many were bad, or
        if every one of at least `ALL_BAD` samples seen so far was (a short run on data whose
        images are all missing would otherwise finish, "best" an untrained model)."""
        if self.seen == 0:
            return
        all_bad = self.total_bad == self.seen >= ALL_BAD and self.max_bad_fraction < 1.0
        if self.seen < self.min_seen and not all_bad:
            return
        frac = self.total_bad / self.seen
        if frac <= self.max_bad_fraction and not all_bad:
            return
        lines = []
        for reason, n in sorted(self._counts.items(), key=lambda kv: -kv[1]):
            ex = ", ".join(self._examples.get(reason, [])) or "no local example"
            lines.append(f"  {reason}: {n} (e.g. {ex})")
        raise DataQualityError(
            f"{self.total_bad} of {self.seen} samples were bad ({frac:.1%}), above "
            f"data.max_bad_fraction={self.max_bad_fraction:g} ({self.max_bad_fraction:.1%}).\n"
            "Bad samples by reason:\n" + "\n".join(lines) + "\n"
            "Fix or remove these records, or, if this rate is expected, raise the limit with "
            f"data.max_bad_fraction=<value> (now {self.max_bad_fraction:g})."
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strings, safe for ``torch.load(weights_only=True)``."""
        return {
            "seen": self.seen,
            "counts": dict(self._counts),
            "examples": {r: list(p) for r, p in self._examples.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counts saved by `state_dict` (thresholds come from the current config)."""
        try:
            self.seen = int(state["seen"])
            self._counts = {str(r): int(n) for r, n in state["counts"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"not a BadSampleTracker state dict ({e!r}): {state!r}") from None
        examples = state.get("examples", {})
        self._examples = {str(r): [str(p) for p in ps] for r, ps in examples.items()}
