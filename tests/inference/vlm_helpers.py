"""Tiny random image-text-to-text models saved like hub models, and their processor outputs.

Qwen2-VL, Qwen3-VL and LLaVA directories hold a chat-template tokenizer and a PIL image
processor, so their inputs come from ``data.hf_collate.HFCollate`` (the path users take);
the Idefics3 (SmolVLM-style) model's come from its PIL image processor and token ids. EOS = PAD
= 0; the EOS row of the LM head is scaled so that some rows end early.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tests.fixtures import make_tiny_qwen3vl
from tests.models.test_hf_embedders import _qwen_ids, _save, _tokenizer
from vltrain.data.hf_collate import HFCollate
from vltrain.inference.vlm_target import left_align, load_hf_vlm

EOS = PAD = 0
PROMPTS = ["Describe", "Say what this picture shows, please", "a"]


def _text(vocab: int, **extra: Any) -> dict[str, Any]:
    extra = {"max_position_embeddings": 256, **extra}
    return dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        bos_token_id=None,
        eos_token_id=EOS,
        pad_token_id=PAD,
        **extra,
    )


def make_tiny_qwen2vl(out: Path, max_pixels: int = 4096, max_positions: int | None = 256) -> str:
    """A random Qwen2-VL (hidden 32, 2 layers, patch 4, merge 2) with a chat-template tokenizer;
    `max_positions=None` keeps transformers' default text positions."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = _tokenizer("<|vision_start|><|image_pad|><|vision_end|>")
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    vision = dict(
        depth=1,
        embed_dim=16,
        hidden_size=32,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    text = _text(len(tok), rope_parameters=rope, max_position_embeddings=max_positions)
    if max_positions is None:
        del text["max_position_embeddings"]
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **_qwen_ids(tok))
    torch.manual_seed(0)
    ip = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=max_pixels
    )
    return _save(transformers.Qwen2VLForConditionalGeneration(cfg), tok, ip, out)


def make_tiny_llava(out: Path) -> str:
    import transformers

    tok = _tokenizer("<image>")
    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision,
        text_config=_text(len(tok), model_type="llama"),
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    ip = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    return _save(transformers.LlavaForConditionalGeneration(cfg), tok, ip, out)


def images(n: int = 3) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    sizes = [(24, 40), (48, 32), (32, 32)]
    return [
        Image.fromarray(rng.integers(0, 255, (*sizes[i % 3], 3), dtype=np.uint8)) for i in range(n)
    ]


def image_files(root: Path) -> list[str]:
    """`images()` saved as PNG files under ``root`` (what `vltrain generate --images` reads)."""
    files = []
    for i, im in enumerate(images()):
        files.append(str(root / f"im{i}.png"))
        im.save(files[-1])
    return files


def boost_eos(model: torch.nn.Module, norm: float) -> None:
    """Rescale the EOS row of the LM head so that EOS wins in some contexts."""
    with torch.no_grad():
        row = model.get_output_embeddings().weight[EOS]
        row.mul_(norm / row.norm())


def saved_vlm(kind: str, out: Path, eos_norm: float) -> tuple[torch.nn.Module, dict, str]:
    """(model loaded back from its directory, left-padded inputs of 3 images, the directory)."""
    make = {"qwen2_vl": make_tiny_qwen2vl, "qwen3_vl": make_tiny_qwen3vl, "llava": make_tiny_llava}
    path = make[kind](out)
    inputs, _ = HFCollate(path, "vlm").image_batch(images(), instructions=PROMPTS)
    model = load_hf_vlm(path)
    if kind == "qwen3_vl":
        model.generation_config.eos_token_id = EOS  # its builder's config leaves it to the text
    boost_eos(model, eos_norm)
    return model, left_align(inputs), path


def idefics3(eos_norm: float) -> tuple[torch.nn.Module, dict]:
    """A tiny Idefics3 (SmolVLM's architecture) and a left-padded batch of 3 images of other
    aspect ratios (so ``pixel_attention_mask`` masks padding) with prompts of other lengths."""
    import transformers
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    vocab, img, fake = 96, 95, 94
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    ) | dict(image_size=16, patch_size=4)
    cfg = transformers.Idefics3Config(
        vision_config=vision,
        text_config=_text(vocab, model_type="llama"),
        image_token_id=img,
        scale_factor=2,
    )  # (16 / 4) ** 2 / 2 ** 2 = 4 image tokens
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, PAD
    boost_eos(model, eos_norm)
    ip = Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 16}, max_image_size={"longest_edge": 16}
    )
    pix = ip(images=[[im] for im in images()], return_tensors="pt")
    g = torch.Generator().manual_seed(1)
    rows = [
        [fake, *[img] * 4, fake, *torch.randint(3, 90, (n,), generator=g).tolist()]
        for n in (3, 7, 5)
    ]
    t = max(map(len, rows))
    ids = torch.tensor([[PAD] * (t - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (t - len(r)) + [1] * len(r) for r in rows])
    inputs = {"input_ids": ids, "attention_mask": mask, **pix}
    return model, inputs
