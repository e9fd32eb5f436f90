"""Webdataset tar shards: write them from records, find them, and read them by byte offset.

Layout (what the `webdataset` library, img2dataset and open_clip read)::

    DIR/shard-000000.tar:  000000000.png  000000000.json  000000001.jpg  000000001.json ...

A sample is the run of consecutive members that share a key (the member name up to the first
dot of its base name). ``<key>.json`` holds the record's fields except ``image`` (``text``,
``negatives``, ``id``, extras); a ``<key>.txt`` caption is read when the JSON has no ``text``
(img2dataset's layout). The image member is copied byte for byte: nothing is decoded when
writing, so a broken image stays broken and is counted by reason when it is read.

Reading is a small tar parser over a seekable file (local or any fsspec URL): every sample has
a byte offset, so a resumed stream seeks straight to where it stopped instead of replaying the
shard, and a shuffle buffer saved as sample keys is refilled by one seek per sample.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from PIL import Image

from vltrain.config.hub_ids import parse_dataset
from vltrain.data.images import BadSample
from vltrain.data.readers import DataError, resolve_image_path
from vltrain.data.sources import Source, read_source

IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff")
_BLOCK = 512


@dataclass
class RawSample:
    """One sample as stored: its key, where it starts in the shard, its members by extension."""

    key: str
    offset: int  # byte offset of the sample's first tar header
    end: int  # byte offset just after its last member
    members: dict[str, bytes] = field(default_factory=dict)


# ---- finding shards ----------------------------------------------------------------------


def is_url(spec: str) -> bool:
    return "://" in spec and not spec.startswith("file://")


def is_shard_source(spec: str | os.PathLike[str]) -> bool:
    """True when `spec` names tar shards: a folder of ``*.tar``, a ``.tar`` path, a brace
    pattern (``shard-{000000..000009}.tar``) or a URL that is not a JSON/JSONL file."""
    s = str(spec)
    if not s or parse_dataset(s) is not None:  # hf://datasets/org/name[:split]: a dataset
        return False
    if s.endswith(".tar") or ("{" in s and ".tar" in s):
        return True
    if is_url(s):
        return not s.endswith((".jsonl", ".json"))
    local = Path(s.removeprefix("file://"))
    return local.is_dir() and any(local.glob("*.tar"))


def expand_braces(pattern: str) -> list[str]:
    """Bash-style ``{a,b}`` and ``{000..009}`` expansion (zero padding kept), left to right."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail, body = pattern[: m.start()], pattern[m.end() :], m.group(1)
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi = rng.group(1), rng.group(2)
        width = len(lo) if lo.startswith("0") else 0
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [out for item in items for out in expand_braces(head + item + tail)]


def resolve_shards(spec: str | os.PathLike[str]) -> list[str]:
    """The ordered shard paths/URLs `spec` names (see `is_shard_source`); errors say why."""
    s = str(spec)
    if "{" in s:
        shards = expand_braces(s)
    elif s.endswith(".tar"):
        shards = [s]
    elif is_url(s):
        import fsspec

        fs, root = fsspec.core.url_to_fs(s)
        shards = [fs.unstrip_protocol(p) for p in sorted(fs.glob(root.rstrip("/") + "/*.tar"))]
    else:
        shards = [str(p) for p in sorted(Path(s.removeprefix("file://")).glob("*.tar"))]
    if not shards:
        raise DataError(
            f"data.train={s} names no tar shards; write them with "
            "`vltrain data shard IN.jsonl --out DIR` and point data.train at DIR"
        )
    return shards


def open_shard(url: str) -> IO[bytes]:
    """A seekable binary file for a local path or an fsspec URL."""
    if is_url(url):
        import fsspec

        return fsspec.open(url, "rb").open()
    try:
        return open(url.removeprefix("file://"), "rb")
    except FileNotFoundError:
        raise DataError(f"shard {url} does not exist; check data.train") from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def check_shard_source(spec: str) -> list[str]:
    """Pre-flight of a shard source (a folder, a brace pattern, a ``file://`` path or an fsspec
    URL): its shards resolve, local ones all exist, and the first one opens and starts with a
    tar header. Asks the filesystem layer nothing more (one listing, one read of 512 bytes).
    Returns the shards; a DataError names the URL and the likely fix otherwise."""
    try:
        shards = resolve_shards(spec)
    except DataError:
        raise
    except ImportError as e:  # fsspec names the package its protocol needs (s3fs, gcsfs, ...)
        raise DataError(f"cannot read {spec}: {_one_line(e)}") from None
    except Exception as e:  # a listing: network, credentials, a missing bucket
        raise DataError(f"cannot list {spec}: {_one_line(e)}; {_REMOTE_HINT}") from None
    if not is_url(spec):
        missing = [u for u in shards if not Path(u.removeprefix("file://")).is_file()]
        if missing:
            raise DataError(
                f"{len(missing)} of the {len(shards)} shards {spec} names do not exist "
                f"(first: {missing[0]})"
            )
    first = shards[0]
    try:
        with open_shard(first) as f:
            if len(head := f.read(512)) < 512:  # a tar is at least one 512-byte block
                raise tarfile.ReadError(f"{len(head)} bytes, less than one tar block")
            f.seek(0)
            next(iter_members(f, 0, want=()), None)
        if first.startswith(("http://", "https://")):  # object stores answer ranges
            _check_ranges(first)
    except tarfile.ReadError as e:
        raise DataError(f"{first} is not a readable tar shard ({e})") from None
    except DataError:
        raise
    except ImportError as e:
        raise DataError(f"cannot read {first}: {_one_line(e)}") from None
    except Exception as e:
        raise DataError(f"cannot read shard {first}: {_one_line(e)}; {_REMOTE_HINT}") from None
    return shards


def _check_ranges(url: str) -> None:
    """The server answers a read from the middle of a shard (a byte range): a stream starts
    inside a shard whenever the shards do not split evenly into data.streams, and on resume.
    A server that does not (python -m http.server) failed there, in a loader worker."""
    import fsspec

    with fsspec.open(url, "rb", block_size=1024).open() as f:
        size = getattr(f, "size", None)
        if not size or size <= 4096:
            return
        try:
            f.seek(size // 2)
            f.read(16)
        except ValueError as e:
            raise DataError(
                f"the server of {url} does not answer byte ranges ({_one_line(e)}): vltrain "
                "reads shards from their middle (streams that start inside a shard, resume); "
                "serve them with one that does (nginx, S3, GCS; not python -m http.server)"
            ) from None


_REMOTE_HINT = (
    "check the URL and the storage's credentials and endpoint (s3: AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; see docs/streaming.md)"
)


# ---- reading -----------------------------------------------------------------------------


def _octal(field_bytes: bytes) -> int:
    if field_bytes and field_bytes[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field_bytes[1:], "big")
    text = field_bytes.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _pax_path(data: bytes) -> str | None:
    for line in data.decode("utf-8", "replace").splitlines():
        _, _, rec = line.partition(" ")
        if rec.startswith("path="):
            return rec[5:]
    return None


def iter_members(
    f: IO[bytes], offset: int = 0, want: tuple[str, ...] | None = None
) -> Iterator[tuple[int, int, str, bytes | None]]:
    """Regular members from byte `offset` on: ``(start, end, name, data)``.

    `start` is the offset of the member's first header (GNU long-name and pax headers
    included), `end` the offset after its data. With `want`, members whose extension is not
    listed are skipped by a seek (`data` is None). Raises tarfile.ReadError on a damaged tar.
    """
    f.seek(offset)
    pos, start, long_name, pending = offset, offset, None, False
    while True:
        if not pending:  # a long-name header belongs to the member after it
            start = pos
        header = f.read(_BLOCK)
        if not header or header == b"\0" * _BLOCK:
            return
        if len(header) < _BLOCK:
            raise tarfile.ReadError(f"truncated tar header at byte {pos}")
        stored = _octal(header[148:156])
        if stored != sum(header[:148]) + 256 + sum(header[156:]):
            raise tarfile.ReadError(f"bad tar header checksum at byte {pos}")
        size, kind = _octal(header[124:136]), header[156:157]
        name = header[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        if header[257:262] == b"ustar" and header[345:500].strip(b"\0"):
            name = header[345:500].split(b"\0", 1)[0].decode("utf-8", "replace") + "/" + name
        data_end = pos + _BLOCK + (size + _BLOCK - 1) // _BLOCK * _BLOCK
        pending = kind in (b"L", b"x")
        if kind == b"L":
            long_name = f.read(size).split(b"\0", 1)[0].decode("utf-8", "replace")
        elif kind == b"x":
            long_name = _pax_path(f.read(size)) or long_name
        elif kind in (b"0", b"\0", b"7"):
            name = long_name or name
            ext = name.rsplit("/", 1)[-1].partition(".")[2].lower()
            data = None
            if want is None or ext in want:
                data = f.read(size)
                if len(data) < size:
                    raise tarfile.ReadError(f"{name}: member data truncated at byte {pos}")
            yield start, data_end, name, data
        if not pending:
            long_name = None
        f.seek(data_end)
        pos = data_end


def split_name(name: str) -> tuple[str, str]:
    """``dir/000123.seg.png`` -> (``dir/000123``, ``seg.png``): the webdataset key rule."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def iter_samples(
    f: IO[bytes], offset: int = 0, want: tuple[str, ...] | None = None
) -> Iterator[RawSample]:
    """Samples (runs of members with one key) from byte `offset` on."""
    current: RawSample | None = None
    for start, end, name, data in iter_members(f, offset, want):
        key, ext = split_name(name)
        if current is not None and key != current.key:
            yield current
            current = None
        if current is None:
            current = RawSample(key, start, end)
        current.end = end
        if data is not None:
            current.members[ext] = data
    if current is not None:
        yield current


def read_sample_at(f: IO[bytes], offset: int) -> RawSample:
    """The one sample that starts at byte `offset` (a shuffle-buffer entry on resume)."""
    for sample in iter_samples(f, offset):
        return sample
    raise tarfile.ReadError(f"no sample at byte {offset}")


def read_texts(shards: list[str], limit: int) -> list[str]:
    """Up to `limit` captions from the shards' JSON/TXT members (images skipped by seeking),
    for training a tokenizer."""
    texts: list[str] = []
    for url in shards:
        with open_shard(url) as f:
            try:
                for sample in iter_samples(f, 0, want=("json", "txt")):
                    meta = parse_meta(sample)
                    if meta is None:
                        continue
                    texts += [t for t in meta.get("text", []) if isinstance(t, str)]
                    if len(texts) >= limit:
                        return texts[:limit]
            except tarfile.ReadError:  # a damaged shard: training counts its lost samples
                continue
    return texts


def parse_meta(sample: RawSample) -> dict[str, Any] | None:
    """The sample's record fields: ``<key>.json`` (``text`` a list), else ``<key>.txt``."""
    meta: dict[str, Any] = {}
    if "json" in sample.members:
        try:
            meta = json.loads(sample.members["json"])
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(meta, dict):
            return None
    if "text" not in meta and "txt" in sample.members:
        meta["text"] = sample.members["txt"].decode("utf-8", "surrogateescape")
    if "text" in meta and not isinstance(meta["text"], list):
        meta["text"] = [meta["text"]]
    return meta


INDEX_NAME = "shardindex.json"  # the wids shard-index layout: {"shardlist": [{url, nsamples}]}


def _index_url(shard: str) -> str:
    return shard.rsplit("/", 1)[0] + "/" + INDEX_NAME if "/" in shard else INDEX_NAME


def read_index(shard: str) -> dict[str, int]:
    """Sample counts by shard base name from the ``shardindex.json`` beside `shard` ({} if
    there is none)."""
    url = _index_url(shard)
    try:
        with open_shard(url) as f:
            data = json.loads(f.read())
    except (DataError, FileNotFoundError):
        return {}
    return {Path(e["url"]).name: int(e["nsamples"]) for e in data.get("shardlist", [])}


def count_samples(url: str) -> int:
    """Samples in one shard, by reading its headers only (member data skipped by seeks).

    A shard damaged mid-way counts its readable samples plus one for the unreadable rest:
    the stream then meets the damage and counts that sample as bad (``corrupt``)."""
    n = 0
    with open_shard(url) as f:
        try:
            for _ in iter_samples(f, 0, want=()):
                n += 1
        except tarfile.ReadError:
            n += 1
    return n


def shard_counts(shards: list[str]) -> list[int]:
    """Samples per shard: from ``shardindex.json`` where it lists the shard, else counted."""
    index = read_index(shards[0]) if shards else {}
    return [index.get(Path(u).name) or count_samples(u) for u in shards]


# ---- writing -----------------------------------------------------------------------------


@dataclass
class ShardReport:
    """What `write_shards` did: shard files, samples written, images it could not copy."""

    shards: list[str]
    samples: int
    missing_images: dict[str, int]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    records_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    shard_size: int,
    prefix: str = "shard",
    image_column: str = "image",
    text_column: str = "text",
) -> ShardReport:
    """Write the records of any source training reads as webdataset tars of `shard_size`
    samples each, keys ``000000000`` ... in record order (`image_column` / `text_column`
    name a CSV's, parquet's or datasets folder's columns, as data.image_column /
    data.text_column do).

    A record whose image cannot be read (missing, or a path leaving the data folder) is
    written without an image member, so training counts it (reason ``missing``) instead of the
    data set shrinking silently. Each shard is written to a temporary name and renamed.
    """
    if shard_size < 1:
        raise DataError(f"--shard-size must be >= 1, got {shard_size}")
    source = read_source(records_path, image_column, text_column)
    records = source.records
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(out.glob(f"{prefix}-*.tar"))
    if stale:
        raise DataError(
            f"{out} already holds {len(stale)} shards ({stale[0].name}, ...); "
            "write into an empty folder so old and new shards do not mix"
        )
    shards: list[str] = []
    missing: dict[str, int] = {}
    for first in range(0, len(records), shard_size):
        path = out / f"{prefix}-{len(shards):06d}.tar"
        tmp = path.with_suffix(".tar.tmp")
        with tarfile.open(tmp, "w", format=tarfile.GNU_FORMAT) as tar:
            for i, rec in enumerate(records[first : first + shard_size], start=first):
                key = f"{i:09d}"
                image, ext, reason = _source_image(source, rec["image"])
                if image is not None:
                    _add(tar, f"{key}.{ext}", image)
                else:
                    missing[reason] = missing.get(reason, 0) + 1
                meta = {k: v for k, v in rec.items() if k != "image"}
                _add(tar, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode())
        os.replace(tmp, path)
        shards.append(str(path))
    index = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [
            {"url": Path(p).name, "nsamples": min(shard_size, len(records) - i * shard_size)}
            for i, p in enumerate(shards)
        ],
    }
    (out / INDEX_NAME).write_text(json.dumps(index, indent=1))
    return ShardReport(shards, len(records), missing)


def _image_ext(rel: str) -> str:
    ext = rel.rsplit(".", 1)[-1].lower() if "." in rel else "png"
    return "jpg" if ext == "jpeg" else ext if ext in IMAGE_EXTS else "png"


#: leading bytes of the image formats a shard member may hold -> its extension
_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpg"), (b"GIF8", "gif"), (b"BM", "bmp"),
          (b"II*\x00", "tif"), (b"MM\x00*", "tif"))  # fmt: skip


def _source_image(source: Source, image: Any) -> tuple[bytes | None, str, str]:
    """(the image's file bytes, the member extension, '') of a record of any source: a path
    resolved against the records file (a captions folder's own file, not the folder's parent),
    or a parquet / datasets row's bytes or path; (None, '', reason) when it cannot be read."""
    value = source.images(image) if source.images is not None else image
    if isinstance(value, dict):  # HF Image storage
        value = value.get("bytes") or value.get("path")
    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue(), "png", ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            return data, "webp", ""
        return data, next((e for m, e in _MAGIC if data.startswith(m)), "png"), ""
    if not isinstance(value, str):
        return None, "", "missing"
    try:
        path = value if os.path.isabs(value) and source.images is not None else None
        path = Path(path) if path else resolve_image_path(source.anchor, value)
        return path.read_bytes(), _image_ext(value), ""
    except BadSample as e:
        return None, "", e.reason
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None, "", "missing"
