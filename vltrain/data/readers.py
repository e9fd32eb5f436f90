"""The readers under every data source: JSONL and COCO captions files, record normalisation,
safe resolution of a record's image path against its data file's folder.

`vltrain.data.sources` builds every source on these; `vltrain.data.records` builds the dataset.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vltrain.data.images import BadSample


class DataError(ValueError):
    """A data file is malformed; the message names the file, the line and the fix."""


def normalise_record(obj: object, where: str, default_id: str) -> dict[str, Any]:
    """Check one record's structure and normalise `text`/`negatives`/`id`."""
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
    if "image" not in obj or "text" not in obj:
        missing = [k for k in ("image", "text") if k not in obj]
        raise DataError(
            f"{where}: record has no {' or '.join(repr(k) for k in missing)} key (keys: "
            f'{sorted(obj)}). Each line needs {{"image": "rel/path.png", "text": ...}}.'
        )
    if not isinstance(obj["image"], str):
        raise DataError(f"{where}: 'image' must be a path string, got {obj['image']!r}.")
    text = obj["text"]
    texts = list(text) if isinstance(text, list) else [text]  # bad items -> bad_text later
    negatives = obj.get("negatives", [])
    if not isinstance(negatives, list):
        raise DataError(f"{where}: 'negatives' must be a list of strings, got {negatives!r}.")
    per_caption = obj.get("caption_negatives")
    if not caption_negatives_fit(per_caption, len(texts)):
        raise DataError(
            f"{where}: 'caption_negatives' must be a list with one list of negative captions per "
            f"caption ({len(texts)} here), got {per_caption!r:.120}. A script that edits 'text' "
            "must edit it alike (or drop it)."
        )
    rec = dict(obj)
    rec["text"] = texts
    rec["negatives"] = list(negatives)
    rec["id"] = str(obj["id"]) if obj.get("id") is not None else default_id
    return rec


def caption_negatives_fit(per_caption: object, n_captions: int) -> bool:
    """Whether a record's ``caption_negatives`` is absent or one list per caption."""
    return per_caption is None or (
        isinstance(per_caption, list)
        and len(per_caption) == n_captions
        and all(isinstance(x, list) for x in per_caption)
    )


def read_jsonl(
    path: str | os.PathLike[str],
    parse: Callable[[object, str, str], dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Read a JSONL file of records (see module docstring); blank lines are skipped.

    `parse(obj, where, default_id)` turns one JSON object into a record (default:
    `normalise_record`); `where` is `file:line` for error messages.

    Invalid UTF-8 inside a caption does not fail the file: it is read with surrogateescape and
    `check_text` later marks that sample `bad_text`.
    """
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where}: not valid JSON ({e.msg} at column {e.colno}). Each line must be "
                    "one JSON object; fix or delete this line."
                ) from None
            records.append((parse or normalise_record)(obj, where, str(lineno)))
    return records


def read_coco_captions(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a COCO captions JSON into records, one per image, captions in annotation order.

    Image rule: ``file_name`` is taken relative to the JSON's folder; if no file exists there
    but ``<json folder>/images/<file_name>`` does, that is used instead. Images without any
    caption are kept (they count as ``bad_text``), so nothing disappears silently.
    """
    root = Path(path).parent
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}).") from None
    if not isinstance(data, dict) or "images" not in data or "annotations" not in data:
        raise DataError(
            f"{path}: expected a COCO captions object with 'images' and 'annotations' lists; "
            "for one-record-per-line data use a .jsonl file."
        )
    captions: dict[Any, list[Any]] = {}
    by_id: dict[Any, dict[str, Any]] = {}
    for i, im in enumerate(data["images"]):
        if not isinstance(im, dict) or "id" not in im or not isinstance(im.get("file_name"), str):
            raise DataError(f"{path}: images[{i}] needs 'id' and a string 'file_name': {im!r}")
        by_id[im["id"]] = im
        captions[im["id"]] = []
    for i, ann in enumerate(data["annotations"]):
        if not isinstance(ann, dict) or "image_id" not in ann or "caption" not in ann:
            raise DataError(f"{path}: annotations[{i}] needs 'image_id' and 'caption': {ann!r}")
        if ann["image_id"] not in captions:
            raise DataError(
                f"{path}: annotations[{i}] refers to image_id {ann['image_id']!r}, which is not "
                "in 'images'. Is this the matching annotation file?"
            )
        captions[ann["image_id"]].append(ann["caption"])
    records = []
    for image_id, im in by_id.items():
        rel = im["file_name"]
        if not (root / rel).exists() and (root / "images" / rel).exists():
            rel = f"images/{rel}"
        records.append(
            {"image": rel, "text": captions[image_id], "negatives": [], "id": str(image_id)}
        )
    return records


@functools.lru_cache(maxsize=4096)
def _real_dir(folder: str) -> str:
    """A folder with its links resolved, once per process."""
    return os.path.realpath(folder)


@functools.lru_cache(maxsize=64)
def _data_root(jsonl_path: str) -> tuple[str, str]:
    """The data file's folder, as written (absolute) and with links resolved."""
    root = os.path.dirname(os.path.abspath(jsonl_path))
    return root, _real_dir(root)


def _inside(path: str, folder: str) -> bool:
    """Whether normalised absolute `path` is `folder` or lies below it (string test: no I/O)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def resolve_image_path(jsonl_path: str | os.PathLike[str], rel: str) -> Path:
    """Resolve a record's image path against the data file's folder.

    Raises BadSample("path_escape") for absolute paths and paths that leave the folder, checked
    both as written (a ``..`` in the record) and after resolving symlinks (a link inside the
    folder that points outside it), so no file outside the data folder is ever opened.
    """
    root, real_root = _data_root(os.fspath(jsonl_path))
    if not rel or "\x00" in rel:
        raise BadSample("path_escape", rel, "image path is empty or contains NUL")
    if os.path.isabs(rel) or Path(rel).drive:
        raise BadSample("path_escape", rel, f"absolute image path; make it relative to {root}")
    full = os.path.normpath(os.path.join(root, rel))
    if not _inside(full, root):
        raise BadSample("path_escape", rel, f"image path leaves the data folder {root}")
    # links resolved: the folder once per process (cached), the file itself with one lstat
    parent, name = os.path.split(full)
    real = os.path.realpath(full) if os.path.islink(full) else os.path.join(_real_dir(parent), name)
    if not _inside(real, real_root):
        raise BadSample("path_escape", rel, f"image path is a link to {real}, outside {root}")
    return Path(full)
