"""Pinned image features: content keys, pHash/dHash and mirrors, colour thumbnails and crop-window
hashes of a fixed set of files, through the worker path `vltrain data curate` uses, and the
curate decisions on planted shapes data. The digests were taken before the image-hashing
speed-ups (Pillow 13.0.0, numpy 2.4.6); any change of an output value fails here, whichever
decoder or resize path produced it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
from pathlib import Path

import numpy as np
from PIL import Image

from vltrain.cli import main
from vltrain.curation.features import FeatureSettings, iter_features
from vltrain.curation.hashing import ImageHashes
from vltrain.data.synth import write_shapes_dataset


def _smooth(rng: np.random.Generator, h: int, w: int, c: int) -> np.ndarray:
    """Photo-like content: low frequencies plus noise (so the hashes are not degenerate)."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    out = np.empty((h, w, c))
    for k in range(c):
        fx, fy, ph = rng.uniform(2, 9, 3)
        out[..., k] = np.sin(xx / w * fx + ph) * np.cos(yy / h * fy) * 90 + 128
    out += rng.normal(0, 12, out.shape)
    return np.clip(out, 0, 255).astype(np.uint8)


def write_pinned_images(d: Path) -> list[str]:
    """Write the fixed image set (names sorted): RGB/grey/RGBA/palette/16-bit PNGs of wide, tall
    and tiny sizes, PNGs with text chunks and EXIF orientation, JPEGs, and broken files."""
    rng = np.random.default_rng(1234)
    files: dict[str, bytes] = {}

    def save(name: str, img: Image.Image, **kw) -> None:
        buf = io.BytesIO()
        img.save(buf, format="JPEG" if name.endswith(".jpg") else "PNG", **kw)
        files[name] = buf.getvalue()

    for w, h in ((512, 512), (640, 427), (300, 900), (1000, 300), (33, 31), (9, 8), (5, 300)):
        rgb = Image.fromarray(_smooth(rng, h, w, 3))
        save(f"rgb_{w}x{h}.png", rgb)
        save(f"rgb_{w}x{h}.jpg", rgb, quality=90)
    grey = Image.fromarray(_smooth(rng, 200, 260, 1)[..., 0])
    save("grey.png", grey)
    save("grey.jpg", grey, quality=85)
    rgba = Image.fromarray(np.concatenate([_smooth(rng, 120, 90, 3), _smooth(rng, 120, 90, 1)], 2))
    save("rgba.png", rgba)
    pal = Image.fromarray(_smooth(rng, 100, 140, 3)).quantize(64)
    save("palette.png", pal)
    save("palette_transparent.png", pal, transparency=3)
    save("grey16.png", Image.fromarray(_smooth(rng, 80, 70, 1)[..., 0].astype(np.uint16) * 250))
    base = Image.fromarray(_smooth(rng, 150, 220, 3))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees on load
    save("exif_rotated.png", base, exif=exif)
    save("exif_rotated.jpg", base, exif=exif, quality=90)
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("Software", "pinned")
    info.add_text("Comment", "compressed text", zip=True)
    save("text_chunks.png", base, pnginfo=info)
    save("level1.png", base, compress_level=1)
    save("level9.png", base, compress_level=9, optimize=True)
    files["same_pixels_as_level1.png"] = files["level1.png"]
    good = files["rgb_512x512.png"]
    files["truncated.png"] = good[: len(good) // 2]
    files["corrupt_idat.png"] = good[:300] + bytes(200) + good[500:]
    files["truncated.jpg"] = files["rgb_640x427.jpg"][:4000]
    files["not_an_image.png"] = b"hello"
    files["empty.png"] = b""
    for name, data in files.items():
        (d / name).write_bytes(data)
    return sorted(files)


def _digest(h: ImageHashes | None, bad: str | None) -> str:
    fields = dataclasses.astuple(h) if h is not None else (bad,)
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


#: sha256 (first 16 hex digits) of each file's ImageHashes fields (or its bad-sample reason)
PINNED = {
    "corrupt_idat.png": "7a83644dca50fe91",
    "empty.png": "3594ccda4cec95b4",
    "exif_rotated.jpg": "1d4c5b1dc8ae7d48",
    "exif_rotated.png": "9e57d6ef84d53d89",
    "grey.jpg": "4aa640a62289fd80",
    "grey.png": "b57b4c9c2d4b8bc4",
    "grey16.png": "9624779b9e67248a",
    "level1.png": "1effd3f656591f0c",
    "level9.png": "1effd3f656591f0c",
    "not_an_image.png": "9cc6b71b52440143",
    "palette.png": "cc00919260a0941a",
    "palette_transparent.png": "3ab0d4c5ad7b995b",
    "rgb_1000x300.jpg": "9bc73bb86fa76ac2",
    "rgb_1000x300.png": "3c0fbb75e5dcc2da",
    "rgb_300x900.jpg": "3187ab6949ef6c72",
    "rgb_300x900.png": "02f5a2c0534d4d02",
    "rgb_33x31.jpg": "ed2de4cda0a7268f",
    "rgb_33x31.png": "54472daff746d302",
    "rgb_512x512.jpg": "c99f6f7ec0f37713",
    "rgb_512x512.png": "a2d8c4cde19bf298",
    "rgb_5x300.jpg": "dd297475eaba2244",
    "rgb_5x300.png": "3a887cd667c2a309",
    "rgb_640x427.jpg": "985824a3f296b518",
    "rgb_640x427.png": "a2dd8c22aba9f638",
    "rgb_9x8.jpg": "513c132696d928d0",
    "rgb_9x8.png": "f46c92c5f25a5b7f",
    "rgba.png": "4dd090ec64ef6db8",
    "same_pixels_as_level1.png": "1effd3f656591f0c",
    "text_chunks.png": "1effd3f656591f0c",
    "truncated.jpg": "7511533e99925f24",
    "truncated.png": "7511533e99925f24",
}

#: sha256 of the curate outputs (kept lines, removed lines) on the planted shapes data
# session 10: the synthetic records gained `caption_negatives`; with that key stripped the two
# files hash to the previous pins (6415ba6bed4c505d, a3df55cf7e734002): the same decisions.
# session 41: leak_caption_ngram removals name their eval record in duplicate_of (was null;
# the removed file's previous pin bed69bf8f34fca6d), the decisions unchanged
PINNED_CURATE = ("4d07a1cf62f5d1f9", "bd945f7c9b8a6744")


def image_feature_digests(d: Path, workers: int = 1) -> dict[str, str]:
    """{file name: digest} through `iter_features`, the path `vltrain data curate` uses."""
    names = write_pinned_images(d)
    s = FeatureSettings(str(d), seed=0, shingle_n=3, num_perm=16, leak_n=13, bands=4, rows=4)
    feats = iter_features(((i, n, ["a caption"]) for i, n in enumerate(names)), s, workers)
    return {n: _digest(f.image, f.bad) for n, f in zip(names, feats, strict=True)}


def test_image_features_are_the_pinned_values(tmp_path: Path) -> None:
    got = image_feature_digests(tmp_path)
    assert got == PINNED
    # negative control: the digest sees every field (one changed thumbnail byte changes it)
    feats = next(
        iter_features(
            [(0, "rgb_512x512.png", ["x"])],
            FeatureSettings(str(tmp_path), 0, 3, 16, 13, 4, 4),
        )
    )
    assert feats.image is not None
    changed = dataclasses.replace(feats.image, small=b"\x00" + feats.image.small[1:])
    assert _digest(changed, None) != got["rgb_512x512.png"]


def test_curate_decisions_are_the_pinned_outputs(tmp_path: Path) -> None:
    write_shapes_dataset(tmp_path, n_train=80, n_val=10, n_test=20, seed=5, dup_rate=0.15,
                         leak_rate=0.2)  # fmt: skip
    out = tmp_path / "cur.jsonl"
    args = ["data", "curate", str(tmp_path / "train.jsonl"), "--out", str(out)]
    assert main([*args, "--against", str(tmp_path / "test.jsonl")]) == 0
    removed = out.with_name("cur.removed.jsonl")
    got = tuple(hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in (out, removed))
    assert removed.read_text().count("dup_") > 0  # the planted copies are found at all
    assert got == PINNED_CURATE
