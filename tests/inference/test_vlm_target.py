"""HF image-text-to-text models through `HFVLMTarget`: greedy, beam and sampled decoding equal
HF `generate` token for token (tiny random Qwen2-VL, Qwen3-VL, LLaVA and Idefics3, batches of 3
images with prompts of other lengths, left-padded), and speculative decoding with a random
drafter equals greedy (image prefix in the context, text drafted)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.inference import spec_helpers, vlm_helpers  # noqa: E402
from vltrain.inference import speculative  # noqa: E402
from vltrain.inference.decoding import generate  # noqa: E402
from vltrain.inference.vlm_target import (  # noqa: E402
    HFVLMTarget,
    decode_vlm_captions,
    left_align,
)

MAX_NEW = 10
KINDS = ["qwen2_vl", "qwen3_vl", "llava", "idefics3"]
EOS_NORM = {"qwen2_vl": 0.2, "qwen3_vl": 0.3, "llava": 0.2, "idefics3": 0.2}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def vlms(tmp_path_factory) -> dict:
    """kind -> (model, left-padded inputs, directory or None), built once per module."""
    built: dict = {}

    def get(kind: str):
        if kind not in built:
            if kind == "idefics3":
                built[kind] = (*vlm_helpers.idefics3(EOS_NORM[kind]), None)
            else:
                out = tmp_path_factory.mktemp(kind)
                built[kind] = vlm_helpers.saved_vlm(kind, out, EOS_NORM[kind])
        return built[kind]

    return get  # type: ignore[return-value]


CASES = {
    "greedy": ("greedy", {}),
    "beam": ("beam", dict(num_beams=3, length_penalty=0.7)),
    "beam-lp2-nret2": ("beam", dict(num_beams=3, length_penalty=2.0, num_return_sequences=2)),
    "sample": ("sample", dict(temperature=0.8, top_k=20, top_p=0.9, num_return_sequences=2)),
}


def _hf_kwargs(strategy: str, kw: dict) -> dict:
    if strategy == "sample":
        return dict(do_sample=True, **kw)
    return dict(do_sample=False, **kw)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_decoding_matches_hf_generate(vlms, kind: str, case: str) -> None:
    model, inputs, _ = vlms(kind)
    strategy, kw = CASES[case]
    mask = inputs["attention_mask"]
    assert len(set(mask.sum(1).tolist())) == 3 and not bool(mask[:, 0].all())  # left padding
    torch.manual_seed(7)
    out = generate(HFVLMTarget(model), inputs, strategy, max_new_tokens=MAX_NEW, **kw)
    torch.manual_seed(7)
    ref = model.generate(
        **inputs,
        max_new_tokens=MAX_NEW,
        return_dict_in_generate=True,
        output_scores=True,
        **_hf_kwargs(strategy, kw),
    )
    expected = ref.sequences[:, inputs["input_ids"].shape[1] :]  # EOS = PAD: HF's filler too
    assert out.sequences.shape == expected.shape, (out.sequences, expected)
    assert torch.equal(out.sequences, expected), (out.sequences, expected)
    if strategy == "beam":
        torch.testing.assert_close(out.scores, ref.sequences_scores, rtol=0, atol=1e-5)
    if case == "greedy":  # not vacuous: rows end at EOS and at the length limit
        assert bool((out.lengths < MAX_NEW).any()) and bool((out.lengths == MAX_NEW).any())


def test_sampling_depends_on_the_seed(vlms) -> None:
    """Negative control of the sampling parity: another seed draws other tokens."""
    model, inputs, _ = vlms("qwen2_vl")
    target = HFVLMTarget(model)
    runs = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        runs.append(generate(target, inputs, "sample", max_new_tokens=MAX_NEW).sequences)
    assert not torch.equal(*runs)


def test_left_align_moves_padding_and_prefill_refuses_right_padding(vlms) -> None:
    model, inputs, _ = vlms("qwen2_vl")
    mask = inputs["attention_mask"]
    n = mask.sum(1)
    right = dict(inputs)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        right[key] = torch.stack(
            [torch.cat([r[m.bool()], r[~m.bool()]]) for r, m in zip(inputs[key], mask, strict=True)]
        )
    assert not torch.equal(right["input_ids"], inputs["input_ids"])
    with pytest.raises(ValueError, match="left-padded"):
        HFVLMTarget(model).prefill(**right)
    back = left_align(right)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        assert torch.equal(back[key], inputs[key]), key
    assert back["pixel_values"] is inputs["pixel_values"]
    assert torch.equal(back["attention_mask"].sum(1), n)
    holes = right["attention_mask"].clone()
    holes[:, 1] = 0  # a hole inside the real tokens: neither left- nor right-padded
    with pytest.raises(ValueError, match="right-padded"):
        left_align(dict(right, attention_mask=holes))


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava"])
def test_decode_vlm_captions_decodes_hf_generate(vlms, kind: str) -> None:
    from transformers import AutoTokenizer

    model, inputs, path = vlms(kind)
    tok = AutoTokenizer.from_pretrained(path)
    caps = decode_vlm_captions(model, tok, inputs, strategy="beam", num_beams=3, max_new_tokens=6)
    ref = model.generate(**inputs, max_new_tokens=6, num_beams=3, do_sample=False)
    new = ref[:, inputs["input_ids"].shape[1] :]
    assert caps == [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]
    assert len(caps) == 3 and any(caps)


def test_decode_vlm_captions_refuses_a_prompt_past_the_positions(vlms) -> None:
    model, inputs, path = vlms("llava")
    target = HFVLMTarget(model)
    assert target.room(inputs["input_ids"].shape[1]) == 256 - inputs["input_ids"].shape[1]
    long = {k: v.repeat(1, 5) if k != "pixel_values" else v for k, v in inputs.items()}
    with pytest.raises(ValueError, match="positions"):
        decode_vlm_captions(model, None, long)


# ----------------------------------------------------------------------------- speculative


@pytest.mark.parametrize("budget", [0, 6])
@pytest.mark.parametrize("kind", KINDS)
def test_speculative_greedy_is_lossless(vlms, kind: str, budget: int, monkeypatch) -> None:
    """Chain (0) and DDTree (6 nodes) verification with a random drafter, and with an oracle
    drafter (long accepted paths: the cache and M-RoPE positions are compacted every round)."""
    model, inputs, _ = vlms(kind)
    n_new = 16
    ref = spec_helpers.greedy_reference(HFVLMTarget(model), inputs, n_new)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    target = HFVLMTarget(model, list(range(layers)))  # the last block's read by hook
    drafter = spec_helpers.random_drafter(target)
    out, _ = speculative.speculative_generate(target, drafter, inputs, n_new, tree_budget=budget)
    assert out == ref
    first = inputs["attention_mask"].sum(1).tolist()  # text position of the first new token
    vocab = target.vocab_size
    monkeypatch.setattr(speculative, "_draft", spec_helpers.oracle_draft(ref, first, vocab, 0.7))
    out, stats = speculative.speculative_generate(
        target, drafter, inputs, n_new, tree_budget=budget
    )
    assert out == ref and stats.tau > 1.5


def test_features_give_the_decoding_logits(vlms) -> None:
    """``features`` of prompt + greedy caption (images in) score each caption
    token as the cached decoding did: the drafter trains on what it is deployed against."""
    model, inputs, _ = vlms("qwen2_vl")
    target = HFVLMTarget(model, [0, 1])
    out = generate(target, inputs, "greedy", max_new_tokens=4)
    new = out.sequences  # (B, 4)
    batch = dict(inputs)
    batch["input_ids"] = torch.cat([inputs["input_ids"], new], 1)
    batch["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(new)], 1)
    batch["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], 0 * new], 1)
    ctx, logits, prefix = target.features(**batch)
    t = inputs["input_ids"].shape[1]
    assert prefix == 0 and ctx.features.shape == (*batch["input_ids"].shape, 2 * target.width)
    greedy = logits[:, t - 1 : t + 3].argmax(-1)  # (B, 4) the token after each position
    live = torch.arange(4)[None, :] < out.lengths[:, None]
    assert torch.equal(greedy[live], out.sequences[live])
    assert torch.equal(ctx.positions[:, -1], batch["attention_mask"].sum(1) - 1)
