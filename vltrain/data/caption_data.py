"""Caption and chat records from JSONL, COCO json, HF `datasets` folders and parquet files.

Sources (picked by `read_caption_source` from the path: a folder, or its suffix):

- ``.jsonl``: one record per line, either a caption record ``{"image": "rel.png", "text": str or
  [str, ...], "id": ...}`` or a chat record ``{"image": ..., "messages": [{"role": "user",
  "content": ...}, {"role": "assistant", "content": ...}, ...]}`` (both may mix in one file).
- ``.json``: COCO captions (``images`` + ``annotations``), one record per image.
- a folder written by ``datasets.Dataset.save_to_disk`` (read with ``load_from_disk``), or a
  ``.parquet`` file: one row per image, images in ``data.image_column`` (an HF ``Image``
  feature, raw bytes, or a path relative to the data folder), captions in
  ``data.text_column`` (str or list of str). Images stay in the memory-mapped table and are
  read row by row.

`CaptionDataset` turns a record into token ids and loss labels (see `vltrain.data.chat`). A
training sample draws one caption from ``sample_generator(seed, epoch, index)``; an eval sample
keeps every reference. Bad content (undecodable image, empty caption) never raises: it becomes
the marker dict ``{"bad": reason, ...}`` that the engine drops and counts.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset

from vltrain.data import chat as C
from vltrain.data.images import (
    _MAGIC,
    DEFAULT_MAX_PIXELS,
    BadSample,
    _decode,
    _to_rgb_or_float,
    check_text,
    load_image,
)
from vltrain.data.records import (
    DataError,
    as_key,
    normalise_record,
    read_coco_captions,
    read_jsonl,
    resolve_image_path,
)
from vltrain.data.rng import sample_generator
from vltrain.data.tokenizer import TextTokenizer

MODES = ("pretrain", "finetune", "sft")


# --------------------------------------------------------------------------------- readers


def read_caption_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Caption and chat records of a JSONL file; structural mistakes raise DataError."""
    return read_jsonl(path, parse=_caption_or_chat)


def _caption_or_chat(obj: object, where: str, default_id: str) -> dict[str, Any]:
    if isinstance(obj, dict) and "messages" in obj:
        return _chat_record(obj, where, default_id)
    return normalise_record(obj, where, default_id)


def _chat_record(obj: dict[str, Any], where: str, default_id: str) -> dict[str, Any]:
    if not isinstance(obj.get("image"), str):
        raise DataError(f"{where}: a chat record needs an 'image' path string, got {obj!r}")
    try:
        messages = C.check_messages(obj["messages"], where)
    except ValueError as e:
        raise DataError(str(e)) from None
    rid = str(obj["id"]) if obj.get("id") is not None else default_id
    return {"image": obj["image"], "messages": messages, "id": rid}


class ArrowImages:
    """Lazy image column of an HF dataset or parquet table: row -> bytes/path/dict value."""

    def __init__(self, table: Any, column: str) -> None:
        self.table, self.column = table, column

    def __call__(self, row: int) -> Any:
        return self.table[row][self.column]


def _hf_rows(path: Path, image_column: str, text_column: str) -> Any:
    """An HF Dataset (images left undecoded) from a save_to_disk folder or a parquet file."""
    import datasets

    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(
                f"{path} holds a DatasetDict with splits {list(ds)}; point data.train / "
                f"data.eval at one split folder, e.g. {path / next(iter(ds))}"
            )
    else:
        import pyarrow.parquet as pq

        ds = datasets.Dataset(pq.read_table(str(path)))
    missing = [c for c in (image_column, text_column) if c not in ds.column_names]
    if missing:
        raise DataError(
            f"{path}: no column(s) {missing} (columns: {ds.column_names}); set "
            "data.image_column / data.text_column"
        )
    if isinstance(ds.features[image_column], datasets.Image):
        ds = ds.cast_column(image_column, datasets.Image(decode=False))
    return ds


def read_hf_records(
    path: str | os.PathLike[str], image_column: str, text_column: str
) -> tuple[list[dict[str, Any]], ArrowImages]:
    """Text records (one per row) and a lazy accessor for the images of an HF dataset."""
    p = Path(path)
    ds = _hf_rows(p, image_column, text_column)
    ids = ds["id"] if "id" in ds.column_names else range(len(ds))
    records = []
    for row, (text, rid) in enumerate(zip(ds[text_column], ids, strict=True)):
        texts = list(text) if isinstance(text, list) else [text]
        records.append({"image": row, "text": texts, "id": str(rid)})
    return records, ArrowImages(ds, image_column)


@dataclass
class CaptionSource:
    """Records of one split plus where their images come from."""

    path: Path
    records: list[dict[str, Any]]
    images: ArrowImages | None = None
    """Row accessor for HF/parquet sources; None: ``record["image"]`` is a relative path."""


def read_caption_source(
    path: str | os.PathLike[str], image_column: str = "image", text_column: str = "text"
) -> CaptionSource:
    """Read any supported caption source (see module docstring)."""
    p = Path(path)
    if p.is_dir() or p.suffix.lower() == ".parquet":
        if not p.exists():
            raise DataError(f"data file {p} does not exist; check data.train / data.eval.")
        return CaptionSource(p, *read_hf_records(p, image_column, text_column))
    if not p.is_file():
        raise DataError(f"data file {p} does not exist; check data.train / data.eval.")
    readers = {".jsonl": read_caption_jsonl, ".json": read_coco_captions}
    reader = readers.get(p.suffix.lower())
    if reader is None:
        raise DataError(
            f"{p}: unsupported data source; use .jsonl, COCO .json, .parquet or a "
            "datasets.save_to_disk folder"
        )
    return CaptionSource(p, reader(p))


# --------------------------------------------------------------------------------- images


def load_image_bytes(
    data: bytes, size: int, label: str, max_pixels: int = DEFAULT_MAX_PIXELS
) -> torch.Tensor:
    """`load_image` for in-memory bytes: (3, size, size) float32 in [0, 1], or BadSample."""
    if not data:
        raise BadSample("empty_file", label, "image has 0 bytes")
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise BadSample("decompression_bomb", label, str(e)) from None
    except Exception as e:
        reason = "corrupt" if bytes(data[:16]).startswith(_MAGIC) else "not_image"
        raise BadSample(reason, label, f"cannot identify image: {type(e).__name__}") from None
    try:
        _decode(img, label, max_pixels, size)
        try:
            img = ImageOps.exif_transpose(img)
        except Exception:
            pass  # malformed EXIF: keep the pixels, skip the rotation
        img = _to_rgb_or_float(img)
    except BadSample:
        raise
    except Exception as e:
        raise BadSample("corrupt", label, f"cannot convert image: {e}") from None
    img = img.resize((size, size), Image.Resampling.BICUBIC) if img.size != (size, size) else img
    if img.mode == "F":
        arr = np.clip(np.asarray(img, dtype=np.float32), 0.0, 1.0)  # (S, S)
        return torch.from_numpy(np.repeat(arr[None], 3, axis=0))  # (3, S, S)
    arr = np.asarray(img, dtype=np.uint8).transpose(2, 0, 1)  # (3, S, S)
    return torch.from_numpy(np.divide(arr, np.float32(255.0), dtype=np.float32, order="C"))


def _load_any(value: Any, source: CaptionSource, size: int, label: str) -> torch.Tensor:
    """Decode an image given as a relative path, raw bytes, an HF {bytes, path} dict or PIL."""
    if isinstance(value, dict):  # HF Image storage; its absolute paths are HF's own choice
        path = value.get("path")
        if not value.get("bytes") and isinstance(path, str) and os.path.isabs(path):
            return load_image(path, size)
        value = value.get("bytes") or path
    if isinstance(value, (bytes, bytearray, memoryview)):
        return load_image_bytes(bytes(value), size, label)
    if isinstance(value, str):
        anchor = source.path / "_" if source.path.is_dir() else source.path  # its folder
        return load_image(resolve_image_path(anchor, value), size)
    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return load_image_bytes(buf.getvalue(), size, label)
    raise BadSample("missing", label, f"no usable image value ({type(value).__name__})")


# --------------------------------------------------------------------------------- dataset


class CaptionDataset(Dataset):
    """Image + token ids + labels for the caption stage; never raises for bad content.

    Train sample: ``{"image", "input_ids", "labels", "index", "key"}`` with one caption drawn
    per (seed, epoch, index). Eval sample adds ``prompt_ids`` (what decoding starts from) and
    ``refs`` (every reference), and scores the loss on the first caption.
    """

    def __init__(
        self,
        source: CaptionSource,
        tokenizer: TextTokenizer,
        *,
        image_size: int,
        max_len: int,
        seed: int,
        mode: str = "pretrain",
        prompt: str = "",
        instruction: str = "describe the image.",
        train: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "sft" and any("messages" in r for r in source.records):
            raise DataError(
                f"{source.path} holds chat records ('messages'); train them with caption.mode=sft"
            )
        self.source, self.tokenizer = source, tokenizer
        self.image_size, self.max_len, self.seed = image_size, max_len, seed
        self.mode, self.prompt, self.instruction, self.train = mode, prompt, instruction, train

    @property
    def records(self) -> list[dict[str, Any]]:
        """The records (assignable, e.g. to keep only the first N)."""
        return self.source.records

    @records.setter
    def records(self, value: list[dict[str, Any]]) -> None:
        self.source.records = value

    def __len__(self) -> int:
        return len(self.source.records)

    def _label(self, rec: dict[str, Any]) -> str:
        return f"{self.source.path}:id={rec['id']}"

    def segments(self, rec: dict[str, Any], caption: str | None = None) -> list[C.Segment]:
        """Training segments of a record (``caption``: which caption; default the first)."""
        label = self._label(rec)
        if "messages" in rec:
            return C.chat_segments(rec["messages"], label)
        if not rec["text"]:
            raise BadSample("bad_text", label, "record has no captions")
        caption = check_text(rec["text"][0] if caption is None else caption, label)
        if self.mode == "sft":
            return C.instruction_segments(caption, self.instruction)
        return C.caption_segments(caption, self.prompt)

    def prompt_and_refs(self, rec: dict[str, Any]) -> tuple[list[C.Segment], list[str]]:
        """What decoding starts from, and the references its output is scored against."""
        label = self._label(rec)
        if "messages" in rec:
            prompt, ref = C.chat_prompt_and_reference(rec["messages"], label)
            return prompt, [ref]
        refs = [check_text(t, label) for t in rec["text"]]
        if not refs:
            raise BadSample("bad_text", label, "record has no captions")
        if self.mode == "sft":
            return [(f"{C.USER} {self.instruction}", False), (C.ASSISTANT, False)], refs
        return ([(self.prompt, False)] if self.prompt else []), refs

    def token_length(self, index: int) -> int:
        """Tokens of the record's first caption (or its chat); 1 for a record with bad text."""
        try:
            segs = self.segments(self.source.records[index])
        except BadSample:
            return 1
        return len(C.encode_segments(self.tokenizer, segs, self.max_len)[0])

    def __getitem__(self, key: Any) -> dict[str, Any]:
        epoch, _, index = as_key(key)
        if not 0 <= index < len(self.source.records):
            raise IndexError(f"index {index} out of range for {len(self.source.records)} records")
        rec = self.source.records[index]
        try:
            return self._sample(rec, epoch, index, key)
        except BadSample as e:
            where = e.path or str(rec["image"])
            return {"bad": e.reason, "path": where, "detail": e.detail, "key": key, "index": index}

    def _sample(self, rec: dict[str, Any], epoch: int, index: int, key: Any) -> dict[str, Any]:
        caption = None
        if self.train and "messages" not in rec and len(rec["text"]) > 1:
            g = sample_generator(self.seed, epoch, index, salt="caption")
            caption = rec["text"][int(torch.randint(len(rec["text"]), (1,), generator=g))]
        segs = self.segments(rec, caption)
        out: dict[str, Any] = {"index": index, "key": key}
        if not self.train:
            prompt, out["refs"] = self.prompt_and_refs(rec)
            out["prompt_ids"] = C.encode_prompt(self.tokenizer, prompt)
        out["input_ids"], out["labels"] = C.encode_segments(self.tokenizer, segs, self.max_len)
        value = self.source.images(rec["image"]) if self.source.images else rec["image"]
        out["image"] = _load_any(value, self.source, self.image_size, self._label(rec))
        return out


def training_texts(source: CaptionSource, prompt: str, instruction: str) -> list[str]:
    """Every text the tokenizer should learn from (captions, prompts, chat turns, markers).

    The chat markers are included in every mode, so a tokenizer trained for pretraining keeps
    the template short when the run is later continued with SFT (init_from reuses it).
    """
    texts: list[str] = []
    extra = [prompt] if prompt else []
    extra += [f"{C.USER} {instruction}", C.ASSISTANT]
    for rec in source.records:
        if "messages" in rec:
            texts += [str(m["content"]) for m in rec["messages"] if isinstance(m["content"], str)]
        else:
            texts += [t for t in rec["text"] if isinstance(t, str)]
    return texts + extra * len(source.records)  # as frequent as in training
