"""Robust decoding: each failure kind gets its reason; tricky-but-valid images decode right."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from tests.fixtures import png_header_only
from vltrain.data.images import (
    REASONS,
    BadSample,
    check_text,
    load_image,
    load_image_native,
)


def _reason(path: Path, size: int = 8, **kw: int) -> str:
    with pytest.raises(BadSample) as info:
        load_image(path, size, **kw)
    assert info.value.path == str(path)
    return info.value.reason


def _png_bytes(arr: np.ndarray, mode: str | None = None, **save: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "PNG", **save)
    return buf.getvalue()


def _noise_png(h: int = 64, w: int = 64) -> bytes:
    arr = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return _png_bytes(arr)


@pytest.fixture
def write(tmp_path: Path):
    def _write(name: str, data: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    return _write


def test_good_image_shape_dtype_range(write) -> None:
    t = load_image(write("ok.png", _noise_png(40, 20)), 16)
    assert t.shape == (3, 16, 16) and t.dtype == torch.float32 and t.is_contiguous()
    assert 0.0 <= float(t.min()) and float(t.max()) <= 1.0
    assert float(t.std()) > 0.1  # real content, not a constant fill


def test_failure_reasons(tmp_path: Path, write) -> None:
    png = _noise_png()
    assert _reason(tmp_path / "nope.png") == "missing"
    assert _reason(tmp_path / "no_dir" / "x.png") == "missing"
    assert _reason(write("empty.png", b"")) == "empty_file"
    assert _reason(write("text.jpg", b"hello, I am not an image\n")) == "not_image"
    assert _reason(tmp_path) == "not_image"  # a directory
    assert _reason(write("trunc.png", png[: len(png) // 2])) == "truncated"
    broken = bytearray(png)
    broken[len(broken) // 2] ^= 0xFF
    assert _reason(write("crc.png", bytes(broken))) == "corrupt"
    garbage = np.random.default_rng(1).integers(0, 256, 400, dtype=np.uint8).tobytes()
    assert _reason(write("bad.jpg", b"\xff\xd8\xff\xe0" + garbage)) == "corrupt"
    assert _reason(write("hdr.png", png[:30])) == "corrupt"  # starts like a PNG, no header
    assert set(REASONS) >= {"missing", "empty_file", "not_image", "truncated", "corrupt"}


def test_truncated_jpeg(write) -> None:
    buf = io.BytesIO()
    arr = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(arr).save(buf, "JPEG")
    data = buf.getvalue()
    assert _reason(write("t.jpg", data[: len(data) // 2])) == "truncated"
    assert load_image(write("full.jpg", data), 8).shape == (3, 8, 8)  # control: whole file ok


def test_bomb_rejected_from_header_before_decoding(write, monkeypatch) -> None:
    path = write("bomb.png", png_header_only(2000, 2000))  # no pixel data at all
    # Control: allowed by max_pixels, the file reaches the decoder and fails there.
    assert _reason(path, max_pixels=10_000_000) != "decompression_bomb"

    def no_decode(self, *a, **k):  # any decode attempt would fail the test
        raise AssertionError("decoder ran on an oversized image")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decode)
    assert _reason(path, max_pixels=1_000_000) == "decompression_bomb"


def test_huge_bomb_hits_pillow_limit_and_same_reason(write) -> None:
    path = write("huge.png", png_header_only(100_000, 100_000))
    assert _reason(path, max_pixels=10**12) == "decompression_bomb"


def test_sixteen_bit_scaled_by_true_depth_not_clipped(write) -> None:
    arr = np.array([[65535, 65535], [32768, 32768]], dtype=np.uint16)
    for name in ("g16.png", "g16.tif"):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "PNG" if name.endswith("png") else "TIFF")
        p = write(name, buf.getvalue())
        assert Image.open(p).mode.startswith("I;16")
        t = load_image(p, 2)
        assert t.shape == (3, 2, 2)
        torch.testing.assert_close(t[:, 0], torch.ones(3, 2), atol=1e-6, rtol=0)
        torch.testing.assert_close(t[:, 1], torch.full((3, 2), 32768 / 65535), atol=1e-6, rtol=0)
    native = load_image_native(p)
    assert native.mode == "RGB" and native.getpixel((0, 1)) == (128, 128, 128)


def test_alpha_composited_over_white(write) -> None:
    rgba = np.zeros((2, 2, 4), dtype=np.uint8)
    rgba[0, 0] = (255, 0, 0, 255)  # opaque red stays red
    rgba[0, 1] = (255, 0, 0, 0)  # fully transparent red becomes white
    rgba[1, :] = (0, 0, 0, 128)  # half-transparent black becomes mid grey
    t = load_image(write("a.png", _png_bytes(rgba, "RGBA")), 2)
    torch.testing.assert_close(t[:, 0, 0], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(t[:, 0, 1], torch.ones(3))
    torch.testing.assert_close(t[:, 1, 0], torch.full((3,), 127 / 255), atol=2 / 255, rtol=0)

    la = np.array([[[0, 0], [0, 255]]], dtype=np.uint8)  # (1, 2, 2): transparent, opaque black
    t = load_image(write("la.png", _png_bytes(la, "LA")), 2)
    assert float(t[:, :, 0].min()) == 1.0 and float(t[:, :, 1].max()) == 0.0


def test_palette_transparency_cmyk_gray(write) -> None:
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pal.putpixel((0, 0), 0)
    pal.putpixel((1, 0), 1)
    buf = io.BytesIO()
    pal.save(buf, "PNG", transparency=0)
    t = load_image_native(write("p.png", buf.getvalue()))
    assert t.getpixel((0, 0)) == (255, 255, 255) and t.getpixel((1, 0)) == (255, 0, 0)

    cmyk = Image.new("CMYK", (4, 4), (255, 0, 0, 0))  # pure cyan
    buf = io.BytesIO()
    cmyk.save(buf, "TIFF")
    t = load_image(write("c.tif", buf.getvalue()), 4)
    torch.testing.assert_close(t[:, 0, 0], torch.tensor([0.0, 1.0, 1.0]))

    gray = np.arange(16, dtype=np.uint8).reshape(4, 4) * 16
    t = load_image(write("g.png", _png_bytes(gray)), 4)
    assert torch.equal(t[0], t[1]) and torch.equal(t[1], t[2])
    bits = np.array([[True, False]])
    t = load_image(write("b.png", _png_bytes(bits)), 2)
    assert t[:, 0, 0].tolist() == [1.0] * 3 and t[:, 0, 1].tolist() == [0.0] * 3


def test_exif_orientation_applied(write) -> None:
    arr = np.zeros((8, 16, 3), dtype=np.uint8)  # (H, W): wide image
    arr[:, :8] = (255, 0, 0)  # left half red
    arr[:, 8:] = (0, 0, 255)
    plain = write("plain.png", _png_bytes(arr))
    assert load_image_native(plain).size == (16, 8)  # control: no EXIF, no rotation
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed rotated 90 degrees clockwise
    img = load_image_native(write("rot.png", _png_bytes(arr, exif=exif.tobytes())))
    assert img.size == (8, 16)  # now tall
    assert img.getpixel((4, 2)) == (255, 0, 0)  # the left (red) half is on top
    assert img.getpixel((4, 13)) == (0, 0, 255)


def test_jpeg_draft_matches_full_decode(write) -> None:
    yy, xx = np.mgrid[0:512, 0:512]
    arr = np.stack([xx / 2, yy / 2, (xx + yy) / 4], axis=-1).astype(np.uint8)  # smooth
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=95)
    p = write("big.jpg", buf.getvalue())
    fast = load_image(p, 64)  # decodes at 1/8 scale in the DCT domain
    full = load_image_native(p).resize((64, 64), Image.Resampling.BICUBIC)
    ref = torch.from_numpy(np.asarray(full, dtype=np.float32) / 255).permute(2, 0, 1)
    assert float((fast - ref).abs().mean()) < 0.02


def test_truncated_images_flag_must_stay_off(write, monkeypatch) -> None:
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    png = _noise_png()
    p = write("trunc.png", png[: len(png) // 2])
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        load_image(p, 8)


@pytest.mark.parametrize("bad", ["", "   \n\t", None, 3, ["a"], b"caf\xff", "caf\udcff", b"  "])
def test_check_text_rejects(bad: object) -> None:
    with pytest.raises(BadSample) as info:
        check_text(bad, "data.jsonl:id=7")
    assert info.value.reason == "bad_text" and info.value.path == "data.jsonl:id=7"


def test_check_text_accepts_and_strips() -> None:
    assert check_text("  a red circle \n") == "a red circle"
    assert check_text("caf\u00e9".encode()) == "caf\u00e9"


def test_bad_sample_reason_must_be_known() -> None:
    with pytest.raises(ValueError, match="unknown bad-sample reason"):
        BadSample("weird", "x.png")
    e = BadSample("truncated", Path("x.png"), "cut at 10 bytes")
    assert (e.reason, e.path, e.detail) == ("truncated", "x.png", "cut at 10 bytes")
    assert "truncated" in str(e) and "x.png" in str(e)


def test_a_fifo_named_like_an_image_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Opening a FIFO blocks until a writer comes: training used to hang forever on one."""
    import os
    import signal

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)

    def hung(*_: object) -> None:
        raise TimeoutError("load_image blocked on a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        assert _reason(fifo) == "not_image"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
