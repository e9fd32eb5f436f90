"""Analytic FLOP counts (vltrain.scaling.flops) against torch.utils.flop_counter, within 5%."""

from __future__ import annotations

import pytest
import torch

from vltrain.models.captioner import Captioner
from vltrain.models.dual_encoder import DualEncoder
from vltrain.scaling import flops

B, T = 2, 12


def _caption_step(model):
    img = torch.rand(B, 3, 64, 64)
    ids = torch.randint(4, 300, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    fwd = flops.measure_flops(lambda: model(img, ids, mask))["total"] / B
    both = flops.measure_flops(lambda: model(img, ids, mask)["loss"].backward())["total"] / B
    return fwd, both


@pytest.mark.parametrize(
    "connector,options,freeze",
    [
        ("projector", {"pool": 2}, ["vision"]),
        ("projector", {"pool": 1, "projector_layers": 1}, []),
        ("gated_xattn", {"n_latents": 8, "resampler_layers": 1}, ["vision", "decoder"]),
    ],
)
def test_captioner_matches_flop_counter(connector, options, freeze):
    torch.manual_seed(0)
    model = Captioner.from_config(
        "tiny",
        "tiny",
        vocab_size=300,
        connector=connector,
        connector_options=options,
        max_text_len=T,
        text_dims={"layers": 1, "width": 64},
    )
    model.freeze(freeze)
    acct = flops.captioner_flops(model, T)
    fwd, both = _caption_step(model)
    assert acct.forward == pytest.approx(fwd, rel=0.05)
    assert acct.per_sample == pytest.approx(both, rel=0.05)
    if "vision" in freeze:  # the frozen tower is forward-only ...
        assert acct.components[0].backward == 0
        # ... and counting it as trained would miss the measurement (negative control)
        wrong = acct.per_sample + 2 * acct.components[0].forward
        assert abs(wrong / both - 1) > 0.05


def test_attention_counted_at_real_length():
    """CPU attention is counted (flop_counter has no CPU-kernel formula of its own) and grows
    with the sequence length as the analytic count does."""
    torch.manual_seed(0)
    model = Captioner.from_config("tiny", "tiny", vocab_size=300, max_text_len=40)
    short = flops.captioner_flops(model, 8).forward
    long = flops.captioner_flops(model, 40).forward
    img = torch.rand(1, 3, 64, 64)
    for t, expect in ((8, short), (40, long)):
        ids = torch.randint(4, 300, (1, t))
        got = flops.measure_flops(lambda ids=ids: model(img, ids, torch.ones_like(ids)))["total"]
        assert got == pytest.approx(expect, rel=0.01)
    assert long > short


@pytest.mark.parametrize("vision", ["tiny", "tiny_cnn"])
def test_dual_encoder_matches_flop_counter(vision):
    torch.manual_seed(0)
    model = DualEncoder.from_preset(vision, "tiny", 32, vocab_size=300, context_length=T)
    img, ids = torch.rand(B, 3, 64, 64), torch.randint(4, 300, (B, T))
    acct = flops.dual_encoder_flops(model, T)
    fwd = flops.measure_flops(lambda: model(img, ids))["total"] / B

    def step():
        a, b = model(img, ids)
        (a.sum() + b.sum()).backward()

    both = flops.measure_flops(step)["total"] / B
    assert acct.forward == pytest.approx(fwd, rel=0.05)
    assert acct.per_sample == pytest.approx(both, rel=0.05)
    # three texts per image (caption, a hard negative, a second caption): the text tower thrice
    three = flops.dual_encoder_flops(model, T, texts_per_sample=3)
    texts3 = torch.randint(4, 300, (3 * B, T))
    fwd3 = (
        flops.measure_flops(lambda: model.encode_image(img))["total"]
        + flops.measure_flops(lambda: model.encode_text(texts3))["total"]
    ) / B
    assert three.forward == pytest.approx(fwd3, rel=0.05)
    assert three.forward > acct.forward
    n_embed = model.text.token_embed.weight.numel() + model.text.pos_embed.numel()
    cls = model.vision.class_token.numel() if vision == "tiny" else 0  # tiny_cnn: flatten head
    assert acct.nonembed_params == sum(p.numel() for p in model.parameters()) - n_embed - (
        model.vision.pos_embed.numel() + cls
    )


def test_hf_clip_matches_flop_counter(tmp_path):
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=99,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=24,
    )
    torch.manual_seed(0)
    CLIPModel(cfg).save_pretrained(tmp_path)
    model = CLIPModel.from_pretrained(tmp_path, attn_implementation="sdpa")
    ids = torch.randint(0, 99, (B, T))
    pixels = torch.rand(B, 3, 32, 32)
    acct = flops.hf_dual_encoder_flops(model, T)
    got = (
        flops.measure_flops(
            lambda: (
                model.get_image_features(pixel_values=pixels),
                model.get_text_features(input_ids=ids),
            )
        )["total"]
        / B
    )
    assert acct.forward == pytest.approx(got, rel=0.05)
