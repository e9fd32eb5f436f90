"""The image-hashing decoder gives exactly `load_image_native`'s pixels and errors, and takes the
libspng fast path only for PNGs where that is provably the same."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from tests.curation.test_image_features_pinned import write_pinned_images
from vltrain.curation import decode
from vltrain.data.images import BadSample, load_image_native


def _png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _with_chunk(png: bytes, kind: bytes, body: bytes, crc_ok: bool = True) -> bytes:
    """`png` with one more chunk right after IHDR (a bad CRC when crc_ok is False)."""
    crc = zlib.crc32(kind + body) ^ (0 if crc_ok else 1)
    chunk = struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)
    return png[:33] + chunk + png[33:]


def _extra_files(d: Path) -> dict[str, bool]:
    """More edge cases: {name: whether the fast path may take it}."""
    rng = np.random.default_rng(7)
    img = Image.fromarray((rng.random((60, 80, 3)) * 255).astype(np.uint8))
    info = PngImagePlugin.PngInfo()
    info.add_text("Software", "plain text chunk")
    xmp = b'XML:com.adobe.xmp\0<x:xmpmeta tiff:Orientation="6"/>'
    cases = {
        "text.png": (_png(img, pnginfo=info), True),
        "xmp_orientation.png": (_with_chunk(_png(img), b"tEXt", xmp), False),
        "bad_crc_text.png": (_with_chunk(_png(img), b"tEXt", b"a\0b", crc_ok=False), False),
        "unknown_chunk.png": (_with_chunk(_png(img), b"vpAg", b"\0" * 9), False),
        "gamma.png": (_with_chunk(_png(img), b"gAMA", struct.pack(">I", 100000)), True),
        "srgb.png": (_with_chunk(_png(img), b"sRGB", b"\0"), True),
        "trailing_bytes.png": (_png(img) + b"junk after IEND", True),
        "rgba_opaque.png": (_png(img.convert("RGBA")), False),
        "interlaced_flag.png": (_png(img)[:28] + b"\x01" + _png(img)[29:], False),
    }
    for name, (data, _) in cases.items():
        (d / name).write_bytes(data)
    return {name: fast for name, (_, fast) in cases.items()}


def _outcome(fn, path: Path) -> tuple:
    try:
        img = fn(path)
    except BadSample as e:
        return ("bad", e.reason)
    return (img.mode, img.size, img.tobytes())


@pytest.mark.parametrize("with_spng", [True, False])
def test_decode_rgb_equals_load_image_native_on_every_file(
    tmp_path: Path, monkeypatch, with_spng: bool
) -> None:
    if with_spng:
        pytest.importorskip("pyspng")
    names = write_pinned_images(tmp_path)
    fast = _extra_files(tmp_path)
    if not with_spng:
        monkeypatch.setattr(decode, "pyspng", None)
    taken = []
    for name in names + sorted(fast):
        p = tmp_path / name
        want = _outcome(load_image_native, p)
        got = _outcome(lambda q: decode.decode_rgb(q).image, p)
        assert got == want, name
        if want[0] != "bad":
            d = decode.decode_rgb(p)
            if d.pixels is not None:
                assert d.pixels.tobytes() == d.image.tobytes()  # hashed in place of tobytes
                taken.append(name)
    if not with_spng:
        assert taken == []
        return
    # the fast path is not vacuous: it took the plain RGB files, and none of the excluded kinds
    assert {"rgb_512x512.png", "rgb_300x900.png", "level9.png", "text.png", "gamma.png"} <= set(
        taken
    )
    assert not {n for n, ok in fast.items() if not ok} & set(taken)
    for excluded in ("exif_rotated.png", "palette_transparent.png", "grey16.png", "rgba.png"):
        assert excluded not in taken


def test_plain_png_shape_reads_the_header_and_rejects_what_it_must() -> None:
    img = Image.new("RGB", (7, 5), (1, 2, 3))
    assert decode.plain_png_shape(_png(img)) == (5, 7, 3)
    assert decode.plain_png_shape(_png(img.convert("L"))) == (5, 7, 1)
    assert decode.plain_png_shape(_png(img)[:-12]) is None  # no IEND: truncated
    assert decode.plain_png_shape(_png(img), max_pixels=34) is None  # bomb check: Pillow's
    assert decode.plain_png_shape(b"\xff\xd8\xff" + bytes(40)) is None  # a JPEG
