"""Decoding parity with HF `generate` (tiny random Llama / LLaVA / Qwen2-VL) and sampling checks."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import tiny_causal_lm
from vltrain.inference.decoding import GenerationOutput, generate, top_k_filter, top_p_filter

transformers = pytest.importorskip("transformers")
from vltrain.inference.hf_target import HFTarget  # noqa: E402

V, PAD, BOS, EOS, IMG = 96, 0, 1, 2, 95
MAX_NEW = 10


def _text_config() -> transformers.LlamaConfig:
    return tiny_causal_lm("llama", V, layers=2, max_positions=128, special=(BOS, EOS, PAD))[0]


def _boost_eos(model: torch.nn.Module, norm: float) -> None:
    """Rescale the EOS row of lm_head so that EOS wins in some contexts: beams finish early."""
    with torch.no_grad():
        row = model.lm_head.weight[EOS]
        row.mul_(norm / row.norm())


def _left_pad(prompt: torch.Tensor, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    prompt, mask = prompt.clone(), torch.ones_like(prompt)
    for b, n in enumerate(pads):
        if n:
            prompt[b] = torch.cat([torch.full((n,), PAD), prompt[b, :-n]])
            mask[b, :n] = 0
    return prompt, mask


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_text_config()).eval()
    _boost_eos(model, 0.25)
    g = torch.Generator().manual_seed(3)
    prompt = torch.cat([torch.full((5, 1), BOS), torch.randint(3, V, (5, 7), generator=g)], 1)
    ids, mask = _left_pad(prompt, [0, 3, 1, 0, 2])
    return model, {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def llava():
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=32,
    )  # 16 patches + CLS
    cfg = transformers.LlavaConfig(
        vision_config=vision,
        text_config=_text_config(),
        image_token_id=IMG,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    _boost_eos(model, 0.25)
    g = torch.Generator().manual_seed(1)
    b = 5
    txt = torch.randint(3, IMG, (b, 6), generator=g)
    prompt = torch.cat([torch.full((b, 1), BOS), torch.full((b, 16), IMG), txt], 1)
    ids, mask = _left_pad(prompt, [0, 2, 0, 3, 1])
    pixels = torch.randn(b, 3, 16, 16, generator=g)
    return model, {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


@pytest.fixture(scope="module")
def qwen2vl():
    torch.manual_seed(0)
    text = _text_config().to_dict() | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}
    }
    vision = dict(
        depth=2,
        embed_dim=32,
        hidden_size=32,
        num_heads=4,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
        mlp_ratio=2,
    )
    cfg = transformers.Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IMG,
        video_token_id=94,
        vision_start_token_id=93,
        vision_end_token_id=92,
    )
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    _boost_eos(model, 0.25)
    g = torch.Generator().manual_seed(1)
    b = 3  # grid (1, 4, 4) = 16 patches -> 4 image tokens after the 2x2 merge
    txt = torch.randint(3, 90, (b, 5), generator=g)
    prompt = torch.cat(
        [torch.full((b, 1), 93), torch.full((b, 4), IMG), torch.full((b, 1), 92), txt], 1
    )
    ids, mask = _left_pad(prompt, [0, 2, 1])
    return model, {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": torch.randn(b * 16, 24, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]] * b),
        "mm_token_type_ids": (ids == IMG).int(),
    }


def _hf_new_tokens(ref: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """HF's new tokens with everything after the first EOS set to PAD.

    HF fills finished beams with `pad_token_id or eos_token_id`, i.e. with EOS when pad is 0;
    vltrain always pads with pad_token_id. Only the filler differs, which this normalises.
    """
    new = ref[:, prompt_len:].clone()
    after_eos = (new == EOS).int().cumsum(1) - (new == EOS).int() > 0
    return new.masked_fill(after_eos, PAD)


def _check_against_hf(model, inputs, out: GenerationOutput, **hf_kwargs) -> torch.Tensor:
    ref = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        eos_token_id=EOS,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_scores=True,
        **hf_kwargs,
    )
    expected = _hf_new_tokens(ref.sequences, inputs["input_ids"].shape[1])
    assert out.sequences.shape == expected.shape, (out.sequences, expected)
    assert torch.equal(out.sequences, expected), (out.sequences, expected)
    if hf_kwargs.get("num_beams", 1) > 1:
        torch.testing.assert_close(out.scores, ref.sequences_scores, rtol=0, atol=1e-5)
    return ref


def _assert_some_finished_early(out: GenerationOutput) -> None:
    """Guard against a vacuous EOS test: some rows must end on EOS before max_new_tokens."""
    assert bool((out.lengths < MAX_NEW).any()), out.lengths


GREEDY_CASES = [
    dict(),
    dict(min_new_tokens=3),
    dict(no_repeat_ngram_size=2, min_new_tokens=2),
]


@pytest.mark.parametrize("kw", GREEDY_CASES, ids=["plain", "min_new", "ngram"])
@pytest.mark.parametrize("which", ["llama", "llava"])
def test_greedy_matches_hf(which: str, kw: dict, request: pytest.FixtureRequest) -> None:
    model, inputs = request.getfixturevalue(which)
    out = generate(HFTarget(model), inputs, "greedy", max_new_tokens=MAX_NEW, **kw)
    _check_against_hf(model, inputs, out, **kw)
    if not kw:
        _assert_some_finished_early(out)
        assert bool((out.lengths == MAX_NEW).any())  # and some run to the limit
    # lengths / padding / log-prob bookkeeping
    width = torch.arange(out.sequences.shape[1])[None, :]
    assert torch.equal(
        out.sequences[width >= out.lengths[:, None]],
        torch.full_like(out.sequences[width >= out.lengths[:, None]], PAD),
    )
    assert bool((out.token_logprobs[width < out.lengths[:, None]] < 0).all())
    assert bool((out.sequences[width < out.lengths[:, None] - 1] != EOS).all())


BEAM_CASES = [
    dict(num_beams=4),
    dict(num_beams=3, length_penalty=2.0, early_stopping=True),
    dict(num_beams=5, length_penalty=0.5, early_stopping="never", min_new_tokens=3),
    dict(num_beams=4, no_repeat_ngram_size=2, num_return_sequences=2),
    dict(num_beams=3, length_penalty=-1.0, min_new_tokens=2, no_repeat_ngram_size=3),
]
BEAM_IDS = ["nb4", "lp2-early", "lp0.5-never-min", "ngram-nret2", "lp-neg-min-ngram3"]


@pytest.mark.parametrize("kw", BEAM_CASES, ids=BEAM_IDS)
@pytest.mark.parametrize("which", ["llama", "llava"])
def test_beam_matches_hf(which: str, kw: dict, request: pytest.FixtureRequest) -> None:
    model, inputs = request.getfixturevalue(which)
    out = generate(HFTarget(model), inputs, "beam", max_new_tokens=MAX_NEW, **kw)
    _check_against_hf(model, inputs, out, **kw)
    n = kw.get("num_return_sequences", 1)
    assert out.sequences.shape[0] == inputs["input_ids"].shape[0] * n
    # beam score = sum of raw token log-probs / generated_len ** length_penalty (HF's rule)
    lp = kw.get("length_penalty", 1.0)
    expected = out.token_logprobs.sum(1) / out.lengths.double().pow(lp).float()
    torch.testing.assert_close(out.scores, expected, rtol=1e-5, atol=1e-5)


def test_beam_cases_exercise_early_eos_and_length_penalty(llava) -> None:
    """Negative controls: EOS really ends beams early here, and length_penalty changes results."""
    model, inputs = llava
    target = HFTarget(model)
    base = generate(target, inputs, "beam", max_new_tokens=MAX_NEW, num_beams=4)
    _assert_some_finished_early(base)
    longer = generate(
        target, inputs, "beam", max_new_tokens=MAX_NEW, num_beams=4, length_penalty=2.0
    )
    assert not torch.equal(base.lengths, longer.lengths)


def test_beam_drops_frozen_inputs_without_changing_results(llava) -> None:
    """Inputs whose finished hypotheses can no longer change leave the batch (HF keeps them)."""
    model, inputs = llava
    target = HFTarget(model)
    rows: list[int] = []
    reorder = target.reorder

    def spy(cache, index):
        rows.append(index.numel())
        return reorder(cache, index)

    target.reorder = spy  # type: ignore[method-assign]
    out = generate(target, inputs, "beam", max_new_tokens=MAX_NEW, num_beams=3)
    _check_against_hf(model, inputs, out, num_beams=3)
    full = inputs["input_ids"].shape[0] * 3
    assert rows[0] == full and min(rows) < full, rows  # the pruning path really ran


@pytest.mark.parametrize("which", ["llama", "llava"])
def test_greedy_drops_finished_rows_without_changing_results(
    which: str, request: pytest.FixtureRequest
) -> None:
    """A row that has emitted EOS leaves the batch (HF keeps computing it): each step feeds
    exactly the rows still running, and the tokens stay HF's."""
    model, inputs = request.getfixturevalue(which)
    target = HFTarget(model)
    fed: list[int] = []
    step = target.step

    def spy(tokens, cache):
        fed.append(tokens.shape[0])
        return step(tokens, cache)

    target.step = spy  # type: ignore[method-assign]
    out = generate(target, inputs, "greedy", max_new_tokens=MAX_NEW)
    _check_against_hf(model, inputs, out)
    _assert_some_finished_early(out)
    running = [int((out.lengths > t).sum()) for t in range(1, out.sequences.shape[1])]
    assert fed == running, (fed, out.lengths)
    assert min(fed) < inputs["input_ids"].shape[0]  # the dropping path really ran
    # sampling keeps the whole batch to the end (its draws must be HF's)
    fed.clear()
    torch.manual_seed(0)
    generate(target, inputs, "sample", max_new_tokens=MAX_NEW)
    assert set(fed) == {inputs["input_ids"].shape[0]}, fed


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_qwen2vl_matches_hf(qwen2vl, strategy: str) -> None:
    """Qwen2-VL: 3-D M-RoPE positions come from the model's own generation helper."""
    model, inputs = qwen2vl
    kw = {"num_beams": 3} if strategy == "beam" else {}
    out = generate(HFTarget(model), inputs, strategy, max_new_tokens=MAX_NEW, **kw)
    _check_against_hf(model, inputs, out, **kw)


# ----------------------------------------------------------------------------- sampling


def test_sampling_matches_hf_under_same_global_seed(llava) -> None:
    """generator=None draws from the global RNG exactly as HF's multinomial does."""
    model, inputs = llava
    kw = dict(temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(123)
    out = generate(
        HFTarget(model),
        inputs,
        "sample",
        max_new_tokens=MAX_NEW,
        num_return_sequences=3,
        **kw,
    )
    torch.manual_seed(123)
    ref = model.generate(
        **inputs,
        do_sample=True,
        max_new_tokens=MAX_NEW,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_return_sequences=3,
        **kw,
    )
    assert torch.equal(out.sequences, _hf_new_tokens(ref, inputs["input_ids"].shape[1]))
    torch.manual_seed(124)  # negative control: another seed gives other samples
    other = generate(
        HFTarget(model),
        inputs,
        "sample",
        max_new_tokens=MAX_NEW,
        num_return_sequences=3,
        **kw,
    )
    assert not torch.equal(out.sequences, other.sequences)


def test_sample_logprobs_are_raw_policy(llama) -> None:
    """token_logprobs = log_softmax(raw logits) of a teacher-forced forward, not the warped ones."""
    model, inputs = llama
    g = torch.Generator().manual_seed(0)
    out = generate(
        HFTarget(model),
        inputs,
        "sample",
        max_new_tokens=MAX_NEW,
        temperature=0.5,
        top_k=5,
        generator=g,
    )
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    valid = torch.arange(out.sequences.shape[1])[None, :] < out.lengths[:, None]
    full_mask = torch.cat([mask, valid.long()], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([ids, out.sequences], 1), attention_mask=full_mask, position_ids=pos
        ).logits.float()
    plen = ids.shape[1]
    lp = torch.log_softmax(logits[:, plen - 1 : -1], -1).gather(2, out.sequences[..., None])[..., 0]
    torch.testing.assert_close(out.token_logprobs[valid], lp[valid], rtol=0, atol=1e-4)
    # negative control: the temperature-0.5 log-probs are clearly different
    warped = torch.log_softmax(logits[:, plen - 1 : -1] / 0.5, -1).gather(
        2, out.sequences[..., None]
    )[..., 0]
    assert (warped[valid] - lp[valid]).abs().max() > 1e-2


def test_top_k_1_equals_greedy(llava) -> None:
    model, inputs = llava
    target = HFTarget(model)
    greedy = generate(target, inputs, "greedy", max_new_tokens=MAX_NEW)
    g = torch.Generator().manual_seed(7)
    sampled = generate(
        target, inputs, "sample", max_new_tokens=MAX_NEW, top_k=1, generator=g, temperature=1.3
    )
    assert torch.equal(sampled.sequences, greedy.sequences)
    torch.testing.assert_close(sampled.token_logprobs, greedy.token_logprobs)


def test_top_p_filter_matches_manual_reference() -> None:
    probs = torch.tensor(
        [[0.03, 0.40, 0.10, 0.25, 0.15, 0.07], [0.90, 0.04, 0.03, 0.015, 0.01, 0.005]]
    )
    logits = probs.log()
    # Hand-computed nucleus: sort descending, keep tokens until the kept mass reaches top_p
    # (row 0 cumulative: .40 .65 .80 .90 .97 1.0; row 1: .90 .94 .97 ...).
    cases = {
        0.5: ([1, 3], [0]),
        0.7: ([1, 3, 4], [0]),
        0.95: ([1, 3, 4, 2, 5], [0, 1, 2]),
        1.0: (list(range(6)), list(range(6))),
    }
    for top_p, keep in cases.items():
        kept = torch.isfinite(top_p_filter(logits, top_p))
        for row in range(2):
            assert sorted(kept[row].nonzero().flatten().tolist()) == sorted(keep[row]), (top_p, row)
    # min_tokens_to_keep overrides a tiny nucleus
    assert int(torch.isfinite(top_p_filter(logits, 0.01, min_tokens_to_keep=3)).sum(1)[0]) == 3
    assert torch.isfinite(top_k_filter(logits, 2)).sum(1).tolist() == [2, 2]


class _MarkovModel:
    """The part of a DecodeTarget that `generate` drives, with next-token logits that depend
    only on the last token: table[last]. The cache is the last token; there is no context."""

    eos_token_id, pad_token_id, bos_token_id = 0, 7, 1

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # (V, V)

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        last = input_ids[:, -1]
        return self.table[last], last, None

    def step(self, tokens: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.table[tokens], tokens

    def reorder(self, cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return cache[rows]


P = [0.04, 0.40, 0.25, 0.15, 0.10, 0.06]  # next-token probabilities after token 1; EOS is 0


def _empirical(out: GenerationOutput, vocab: int) -> torch.Tensor:
    return torch.bincount(out.sequences[:, 0], minlength=vocab).double() / out.sequences.shape[0]


def test_sampling_distribution_matches_expected_probabilities() -> None:
    """temperature 0.5 -> p^2; top_k 4 keeps {1,2,3,4}; top_p 0.9 then drops token 4."""
    table = torch.full((8, 8), -30.0)
    table[1, :6] = torch.tensor(P).log()
    model, n = _MarkovModel(table), 40_000
    out = generate(
        model,
        {"input_ids": torch.tensor([[1]])},
        "sample",
        max_new_tokens=1,
        temperature=0.5,
        top_k=4,
        top_p=0.9,
        num_return_sequences=n,
        generator=torch.Generator().manual_seed(0),
    )
    sq = {t: P[t] ** 2 for t in (1, 2, 3, 4)}  # top-4 of p^2, renormalised
    z4 = sum(sq.values())
    assert sq[4] / z4 <= 1 - 0.9  # ascending cumulative mass of token 4 alone <= 1 - top_p: dropped
    z3 = sq[1] + sq[2] + sq[3]
    expected = torch.zeros(8, dtype=torch.float64)
    for t in (1, 2, 3):
        expected[t] = sq[t] / z3
    freq = _empirical(out, 8)
    # 5 binomial standard deviations per token (with n=40k, sd <= 0.0025)
    tol = 5 * (expected * (1 - expected) / n).sqrt() + 1e-12
    assert bool(((freq - expected).abs() <= tol).all()), (freq, expected)
    assert freq[[0, 4, 5, 6, 7]].sum() == 0  # filtered tokens never drawn
    # negative control: the unwarped distribution is rejected by the same tolerance
    raw = torch.zeros(8, dtype=torch.float64)
    raw[:6] = torch.tensor(P, dtype=torch.float64)
    assert not bool(((freq - raw).abs() <= 5 * (raw * (1 - raw) / n).sqrt() + 1e-12).all())
    # log-probs are under the raw policy: log P[token]
    torch.testing.assert_close(
        out.token_logprobs[:, 0], table[1].log_softmax(-1)[out.sequences[:, 0]]
    )


def test_seeded_sampling_is_reproducible_and_pads_after_eos() -> None:
    g = torch.Generator().manual_seed(5)
    table = torch.randn(8, 8, generator=g)
    table[:, 7] = -30.0  # never sample PAD
    model = _MarkovModel(table)
    inputs = {"input_ids": torch.tensor([[1], [3], [5]])}

    def run(seed: int) -> GenerationOutput:
        return generate(
            model,
            inputs,
            "sample",
            max_new_tokens=12,
            num_return_sequences=4,
            generator=torch.Generator().manual_seed(seed),
        )

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.token_logprobs, b.token_logprobs)
    assert not torch.equal(a.sequences, c.sequences)
    assert a.sequences.shape[0] == 12
    assert bool((a.lengths < 12).any())  # EOS (0) happened
    for row, length in zip(a.sequences, a.lengths.tolist(), strict=True):
        if length < row.shape[0]:
            assert row[length - 1] == 0 and bool((row[length:] == 7).all())


def test_invalid_arguments_name_the_problem(llama) -> None:
    model, inputs = llama
    target = HFTarget(model)
    with pytest.raises(ValueError, match="strategy='topk'"):
        generate(target, inputs, "topk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_return_sequences=6"):
        generate(target, inputs, "beam", num_beams=5, num_return_sequences=6)
    with pytest.raises(ValueError, match="early_stopping"):
        generate(target, inputs, "beam", early_stopping="sometimes")
    with pytest.raises(ValueError, match="top_p"):
        generate(target, inputs, "sample", top_p=0.0)
