"""Built-in towers, causal decoder with KV cache, and dual encoder on tiny presets (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vltrain.models.dual_encoder import DualEncoder
from vltrain.models.layers import build_attention_mask, reorder_cache
from vltrain.models.presets import TEXT_PRESETS, VISION_PRESETS, text_config, vision_config
from vltrain.models.text import CausalDecoder, TextTower, TextTowerConfig
from vltrain.models.vit import VisionTower, VisionTowerConfig

VOCAB = 97


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _block_keys(prefix: str, n: int) -> list[str]:
    names = ["norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"]
    return [
        f"{prefix}blocks.{i}.{m}.{p}" for i in range(n) for m in names for p in ("weight", "bias")
    ]


GOLDEN_DUAL_KEYS = sorted(
    ["vision.class_token", "vision.pos_embed", "vision.patch_embed.weight"]
    + ["vision.norm_pre.weight", "vision.norm_pre.bias", "vision.norm.weight", "vision.norm.bias"]
    + _block_keys("vision.", 2)
    + ["text.pos_embed", "text.token_embed.weight", "text.norm.weight", "text.norm.bias"]
    + _block_keys("text.", 2)
    + ["vision_proj.weight", "text_proj.weight"]
)


def _dual(seed: int = 0, **kw) -> DualEncoder:
    torch.manual_seed(seed)
    return DualEncoder.from_preset("tiny", "tiny", 128, vocab_size=VOCAB, **kw)


def _decoder(seed: int = 0, tie: bool = True, context: int = 48) -> CausalDecoder:
    torch.manual_seed(seed)
    return CausalDecoder(text_config("tiny", VOCAB, context_length=context), tie_weights=tie).eval()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- configs, presets


def test_presets_build_valid_configs() -> None:
    for name in VISION_PRESETS:
        assert vision_config(name).num_patches > 0
    for name in TEXT_PRESETS:
        assert text_config(name, VOCAB).vocab_size == VOCAB
    assert vision_config("base").width == 768 and text_config("base", 10).width == 512
    tiny = vision_config("tiny")
    assert (tiny.image_size, tiny.patch_size, tiny.width) == (64, 8, 128)


def test_config_errors_are_readable() -> None:
    with pytest.raises(ValueError, match="divisible by heads"):
        VisionTowerConfig(image_size=64, patch_size=8, width=130, layers=1, heads=4)
    with pytest.raises(ValueError, match="must divide"):
        VisionTowerConfig(image_size=60, patch_size=8, width=128, layers=1, heads=4)
    with pytest.raises(ValueError, match="positive"):
        TextTowerConfig(vocab_size=0, context_length=8, width=32, layers=1, heads=2)
    with pytest.raises(ValueError, match="Did you mean 'tiny'"):
        vision_config("tiyn")


# --------------------------------------------------------------------------- shapes, keys, init


def test_shapes() -> None:
    torch.manual_seed(0)
    vit = VisionTower(vision_config("tiny"))
    images = torch.rand(3, 3, 64, 64)
    assert vit(images).shape == (3, 1 + 64, 128)
    assert vit.pooled(images).shape == (3, 128)
    txt = TextTower(text_config("tiny", VOCAB))
    ids = torch.randint(4, VOCAB, (3, 11))
    assert txt(ids, torch.ones_like(ids)).shape == (3, 11, 128)
    assert txt.pooled(ids, torch.ones_like(ids)).shape == (3, 128)
    dec = _decoder()
    assert dec(ids, prefix_embeds=torch.randn(3, 5, 128)).shape == (3, 16, VOCAB)


def test_input_validation() -> None:
    vit = VisionTower(vision_config("tiny"))
    with pytest.raises(ValueError, match=r"\(B, 3, 64, 64\)"):
        vit(torch.rand(2, 3, 32, 32))
    txt = TextTower(text_config("tiny", VOCAB))
    with pytest.raises(ValueError, match="exceeds context_length 32"):
        txt(torch.zeros(1, 33, dtype=torch.long))
    dec = _decoder(context=16)
    with pytest.raises(ValueError, match="exceeds context_length 16"):
        dec(torch.zeros(1, 10, dtype=torch.long), prefix_embeds=torch.zeros(1, 7, 128))
    with pytest.raises(ValueError, match="prefix_embeds"):
        dec(torch.zeros(2, 3, dtype=torch.long), prefix_embeds=torch.zeros(2, 2, 64))


def test_state_dict_keys_golden() -> None:
    model = _dual()
    assert sorted(model.state_dict()) == GOLDEN_DUAL_KEYS
    # Normalisation constants are buffers that never reach a checkpoint.
    assert "vision.pixel_mean" not in model.state_dict()
    tied = set(_decoder(tie=True).state_dict())
    untied = set(_decoder(tie=False).state_dict())
    assert untied - tied == {"lm_head.weight"}
    assert "blocks.0.attn.qkv.weight" in tied


def test_init_is_small_normal_with_zero_biases() -> None:
    model = _dual()
    for name, p in model.named_parameters():
        if name.endswith("bias") and "norm" not in name:
            assert torch.count_nonzero(p) == 0, name
        if name.endswith("qkv.weight") or name.endswith("token_embed.weight"):
            assert 0.015 < p.std().item() < 0.025, name


def test_seed_determinism_and_negative_control() -> None:
    a, b, c = _dual(0), _dual(0), _dual(1)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key
    assert not torch.equal(a.text_proj.weight, c.text_proj.weight)
    images = torch.rand(2, 3, 64, 64, generator=_gen(0))
    assert torch.equal(a.encode_image(images), b.encode_image(images))


def test_weight_tying() -> None:
    dec = _decoder(tie=True)
    h = torch.randn(1, 2, 128)
    assert torch.equal(dec.logits(h), h @ dec.embed_tokens.weight.T)
    untied = _decoder(tie=False)
    assert untied.lm_head is not None
    assert untied.lm_head.weight.data_ptr() != untied.embed_tokens.weight.data_ptr()


# --------------------------------------------------------------------------- text tower masks


def test_text_tower_padding_left_right_and_pooling() -> None:
    torch.manual_seed(0)
    txt = TextTower(text_config("tiny", VOCAB)).eval()
    seq = torch.randint(4, VOCAB, (1, 6), generator=_gen(1))
    right = torch.cat([seq, torch.full((1, 3), 7)], 1)  # pad ids deliberately non-zero
    left = torch.cat([torch.full((1, 3), 9), seq], 1)
    mask_r = torch.tensor([[1] * 6 + [0] * 3])
    mask_l = torch.tensor([[0] * 3 + [1] * 6])
    ref = txt(seq)[:, -1]
    assert torch.allclose(txt.pooled(right, mask_r), ref, atol=1e-5)
    assert torch.allclose(txt.pooled(left, mask_l), ref, atol=1e-5)
    assert torch.allclose(txt(right, mask_r)[:, :6], txt(seq), atol=1e-5)
    # Negative control: ignoring the mask lets padding change the real tokens' states.
    assert not torch.allclose(txt(right)[:, :6], txt(seq), atol=1e-3)


@pytest.mark.parametrize("causal", [True, False])
def test_text_tower_mean_pooling(causal: bool) -> None:
    """pool=mean: the mean over the real tokens, the same with left or right padding; with
    causal=True a token's state depends only on the words before it."""
    torch.manual_seed(0)
    txt = TextTower(text_config("tiny", VOCAB, causal=causal, pool="mean")).eval()
    seq = torch.randint(4, VOCAB, (1, 6), generator=_gen(2))
    right = torch.cat([seq, torch.full((1, 3), 7)], 1)
    left = torch.cat([torch.full((1, 3), 9), seq], 1)
    mask_r = torch.tensor([[1] * 6 + [0] * 3])
    mask_l = torch.tensor([[0] * 3 + [1] * 6])
    ref = txt(seq).mean(dim=1)
    assert torch.allclose(txt.pooled(seq), ref, atol=1e-6)
    assert torch.allclose(txt.pooled(right, mask_r), ref, atol=1e-5)
    assert torch.allclose(txt.pooled(left, mask_l), ref, atol=1e-5)
    assert not torch.allclose(ref, txt(seq)[:, -1], atol=1e-3)  # not the last token
    changed = seq.clone()
    changed[0, -1] = 4 if seq[0, -1] != 4 else 5
    first_unchanged = torch.allclose(txt(changed)[:, 0], txt(seq)[:, 0], atol=1e-6)
    assert first_unchanged == causal  # the first token sees the last word only if bidirectional
    with pytest.raises(ValueError, match="pool"):
        text_config("tiny", VOCAB, pool="max")


@pytest.mark.parametrize("causal", [True, False])
def test_text_tower_relative_position_bias(causal: bool) -> None:
    """rel_pos: zero at init (the plain tower's outputs), padding-invariant once learned, causal
    masking kept, and a bias that favours keys after the query changes the states."""
    torch.manual_seed(0)
    plain = TextTower(text_config("tiny", VOCAB, causal=causal)).eval()
    torch.manual_seed(0)
    rel = TextTower(text_config("tiny", VOCAB, causal=causal, rel_pos=3)).eval()
    assert rel.rel_bias is not None and rel.rel_bias.shape == (7, 4)
    assert "rel_bias" in rel.no_weight_decay()
    seq = torch.randint(4, VOCAB, (1, 6), generator=_gen(3))
    assert torch.allclose(rel(seq), plain(seq), atol=1e-6)  # zero bias = no change
    with torch.no_grad():
        rel.rel_bias.copy_(torch.randn(7, 4, generator=_gen(4)))
    right = torch.cat([seq, torch.full((1, 3), 7)], 1)
    left = torch.cat([torch.full((1, 3), 9), seq], 1)
    ref = rel(seq)
    assert not torch.allclose(ref, plain(seq), atol=1e-3)
    assert torch.allclose(rel(right, torch.tensor([[1] * 6 + [0] * 3]))[:, :6], ref, atol=1e-5)
    assert torch.allclose(rel(left, torch.tensor([[0] * 3 + [1] * 6]))[:, 3:], ref, atol=1e-5)
    changed = seq.clone()
    changed[0, -1] = 4 if seq[0, -1] != 4 else 5
    assert torch.allclose(rel(changed)[:, :5], ref[:, :5], atol=1e-6) == causal
    with pytest.raises(ValueError, match="rel_pos"):
        text_config("tiny", VOCAB, rel_pos=-1)


def test_all_padding_row_is_finite() -> None:
    txt = TextTower(text_config("tiny", VOCAB)).eval()
    ids = torch.randint(4, VOCAB, (2, 5))
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    assert torch.isfinite(txt(ids, mask)).all()
    attn, is_causal = build_attention_mask(mask, 5, causal=True)
    assert attn is not None and not is_causal and attn.shape == (2, 1, 5, 5)
    # Older torch (>= 2.3 is supported) returns NaN for all-masked rows: none may exist.
    assert attn.any(dim=-1).all()
    assert not attn[0, 0, :3, 3:].any()  # real queries never see padding keys


def test_decoder_is_causal_and_encoder_is_not() -> None:
    dec = _decoder()
    txt = TextTower(text_config("tiny", VOCAB)).eval()
    ids = torch.randint(4, VOCAB, (1, 8), generator=_gen(2))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % VOCAB
    assert torch.allclose(dec(ids)[:, :-1], dec(changed)[:, :-1], atol=1e-6)
    assert not torch.allclose(txt(ids)[:, :-1], txt(changed)[:, :-1], atol=1e-4)


def test_decoder_right_padding_needs_no_mask() -> None:
    # Causal attention never looks right, so a right-padded training batch may skip the mask
    # (and take SDPA's is_causal fast path) with identical logits at real positions.
    dec = _decoder()
    ids = torch.randint(4, VOCAB, (2, 8), generator=_gen(12))
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    prefix = torch.randn(2, 3, 128, generator=_gen(13))
    masked = dec(ids, mask, prefix_embeds=prefix)
    unmasked = dec(ids, prefix_embeds=prefix)
    torch.testing.assert_close(masked[1, : 3 + 5], unmasked[1, : 3 + 5], atol=1e-5, rtol=0)
    torch.testing.assert_close(masked[0], unmasked[0], atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- KV cache


def _incremental(dec, ids, prefix=None, mask=None, first=3):
    """Logits from a prompt of `first` tokens, then one token at a time with the cache."""
    m0 = None if mask is None else mask[:, :first]
    logits, cache = dec(ids[:, :first], m0, prefix_embeds=prefix, use_cache=True)
    outs = [logits]
    for t in range(first, ids.shape[1]):
        mt = None if mask is None else mask[:, t : t + 1]
        step, cache = dec(ids[:, t : t + 1], mt, kv_cache=cache, use_cache=True)
        outs.append(step)
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("with_prefix", [False, True])
def test_kv_cache_matches_full_forward(with_prefix: bool) -> None:
    dec = _decoder()
    ids = torch.randint(4, VOCAB, (2, 9), generator=_gen(3))
    prefix = torch.randn(2, 4, 128, generator=_gen(4)) if with_prefix else None
    full = dec(ids, prefix_embeds=prefix)
    inc, cache = _incremental(dec, ids, prefix)
    assert inc.shape == full.shape == (2, 9 + (4 if with_prefix else 0), VOCAB)
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=0)
    assert cache.length == full.shape[1] and len(cache.layers) == 2
    if with_prefix:  # negative control: the prefix really conditions the text
        assert not torch.allclose(dec(ids)[:, -1], full[:, -1], atol=1e-3)


def test_kv_cache_with_left_padding_matches_unpadded_rows() -> None:
    dec = _decoder()
    g = _gen(5)
    short, long = (
        torch.randint(4, VOCAB, (1, 4), generator=g),
        torch.randint(4, VOCAB, (1, 7), generator=g),
    )
    prompt = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long], 0)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    prefix = torch.randn(2, 2, 128, generator=g)
    cont = torch.randint(4, VOCAB, (2, 3), generator=g)
    ids = torch.cat([prompt, cont], 1)
    full_mask = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
    inc, _ = _incremental(dec, ids, prefix, full_mask, first=7)
    batched_full = dec(ids, full_mask, prefix_embeds=prefix)
    for row, seq in enumerate([torch.cat([short, cont[:1]], 1), torch.cat([long, cont[1:]], 1)]):
        ref = dec(seq, prefix_embeds=prefix[row : row + 1])[0]  # (P + T_row, V)
        n = seq.shape[1]
        torch.testing.assert_close(inc[row, -n:], ref[-n:], atol=1e-5, rtol=0)
        torch.testing.assert_close(inc[row, :2], ref[:2], atol=1e-5, rtol=0)
        torch.testing.assert_close(batched_full[row, -n:], ref[-n:], atol=1e-5, rtol=0)
    # Negative control: without the mask the padded row's logits differ.
    no_mask = dec(ids, prefix_embeds=prefix)
    assert not torch.allclose(no_mask[0, -1], inc[0, -1], atol=1e-3)


def test_reorder_cache_for_beam_search() -> None:
    dec = _decoder()
    g = _gen(6)
    prompt = torch.randint(4, VOCAB, (2, 5), generator=g)
    prefix = torch.randn(2, 3, 128, generator=g)
    _, cache = dec(prompt, prefix_embeds=prefix, use_cache=True)
    beams = torch.tensor([1, 0, 0, 1, 1])  # expand + reorder, as beam search does
    cache = reorder_cache(cache, beams)
    nxt = torch.randint(4, VOCAB, (5, 2), generator=g)
    step, _ = dec(nxt, kv_cache=cache, use_cache=True)
    ref = dec(torch.cat([prompt[beams], nxt], 1), prefix_embeds=prefix[beams])[:, -2:]
    torch.testing.assert_close(step, ref, atol=1e-5, rtol=0)
    # Negative control: rows taken in the wrong order no longer match.
    _, wrong = dec(prompt, prefix_embeds=prefix, use_cache=True)
    wrong = reorder_cache(wrong, torch.tensor([0, 1, 1, 0, 0]))
    bad, _ = dec(nxt, kv_cache=wrong, use_cache=True)
    assert not torch.allclose(bad, ref, atol=1e-3)


# --------------------------------------------------------------------------- dual encoder


def test_dual_encoder_unit_norm_fp32_and_bf16_autocast() -> None:
    model = _dual().eval()
    images = torch.rand(4, 3, 64, 64, generator=_gen(7))
    ids = torch.randint(4, VOCAB, (4, 10), generator=_gen(8))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    img, txt = model(images, ids, mask)
    assert img.shape == txt.shape == (4, 128) and img.dtype == torch.float32
    torch.testing.assert_close(img.norm(dim=-1), torch.ones(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(txt.norm(dim=-1), torch.ones(4), atol=1e-5, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        img16, txt16 = model(images, ids, mask)
        assert model.encode_image(images, normalize=False).dtype == torch.bfloat16
    assert img16.dtype == torch.float32 and torch.isfinite(img16).all()
    torch.testing.assert_close(img16.norm(dim=-1), torch.ones(4), atol=1e-5, rtol=0)
    assert F.cosine_similarity(img16, img).min() > 0.98
    assert F.cosine_similarity(txt16, txt).min() > 0.98


def test_dropout_only_in_train_mode() -> None:
    model = _dual(dropout=0.2)
    ids = torch.randint(4, VOCAB, (2, 6), generator=_gen(9))
    model.train()
    assert not torch.allclose(model.encode_text(ids), model.encode_text(ids))
    model.eval()
    assert torch.equal(model.encode_text(ids), model.encode_text(ids))


def _accuracy(img: torch.Tensor, txt: torch.Tensor) -> float:
    logits = img @ txt.T  # (B, B)
    target = torch.arange(len(img))
    i2t = (logits.argmax(1) == target).float().mean()
    t2i = (logits.argmax(0) == target).float().mean()
    return min(i2t.item(), t2i.item())


def test_overfit_16_pairs_with_infonce() -> None:
    # Smaller than `tiny` (16 patches, width 64) so 100 steps stay fast on a busy 2-core CPU.
    torch.manual_seed(0)
    v_cfg = VisionTowerConfig(image_size=32, patch_size=8, width=64, layers=2, heads=4)
    model = DualEncoder(v_cfg, TextTowerConfig(VOCAB, 16, 64, 2, 4), embed_dim=64)
    images = torch.rand(16, 3, 32, 32, generator=_gen(10))
    ids = torch.randint(4, VOCAB, (16, 12), generator=_gen(11))
    mask = torch.ones_like(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    target = torch.arange(16)
    with torch.no_grad():
        before = _accuracy(*model(images, ids, mask))
    for _ in range(100):
        img, txt = model(images, ids, mask)
        logits = img @ txt.T / 0.07  # (16, 16)
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if _accuracy(img.detach(), txt.detach()) == 1.0 and loss.item() < 0.1:
            break
    model.eval()
    with torch.no_grad():
        after = _accuracy(*model(images, ids, mask))
    assert before < 0.5  # negative control: an untrained model does not already match
    assert after >= 0.9, f"in-batch accuracy {after:.2f} after training"
