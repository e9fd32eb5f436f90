"""Test material shared across test folders: a corpus of deliberately broken samples (the tests
of image decoding and bad-sample accounting) and tiny random HF causal LMs built from config
objects (decoding, speculative and drafter tests). Not part of the package.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but that holds no pixel data at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IEND", b"")


def _noise(seed: int, h: int, w: int, c: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8)


def _bad_corpus_files(img_dir: Path) -> None:
    """Write every image file the bad corpus refers to."""
    Image.fromarray(_noise(1, 32, 32)).save(img_dir / "good.png")
    (img_dir / "empty.png").write_bytes(b"")
    (img_dir / "not_image.jpg").write_text("this is a text file, not a JPEG\n")
    full = img_dir / "_full.png"
    Image.fromarray(_noise(2, 64, 64)).save(full)
    data = full.read_bytes()
    full.unlink()
    (img_dir / "truncated.png").write_bytes(data[: len(data) // 2])
    broken = bytearray(data)
    broken[len(broken) // 2] ^= 0xFF  # fails the IDAT CRC / zlib stream
    (img_dir / "corrupt.png").write_bytes(bytes(broken))
    (img_dir / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + _noise(3, 1, 400, 1).tobytes())
    (img_dir / "bomb.png").write_bytes(png_header_only(9000, 9000))  # 81 MP > 64 MP default
    (img_dir / "bomb_huge.png").write_bytes(png_header_only(100_000, 100_000))
    pal = Image.fromarray(_noise(4, 16, 16)).convert("P", palette=Image.Palette.ADAPTIVE)
    pal.save(img_dir / "palette.png", transparency=0)
    Image.fromarray(_noise(5, 16, 16)).convert("CMYK").save(img_dir / "cmyk.jpg", quality=95)
    rgba = np.concatenate([_noise(6, 16, 16), np.full((16, 16, 1), 128, np.uint8)], axis=2)
    Image.fromarray(rgba, "RGBA").save(img_dir / "rgba.png")
    Image.fromarray(_noise(7, 16, 16, 2), "LA").save(img_dir / "la.png")
    ramp = np.linspace(0, 65535, 16 * 16).astype(np.uint16).reshape(16, 16)
    Image.fromarray(ramp).save(img_dir / "gray16.png")  # mode I;16
    Image.fromarray(_noise(8, 16, 16)[..., 0]).save(img_dir / "gray.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    Image.fromarray(_noise(9, 8, 16)).save(img_dir / "exif_rot.jpg", exif=exif.tobytes())


_BAD_CORPUS: tuple[tuple[str, Any, str], ...] = (
    # (image, text, expected reason or "ok")
    ("bad_images/good.png", "a good image", "ok"),
    ("bad_images/does_not_exist.png", "a missing image", "missing"),
    ("bad_images/empty.png", "an empty file", "empty_file"),
    ("bad_images/not_image.jpg", "a text file", "not_image"),
    ("bad_images/truncated.png", "a truncated png", "truncated"),
    ("bad_images/corrupt.png", "a png with a broken data stream", "corrupt"),
    ("bad_images/corrupt.jpg", "jpeg magic followed by garbage", "corrupt"),
    ("bad_images/bomb.png", "header claims 9000x9000", "decompression_bomb"),
    ("bad_images/bomb_huge.png", "header claims 100000x100000", "decompression_bomb"),
    ("../outside.png", "escapes the folder", "path_escape"),
    ("bad_images/../../outside.png", "escapes via a subfolder", "path_escape"),
    ("bad_images/good.png", "", "bad_text"),
    ("bad_images/good.png", "  \n\t ", "bad_text"),
    ("bad_images/good.png", 123, "bad_text"),
    ("bad_images/good.png", [], "bad_text"),
    ("bad_images/palette.png", "a palette image with transparency", "ok"),
    ("bad_images/cmyk.jpg", "a cmyk jpeg", "ok"),
    ("bad_images/rgba.png", "a half transparent image", "ok"),
    ("bad_images/la.png", "gray with alpha", "ok"),
    ("bad_images/gray16.png", "a 16-bit grayscale ramp", "ok"),
    ("bad_images/gray.png", "an 8-bit grayscale image", "ok"),
    ("bad_images/exif_rot.jpg", "a jpeg with exif rotation", "ok"),
)


def write_bad_corpus(out_dir: str | os.PathLike[str]) -> Path:
    """Write ``out_dir/bad.jsonl``: one good sample, one per failure kind, tricky good images.

    Every record carries ``"expect"``: the bad-sample reason the dataset must report, or
    ``"ok"``. Also included: an absolute path to an existing image (``path_escape``, not
    ``missing``) and a caption with invalid UTF-8 bytes (``bad_text``).
    """
    out = Path(out_dir)
    img_dir = out / "bad_images"
    img_dir.mkdir(parents=True, exist_ok=True)
    _bad_corpus_files(img_dir)
    lines = []
    for i, (image, text, expect) in enumerate(_BAD_CORPUS):
        rec = {"image": image, "text": text, "id": f"{i:02d}_{expect}", "expect": expect}
        lines.append(json.dumps(rec).encode("utf-8"))
    absolute = str((img_dir / "good.png").resolve())
    rec = {"image": absolute, "text": "an absolute path", "id": "abs_path_escape"}
    lines.append(json.dumps({**rec, "expect": "path_escape"}).encode("utf-8"))
    # Raw invalid UTF-8 inside the caption string: must become bad_text, not a crash.
    lines.append(
        b'{"image": "bad_images/good.png", "text": "caf\xff\xfe", "id": "bad_utf8", '
        b'"expect": "bad_text"}'
    )
    path = out / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def tiny_causal_lm(
    arch: str,
    vocab_size: int = 96,
    layers: int = 3,
    max_positions: int = 256,
    special: tuple[int, int, int] = (1, 2, 0),
) -> tuple[Any, type]:
    """(config, model class) of a tiny random HF causal LM, width 32, 4 heads over 2 KV heads:
    llama, llama_bias (attention biases, o_proj's included), qwen2 (q/k/v biases) or qwen3 (q/k
    norm, head_dim 16). ``special``: the (bos, eos, pad) token ids."""
    import transformers

    bos, eos, pad = special
    dims = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=bos,
    )
    if arch in ("llama", "llama_bias"):
        cfg = transformers.LlamaConfig(attention_bias=arch == "llama_bias", **dims)
        return cfg, transformers.LlamaForCausalLM
    if arch == "qwen2":
        return transformers.Qwen2Config(**dims), transformers.Qwen2ForCausalLM
    if arch == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **dims), transformers.Qwen3ForCausalLM
    raise ValueError(f"tiny_causal_lm: unknown arch {arch!r}; use llama, llama_bias, qwen2, qwen3")


def make_tiny_qwen3vl(out: Path) -> str:
    """A random Qwen3-VL (hidden 32) with a chat-template tokenizer, saved like a hub model."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from tests.models.test_hf_embedders import _qwen_ids, _save, _tokenizer

    tok = _tokenizer("<|vision_start|><|image_pad|><|vision_end|>")
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    }
    text = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=32,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    cfg = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **_qwen_ids(tok))
    torch.manual_seed(0)
    ip = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=4096
    )
    return _save(transformers.Qwen3VLForConditionalGeneration(cfg), tok, ip, out)
