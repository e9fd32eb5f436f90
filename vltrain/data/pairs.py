"""Embedding-pair records: a query, one or more positives and hard negatives, each side text,
image, image+text, or a document id into a corpus file.

Record (one JSON object per JSONL line)::

    {"query": {"text": "..."}, "positive": {"image": "pages/1.png"} or [...],
     "negatives": [{"image": "pages/7.png"}, {"doc": "d42"}, "a text negative"],
     "instruction": "Find the page that ...", "id": "q1"}

A side is a string (a text), ``{"text"?, "image"?}`` (at least one; an image side may list the
words drawn on it, ``"words": [[text, x0, y0, x1, y1], ...]`` in fractions of the image, for
`objective.reading`, see `vltrain.data.reading`), or ``{"doc": ID}`` naming a row of the corpus
file (BEIR ``corpus.jsonl``: ``{"_id", "text"?, "image"?}``). ``positives``
may replace ``positive``. The image-caption format ``{"image", "text", "negatives"}`` is read
as the special case query = image, positives = the captions, negatives = texts.

Structural mistakes raise `DataError` naming ``file:line``. Content problems (a missing or
broken image, an empty text, a path that escapes the folder of the file that names it) make
the dataset return a bad-sample marker, as `ImageTextDataset` does. Within one file each role
(query, positive, negatives) has one modality, so a batch side is one encoder call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vltrain.config.core import ConfigError
from vltrain.data.batches import PairBatch
from vltrain.data.images import (
    DEFAULT_MAX_PIXELS,
    BadSample,
    check_text,
    load_image,
    load_image_native,
)
from vltrain.data.readers import DataError, normalise_record, read_jsonl, resolve_image_path
from vltrain.data.reading import ReadingTargets, parse_words
from vltrain.data.records import as_key
from vltrain.data.rng import sample_generator

ROLES = ("query", "positive", "negatives")
#: what one side holds; `image_text` is one interleaved input (VLM embedders only)
MODALITIES = ("text", "image", "image_text")
Side = dict[str, Any]  # {"text": str | None, "image": str | None, "base": data file path, "words"?}


def check_side_modality(kind: str, role: str, modality: str | None, where: str) -> None:
    """Dual encoders (built-in, hf_clip, hf_siglip: `model.kind`) encode one modality per side;
    only a VLM embedder encodes an image+text side."""
    if modality == "image_text" and kind != "vlm":
        raise ConfigError(
            f"{where}: the {role} sides hold image+text, but model.kind={kind} encodes an image "
            "or a text per side; use model.kind=vlm, or drop one of the two from those sides"
        )


def modality(side: Side) -> str:
    """`text`, `image` or `image_text` of a parsed side."""
    if side["image"] is not None and side["text"] is not None:
        return "image_text"
    return "image" if side["image"] is not None else "text"


def parse_side(obj: object, where: str, base: str) -> Side:
    """One side of a record: a string, {"text"?, "image"?} or {"doc": id} (resolved later)."""
    if isinstance(obj, str):
        return {"text": obj, "image": None, "doc": None, "base": base}
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a side must be a string or an object, got {obj!r}")
    unknown = set(obj) - {"text", "image", "doc", "words", "_id", "id"}
    if unknown:
        raise DataError(
            f"{where}: unknown side key(s) {sorted(unknown)}; use text, image, words, doc"
        )
    if "doc" in obj:
        return {"text": None, "image": None, "doc": str(obj["doc"]), "base": base}
    if "image" in obj and not isinstance(obj["image"], str):
        raise DataError(f"{where}: 'image' must be a path string, got {obj['image']!r}")
    if obj.get("text") is None and obj.get("image") is None:
        raise DataError(f"{where}: a side needs 'text', 'image' (or both) or 'doc', got {obj!r}")
    side = {"text": obj.get("text"), "image": obj.get("image"), "doc": None, "base": base}
    if "words" in obj:
        if obj.get("image") is None:
            raise DataError(f"{where}: 'words' lists the words drawn on an image; add 'image'")
        side["words"] = parse_words(obj["words"], where)
    return side


def _side_list(obj: object, where: str, base: str) -> list[Side]:
    items = obj if isinstance(obj, list) else [obj]
    return [parse_side(x, where, base) for x in items]


def normalise_pair_record(obj: object, where: str, default_id: str, base: str) -> dict[str, Any]:
    """``{"query": Side, "positives": [Side], "negatives": [Side], "instruction", "id"}``."""
    if isinstance(obj, dict) and "query" not in obj and "image" in obj:
        rec = normalise_record(obj, where, default_id)  # the image-caption special case
        return {
            "query": {"text": None, "image": rec["image"], "doc": None, "base": base},
            "positives": [parse_side(t, where, base) for t in rec["text"]],
            "negatives": [parse_side(t, where, base) for t in rec["negatives"]],
            "instruction": "",
            "id": rec["id"],
        }
    if not isinstance(obj, dict) or "query" not in obj:
        raise DataError(f"{where}: expected {{'query': ..., 'positive': ...}}, got {obj!r:.120}")
    pos = obj.get("positives", obj.get("positive"))
    if pos is None or pos == []:
        raise DataError(f"{where}: record has no 'positive' (or 'positives')")
    negatives = obj.get("negatives", [])
    if not isinstance(negatives, list):
        raise DataError(f"{where}: 'negatives' must be a list of sides, got {negatives!r:.80}")
    instruction = obj.get("instruction", "")
    if not isinstance(instruction, str):
        raise DataError(f"{where}: 'instruction' must be a string, got {instruction!r}")
    rid = obj.get("id")
    return {
        "query": parse_side(obj["query"], where, base),
        "positives": _side_list(pos, where, base),
        "negatives": _side_list(negatives, where, base),
        "instruction": instruction,
        "id": str(rid) if rid is not None else default_id,
    }


def is_pair_file(path: str | os.PathLike[str]) -> bool:
    """True when the first record of a JSONL file has a 'query' (the pair format)."""
    if Path(path).suffix.lower() != ".jsonl" or not Path(path).is_file():
        return False
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(obj := json.loads(line), dict) and "query" in obj
                except json.JSONDecodeError:
                    return False
    return False


def read_corpus(path: str | os.PathLike[str]) -> dict[str, Side]:
    """BEIR corpus.jsonl / queries.jsonl (``{"_id", "text"?, "title"?, "image"?,
    "instruction"?, "group"?}``) -> id -> side, in file order; image paths are relative to the
    file. Other keys are ignored."""
    base = str(path)

    def parse(obj: object, where: str, _default: str) -> dict[str, Any]:
        if not isinstance(obj, dict) or "_id" not in obj:
            raise DataError(f"{where}: a corpus row needs '_id', got {obj!r:.120}")
        text = obj.get("text")
        if obj.get("title") and text is not None:
            text = f"{obj['title']} {text}"
        fields = {"text": text, "image": obj.get("image"), "words": obj.get("words")}
        side = parse_side({k: v for k, v in fields.items() if v is not None}, where, base)
        side["instruction"] = str(obj.get("instruction") or "")  # queries may carry one
        if "group" in obj:  # a query's kind, for metrics per group (`vltrain.eval.corpus`)
            if not isinstance(obj["group"], str) or not obj["group"]:
                raise DataError(
                    f"{where}: 'group' must be a non-empty string, got {obj['group']!r}"
                )
            side["group"] = obj["group"]
        return {"_id": str(obj["_id"]), "side": side}

    out: dict[str, Side] = {}
    for row in read_jsonl(path, parse):
        if row["_id"] in out:
            raise DataError(f"{path}: id {row['_id']!r} appears twice (ids must be unique)")
        out[row["_id"]] = row["side"]
    return out


def read_pair_records(
    path: str | os.PathLike[str], corpus: dict[str, Side] | None = None
) -> list[dict[str, Any]]:
    """Records of a pair (or image-caption) JSONL file, ``{"doc": id}`` sides resolved."""
    base = str(path)
    records = read_jsonl(path, lambda o, w, d: normalise_pair_record(o, w, d, base))

    def resolve(side: Side, i: int) -> Side:
        if side["doc"] is None:
            return side
        if corpus is None or side["doc"] not in corpus:
            raise DataError(
                f"{path}: record {i + 1} names document {side['doc']!r}, which is not in the "
                "corpus (set data.train_corpus to the corpus.jsonl it refers to)"
            )
        return {**corpus[side["doc"]], "doc": side["doc"]}

    for i, rec in enumerate(records):
        rec["query"] = resolve(rec["query"], i)
        rec["positives"] = [resolve(s, i) for s in rec["positives"]]
        rec["negatives"] = [resolve(s, i) for s in rec["negatives"]]
    return records


def role_modalities(records: list[dict[str, Any]], where: str) -> dict[str, str | None]:
    """The one modality of each role in `records` (None: no record has that role)."""
    seen: dict[str, set[str]] = {r: set() for r in ROLES}
    for rec in records:
        seen["query"].add(modality(rec["query"]))
        seen["positive"].update(modality(s) for s in rec["positives"])
        seen["negatives"].update(modality(s) for s in rec["negatives"])
    out: dict[str, str | None] = {}
    for role, kinds in seen.items():
        if len(kinds) > 1:
            raise DataError(
                f"{where}: the {role} sides mix modalities {sorted(kinds)}; within one file each "
                "role has one modality (split the file by task)"
            )
        out[role] = next(iter(kinds)) if kinds else None
    return out


def load_side(side: Side, image_size: int, native: bool, max_pixels: int, label: str) -> Side:
    """A side with its image decoded (PIL when `native`, else (3, S, S)); raises BadSample."""
    text = None if side["text"] is None else check_text(side["text"], label)
    image = None
    if side["image"] is not None:
        path = resolve_image_path(side["base"], side["image"])
        image = (
            load_image_native(path, max_pixels)
            if native
            else load_image(path, image_size, max_pixels)
        )
    return {"text": text, "image": image, "words": side.get("words")}


class PairDataset(Dataset):
    """Pair records; `__getitem__` returns a bad-sample marker instead of raising.

    Train: one positive and up to `hard_negatives` negatives drawn from ``sample_generator(seed,
    epoch, index)``. Eval (``train=False``): every positive, the first `hard_negatives`
    negatives in file order.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        image_size: int,
        seed: int,
        hard_negatives: int = 0,
        train: bool = True,
        native: bool = False,
        corpus: str | os.PathLike[str] = "",
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.path, self.image_size, self.seed = Path(path), image_size, seed
        self.hard_negatives, self.train, self.native = hard_negatives, train, native
        self.max_pixels = max_pixels
        self.records = read_pair_records(path, read_corpus(corpus) if corpus else None)
        self.modalities = role_modalities(self.records, str(path))

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, key: Any) -> dict[str, Any]:
        epoch, _, index = as_key(key)
        if not 0 <= index < len(self.records):
            raise IndexError(f"index {index} out of range for {len(self.records)} records")
        rec = self.records[index]
        try:
            return self._sample(rec, epoch, index, key)
        except BadSample as e:
            return {"bad": e.reason, "path": e.path, "detail": e.detail, "key": key, "index": index}

    def _sample(self, rec: dict[str, Any], epoch: int, index: int, key: Any) -> dict[str, Any]:
        label = f"{self.path}:id={rec['id']}"

        def load(side: Side) -> Side:
            return load_side(side, self.image_size, self.native, self.max_pixels, label)

        positives, negatives = rec["positives"], rec["negatives"]
        if self.train:
            g = sample_generator(self.seed, epoch, index, salt="caption")
            positives = [positives[int(torch.randint(len(positives), (1,), generator=g))]]
            k = min(self.hard_negatives, len(negatives))
            g = sample_generator(self.seed, epoch, index, salt="negatives")
            negatives = [negatives[int(i)] for i in torch.randperm(len(negatives), generator=g)[:k]]
        else:
            negatives = negatives[: self.hard_negatives]
        return {
            "query": load(rec["query"]),
            "positives": [load(s) for s in positives],
            "negatives": [load(s) for s in negatives],
            "instruction": rec["instruction"],
            "index": index,
            "key": key,
        }


def side_texts(records: list[dict[str, Any]]) -> list[str]:
    """Every text on any side (e.g. to train a BPE tokenizer); bad texts are left out later."""
    out = []
    for rec in records:
        for side in [rec["query"], *rec["positives"], *rec["negatives"]]:
            if isinstance(side["text"], str) and side["text"]:
                out.append(side["text"])
    return out


class PairCollate:
    """Samples of `PairDataset` -> ``{"query", "positive", "negatives"?: {"modality",
    "inputs"}, "index", "visual_tokens"?, "reading"?}`` through a backbone batcher (see
    `side_inputs`); with `reading`, the reading targets of the positive images and then of the
    image negatives, (B + M, P) (or (B + M, 2, P) with next tokens)."""

    def __init__(
        self,
        batcher: Any,
        modalities: dict[str, str | None],
        reading: ReadingTargets | None = None,
    ) -> None:
        self.batcher, self.modalities, self.reading = batcher, modalities, reading

    def __call__(self, samples: list[dict[str, Any]]) -> PairBatch:
        instr = [s["instruction"] for s in samples]
        q, q_tok = side_inputs(
            self.batcher, "query", self.modalities["query"], [s["query"] for s in samples], instr
        )
        p, p_tok = side_inputs(
            self.batcher, "doc", self.modalities["positive"], [s["positives"][0] for s in samples]
        )
        batch: PairBatch = {
            "query": {"modality": self.modalities["query"], "inputs": q},
            "positive": {"modality": self.modalities["positive"], "inputs": p},
            "index": torch.tensor([s["index"] for s in samples]),
        }
        tokens = [t for t in (q_tok, p_tok) if t is not None]
        negs = [n for s in samples for n in s["negatives"]]
        if negs:
            n, n_tok = side_inputs(self.batcher, "doc", self.modalities["negatives"], negs)
            batch["negatives"] = {"modality": self.modalities["negatives"], "inputs": n}
            tokens += [n_tok] if n_tok is not None else []
        if tokens:
            batch["visual_tokens"] = torch.cat(tokens)
        if self.reading is not None:  # positives first, then image negatives (B + M, ...)
            words = [s["positives"][0].get("words") for s in samples]
            if negs and self.modalities["negatives"] == "image":
                words += [n.get("words") for n in negs]
            batch["reading"] = self.reading(words)
        return batch


def side_inputs(
    batcher: Any,
    role: str,
    kind: str | None,
    sides: list[Side],
    instructions: list[str] | None = None,
) -> tuple[Any, torch.Tensor | None]:
    """Model inputs of one side of a batch, and per-image visual-token counts (None: no image).

    `role` is ``query`` or ``doc`` (which default instruction a VLM prompt gets);
    `instructions` (per row, '' = the default) are the records' own.
    """
    if kind == "text":
        return batcher.text_batch([s["text"] for s in sides], instructions, role), None
    if kind == "image":
        return batcher.image_batch([s["image"] for s in sides], None, instructions, role)
    if kind == "image_text":
        texts = [s["text"] for s in sides]
        return batcher.image_batch([s["image"] for s in sides], texts, instructions, role)
    raise ValueError(f"unknown side modality {kind!r}; known: {MODALITIES}")


def encode_side(encoder: Any, modality: str, inputs: Any) -> Tensor:
    """Unit-norm embeddings (B, E) of one side's `side_inputs`: texts through the encoder's
    `encode_text`, images and interleaved image+text prompts (VLMs) through `encode_image`."""
    if modality == "text":
        return encoder.encode_text(*inputs)
    return encoder.encode_image(inputs)
