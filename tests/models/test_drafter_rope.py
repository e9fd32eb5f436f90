"""The drafter's rotary embedding equals transformers' to the bit: vLLM and SGLang serve an
exported drafter with transformers-style rotary frequencies (1 / theta ** (2i / d)), so a drafter
trained with another formula would be served a slightly different network."""

from __future__ import annotations

import pytest
import torch

from vltrain.models.drafter import rotate

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(("head_dim", "theta"), [(64, 10000.0), (144, 10000.0), (128, 1e6)])
def test_rotate_equals_transformers_rotary_embedding(head_dim: int, theta: float) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = transformers.LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_theta=theta,
        max_position_embeddings=8192,
    )
    x = torch.randn(1, 2, 64, head_dim, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(4000, 4064)[None]
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    want, _ = apply_rotary_pos_emb(x, x, cos, sin)
    assert torch.equal(rotate(x, pos, theta), want)
    # the formula the drafter used before (theta ** (-i / half)) is an ulp off: this test sees it
    half = head_dim // 2
    old = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = pos.float()[:, None, :, None] * old
    cos_o, sin_o = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    before = torch.cat([x1 * cos_o - x2 * sin_o, x2 * cos_o + x1 * sin_o], dim=-1)
    assert not torch.equal(before, want)
