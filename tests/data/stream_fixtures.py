"""Tiny webdataset shards for the streaming tests: uneven shards of 8x8 PNGs."""

from __future__ import annotations

import io
import json
from pathlib import Path

from PIL import Image

from vltrain.data import shards


def png_bytes(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (i * 37 % 256, i * 91 % 256, i * 13 % 256)).save(buf, "PNG")
    return buf.getvalue()


def write_records(root: Path, n: int) -> Path:
    """`root/train.jsonl` with `n` records (two captions, one negative each) and images."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        (root / "images" / f"{i}.png").write_bytes(png_bytes(i))
        rec = {
            "image": f"images/{i}.png",
            "text": [f"caption {i} a", f"caption {i} b"],
            "negatives": [f"negative {i}"],
            "id": f"r{i}",
        }
        lines.append(json.dumps(rec))
    path = root / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def make_shards(root: Path, n: int = 300, shard_size: int = 32) -> list[str]:
    """`n` samples in ceil(n / shard_size) shards (the last one shorter)."""
    records = write_records(root / "records", n)
    return shards.write_shards(records, root / "shards", shard_size).shards
