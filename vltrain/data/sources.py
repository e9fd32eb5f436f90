"""Where image-text records come from: one reader per kind of source, picked from the path.

`read_source(path)` accepts (docs/data_formats.md):

- ``.jsonl``: one record per line (`vltrain.data.records`).
- ``.json``: COCO captions (``images`` + ``annotations``).
- ``.csv``: a header row, then one row per (image, caption): columns ``image`` and ``caption``
  (or ``text``, or whatever ``data.text_column`` names), optional ``id``. Rows of the same image
  become one record with every caption, as in COCO.
- a folder holding exactly one captions file (``captions.jsonl``, ``captions.csv`` or
  ``captions.json``): that file, image paths relative to the folder.
- a ``datasets.save_to_disk`` folder, or a ``.parquet`` file: one row per image, images in
  ``data.image_column`` (an HF ``Image`` feature, raw bytes, or a path relative to the data
  folder), captions in ``data.text_column`` (str or list of str). Images stay in the
  memory-mapped table and are read row by row.
- a hub dataset, ``hf://datasets/org/name:split``: the same rows, read through the HF cache
  (`vltrain.core.hub`; the split is pinned when the config loads).

Every kind keeps the same safety rules: relative image paths are resolved inside the data folder
(`resolve_image_path`), and bad content never raises, it becomes a counted bad sample.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from vltrain.config.hub_ids import parse_dataset
from vltrain.core import hub
from vltrain.data.images import (
    BadSample,
    DecodedImages,
    decode_image_array,
    image_tensor,
    load_image_native,
)
from vltrain.data.readers import DataError, read_coco_captions, read_jsonl, resolve_image_path

#: file names that make a folder of images a data source, in lookup order
CAPTION_FILES = ("captions.jsonl", "captions.csv", "captions.json")
#: what `datasets.save_to_disk` writes (a Dataset, or a DatasetDict of splits)
HF_MARKERS = ("state.json", "dataset_dict.json")

Parse = Callable[[object, str, str], dict[str, Any]]


class ArrowImages:
    """Lazy image column of an HF dataset or parquet table: row -> bytes/path/dict value."""

    def __init__(self, table: Any, column: str) -> None:
        self.table, self.column = table, column

    def __call__(self, row: int) -> Any:
        return self.table[row][self.column]


@dataclass
class Source:
    """Records of one split plus where their images come from."""

    path: Path
    records: list[dict[str, Any]]
    images: ArrowImages | None = None
    """Row accessor for HF/parquet sources; None: ``record["image"]`` is a relative path."""
    decoded: DecodedImages | None = None
    """Decoded images kept in memory (``data.image_cache_mb``); None: decode every time."""

    @property
    def anchor(self) -> Path:
        """A path whose folder relative image paths are resolved against."""
        return self.path / "_" if self.path.is_dir() else self.path


# --------------------------------------------------------------------------------- readers


def read_csv_records(
    path: str | os.PathLike[str], image_column: str = "image", text_column: str = "text"
) -> list[dict[str, Any]]:
    """Records of a captions CSV (see module docstring); structural mistakes raise DataError."""
    records: dict[str, dict[str, Any]] = {}
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        text_col = next((c for c in (text_column, "caption", "text") if c in header), None)
        if image_column not in header or text_col is None:
            raise DataError(
                f"{path}:1: a captions CSV needs a header with columns {image_column!r} and "
                f"'caption' (or {text_column!r}); found {header}. Set data.image_column / "
                "data.text_column to use other names (`vltrain data shard`: --image-column / "
                "--text-column)."
            )
        try:
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if None in row or None in row.values():
                    raise DataError(
                        f"{where}: the row does not have the header's {len(header)} fields; "
                        "quote captions that contain commas."
                    )
                image = row[image_column].strip()
                rec = records.setdefault(
                    image,
                    {"image": image, "text": [], "negatives": [], "id": row.get("id") or image},
                )
                rec["text"].append(row[text_col])  # empty captions -> bad_text, counted later
        except csv.Error as e:
            raise DataError(f"{path}:{reader.line_num}: not valid CSV ({e}).") from None
    return list(records.values())


def merge_repeated_images(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per image path, in first-seen order: a file with one line per caption
    (the same image on several lines) evaluates as the image with all its captions, as a CSV
    does (each line its own image would tie the copies in image retrieval and count another
    line's caption of the same image as a miss). Captions and negatives are concatenated in
    file order; ``negative_kinds`` and ``caption_negatives`` stay where every merged line
    has them. Records of a table (an int row, not a path) are left as they are."""
    merged: dict[str, dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for rec in records:
        key = rec["image"]
        first = merged.get(key) if isinstance(key, str) else None
        if first is None:
            rec = dict(rec)
            if isinstance(key, str):
                merged[key] = rec
            out.append(rec)
            continue
        first["text"] = [*first["text"], *rec["text"]]
        for extra in ("negative_kinds", "caption_negatives"):
            if isinstance(first.get(extra), list) and isinstance(rec.get(extra), list):
                first[extra] = [*first[extra], *rec[extra]]
            else:
                first.pop(extra, None)
        first["negatives"] = [*first["negatives"], *rec["negatives"]]
    return out


def _hf_rows(source: str | os.PathLike[str], image_column: str, text_column: str) -> Any:
    """An HF Dataset (images left undecoded) from a save_to_disk folder, a parquet file or a
    hub dataset (``hf://datasets/org/name:split``)."""
    import datasets

    path = Path(source)
    if parse_dataset(str(source)) is not None:
        ds, _ = hub.load_dataset(str(source))
    elif path.is_dir():
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
            f"{source}: no column(s) {missing} (columns: {ds.column_names}); set "
            "data.image_column / data.text_column (`vltrain data shard`: --image-column / "
            "--text-column)"
        )
    if isinstance(ds.features[image_column], datasets.Image):
        ds = ds.cast_column(image_column, datasets.Image(decode=False))
    return ds


def read_hf_records(
    path: str | os.PathLike[str], image_column: str, text_column: str
) -> tuple[list[dict[str, Any]], ArrowImages]:
    """Text records (one per row) and a lazy accessor for the images of an HF dataset."""
    ds = _hf_rows(path, image_column, text_column)
    ids = ds["id"] if "id" in ds.column_names else range(len(ds))
    records = []
    for row, (text, rid) in enumerate(zip(ds[text_column], ids, strict=True)):
        texts = list(text) if isinstance(text, list) else [text]
        records.append({"image": row, "text": texts, "negatives": [], "id": str(rid)})
    return records, ArrowImages(ds, image_column)


def is_record_folder(folder: Path) -> bool:
    """A folder `read_source` reads: images with a captions file, or a datasets folder."""
    return any((folder / n).is_file() for n in (*CAPTION_FILES, *HF_MARKERS))


def captions_file(folder: Path) -> Path | None:
    """The one captions file of an image folder, None when it has none."""
    found = [folder / n for n in CAPTION_FILES if (folder / n).is_file()]
    if len(found) > 1:
        raise DataError(
            f"{folder} holds {len(found)} captions files ({', '.join(p.name for p in found)}); "
            "keep one, or point data.train / data.eval at the file to use."
        )
    return found[0] if found else None


def read_source(
    path: str | os.PathLike[str],
    image_column: str = "image",
    text_column: str = "text",
    parse: Parse | None = None,
) -> Source:
    """Read any supported source (module docstring). `parse` turns one JSONL object into a
    record (default `readers.normalise_record`; the caption stage also accepts chat records)."""
    if not str(path).strip():
        raise DataError("a data path is empty; set data.train / data.eval to a file or folder")
    if (hub_id := parse_dataset(str(path))) is not None:
        if hub_id[1] is None:
            raise DataError(f"{path}: name the split to read, as {path}:SPLIT (e.g. train)")
        snapshot = hub.cached_snapshot(hub_id[0], "dataset")
        return Source(snapshot or Path(path), *read_hf_records(path, image_column, text_column))
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {p} does not exist; check data.train / data.eval.")
    if p.is_dir():
        captions = captions_file(p)
        if captions is not None:
            return read_source(captions, image_column, text_column, parse)
        if not any((p / m).is_file() for m in HF_MARKERS):
            raise DataError(
                f"{p} is a folder without a captions file ({', '.join(CAPTION_FILES)}) and is not "
                "a datasets.save_to_disk folder; add a captions file next to the images or point "
                "at a data file."
            )
        return Source(p, *read_hf_records(p, image_column, text_column))
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        return Source(p, *read_hf_records(p, image_column, text_column))
    if suffix == ".jsonl":
        return Source(p, read_jsonl(p, parse))
    if suffix == ".json":
        return Source(p, read_coco_captions(p))
    if suffix == ".csv":
        return Source(p, read_csv_records(p, image_column, text_column))
    raise DataError(
        f"{p}: unsupported data file suffix {suffix!r}; use .jsonl (one record per line), "
        ".json (COCO captions), .csv (image,caption), .parquet, a datasets.save_to_disk folder, "
        "or a folder of images with a captions file."
    )


# --------------------------------------------------------------------------------- images


def load_source_image(
    source: Source,
    image: Any,
    size: int,
    label: str,
    native: bool = False,
    max_pixels: int | None = None,
) -> Any:
    """The image of a record (`image` is its ``record["image"]``): a (3, size, size) tensor, or
    with `native` an RGB PIL image at its own size; BadSample for anything unusable.

    With ``source.decoded`` set, a sized image decodes (and its path is checked) once per
    process and later calls read the kept pixels."""
    if native:
        return _load(source, image, size, label, native, max_pixels)
    if source.decoded is None:
        return image_tensor(_load(source, image, size, label, native, max_pixels))
    key = (image if isinstance(image, (str, int)) else repr(image), size)
    arr = source.decoded.get(key)
    if arr is None:
        arr = _load(source, image, size, label, native, max_pixels)
        source.decoded.put(key, arr)
    return image_tensor(arr)


def _load(
    source: Source, image: Any, size: int, label: str, native: bool, max_pixels: int | None
) -> Any:
    """`load_source_image` without the cache: a PIL image (native) or a decoded array."""
    value = source.images(image) if source.images is not None else image
    kw = {} if max_pixels is None else {"max_pixels": max_pixels}

    def decode(path: str | os.PathLike[str], data: bytes | None = None) -> Any:
        if native:
            return load_image_native(path, data=data, **kw)
        return decode_image_array(path, size, data=data, **kw)

    if isinstance(value, dict):  # HF Image storage; its absolute paths are HF's own choice
        path = value.get("path")
        if not value.get("bytes") and isinstance(path, str) and os.path.isabs(path):
            return decode(path)
        value = value.get("bytes") or path
    if isinstance(value, (bytes, bytearray, memoryview)):
        return decode(label, bytes(value))
    if isinstance(value, str):
        return decode(resolve_image_path(source.anchor, value))
    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return decode(label, buf.getvalue())
    raise BadSample("missing", label, f"no usable image value ({type(value).__name__})")
