"""Per-stage CPU cost of the curate image-hashing worker, per image, on the bench's photos.

Each stage is timed alone (this process's CPU time, median over rounds of the per-file sum):
file read, Pillow decode (what `load_image_native` did for every file), vltrain's decode
(`decode_rgb`: libspng for plain PNGs), the grey conversion, each LANCZOS thumbnail imagehash's
pHash/dHash need, the hash bits, the 64 x 64 base thumbnail, the 16 x 16 thumbnail, the crop
windows, the content key (with and without the `tobytes` copy), and the whole `image_hashes`.

    PYTHONPATH=. python bench/profile_image_hashes.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from bench.bench_curation import photos
from vltrain.curation import hashing
from vltrain.curation.decode import decode_rgb
from vltrain.data.images import load_image_native


def _stages(path: Path) -> dict[str, float]:
    """{stage: CPU seconds} for one file."""
    c = time.process_time
    t: dict[str, float] = {}

    def timed(name: str, fn):
        t0 = c()
        out = fn()
        t[name] = c() - t0
        return out

    timed("read file", path.read_bytes)
    img = timed("decode: Pillow (load_image_native)", lambda: load_image_native(path))
    dec = timed("decode: vltrain (decode_rgb)", lambda: decode_rgb(path))
    grey = timed("grey conversion", lambda: img.convert("L"))
    g32 = timed("LANCZOS 32x32", lambda: grey.resize((32, 32), Image.Resampling.LANCZOS))
    g98 = timed("LANCZOS 9x8", lambda: grey.resize((9, 8), Image.Resampling.LANCZOS))
    timed(
        "pHash + dHash bits (+ mirrors)",
        lambda: (hashing.phash_bits(np.asarray(g32)), hashing.dhash_bits(np.asarray(g98))),
    )
    base = timed("64x64 base thumbnail", lambda: hashing.base_thumbnail(img))
    timed("16x16 colour thumbnail", lambda: base.resize((16, 16), Image.Resampling.BOX).tobytes())
    timed("crop windows (10 pHashes + 32x32)", lambda: hashing.crop_hashes(base))
    timed("content key via tobytes", lambda: hashing.content_hash(img))
    if dec.pixels is not None:
        timed("content key in place", lambda: hashing.content_hash(dec.image, 0, dec.pixels))
    timed("SHA-1 of the pixels alone", lambda: hashlib.sha1(img.tobytes()).digest())
    timed("image_hashes (all of the above but decode)", lambda: hashing.image_hashes(img))
    timed(
        "worker total: decode_rgb + image_hashes",
        lambda: (lambda dr: hashing.image_hashes(dr.image, 0, dr.pixels))(decode_rgb(path)),
    )
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    cpu = next(
        (x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")),
        platform.processor(),
    )
    print(f"CPU: {cpu}; Pillow {Image.__version__}; numpy {np.__version__}")
    imgs = photos()
    with tempfile.TemporaryDirectory() as d:
        for fmt in ("png", "jpg"):
            paths = []
            for i, im in enumerate(imgs):
                path = Path(d) / f"{i}.{fmt}"
                im.save(path, quality=90) if fmt == "jpg" else im.save(path)
                paths.append(path)
            sums: dict[str, list[float]] = {}
            for _ in range(a.rounds):
                per = [_stages(path) for path in paths]
                for k in per[0]:
                    sums.setdefault(k, []).append(sum(x.get(k, 0.0) for x in per))
            print(f"\n| {fmt.upper()} stage ({len(paths)} photos) | CPU ms per image |")
            print("|---|---|")
            for k, v in sums.items():
                print(f"| {k} | {np.median(v) / len(paths) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
