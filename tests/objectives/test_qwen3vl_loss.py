"""objective.loss=qwen3vl (Qwen3-VL-Embedding's masked multi-term InfoNCE): both variants
against a float64 loop over every term of the report's formula, the false-negative mask on
planted copies of the positive (with controls), GradCache's gradients, config and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vltrain.config.core import ConfigError
from vltrain.config.schema import ObjectiveConfig, load_config
from vltrain.models.contrastive import ContrastiveModel
from vltrain.models.dual_encoder import DualEncoder
from vltrain.models.presets import text_config, vision_config
from vltrain.objectives import qwen3vl
from vltrain.objectives.contrastive import Qwen3VLLoss, build_loss, build_loss_from_config
from vltrain.objectives.grad_cache import dual_encoder_grad_cache, length_sorted_chunks
from vltrain.stages import load_run_config

N, K, E = 6, 2, 8


def _unit(n: int, g: torch.Generator) -> torch.Tensor:
    return F.normalize(torch.randn(n, E, generator=g, dtype=torch.float64), dim=-1).float()


def _feats(seed: int = 0, k: int = K) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = _unit(N, g)
    q[1] = F.normalize(q[0] + 0.2 * q[1], dim=0)  # two near-identical queries: masked in-batch
    d = F.normalize(q + 0.8 * _unit(N, g), dim=-1)  # positives near their queries
    d[5] = F.normalize(q[4] + 0.1 * d[5], dim=0)  # scores far above s(q_4, d_4): masked for q_4
    neg = F.normalize(q.repeat_interleave(k, 0) + 1.2 * _unit(N * k, g), dim=-1)
    return [t.requires_grad_(True) for t in (q, d, neg)]


def brute_qwen3vl(q, d, neg, k, tau, terms, margin, mask=True, dup=qwen3vl.DUPLICATE_COSINE):
    """-1/N sum_i log(e^{s(q_i,d_i)/tau} / Z_i), Z_i summed term by term (float64 loops);
    m = 0 where s > s(q_i, d_i) + margin or the document is d_i (cosine >= dup)."""
    q, d = q.double(), d.double()
    neg = None if neg is None else neg.double()
    total = 0.0
    for i in range(len(q)):
        pos = q[i] @ d[i]

        def term(s, doc=None, i=i, pos=pos):
            if mask and s.item() > pos.item() + margin:
                return 0.0
            if mask and doc is not None and (d[i] @ doc).item() >= dup:
                return 0.0
            return torch.exp(s / tau)

        z = torch.exp(pos / tau)
        for j in range(k):  # query i's own hard negatives
            z = z + term(q[i] @ neg[i * k + j], neg[i * k + j])
        others = [j for j in range(len(q)) if j != i]
        for j in others:
            z = z + term(q[i] @ d[j], d[j])  # query-doc
        if terms == "five":
            for j in others:
                z = z + term(q[i] @ q[j])  # query-query
            for j in others:
                z = z + term(d[i] @ d[j], d[j])  # doc-doc
        total = total - torch.log(torch.exp(pos / tau) / z)
    return total / len(q)


def _loss(terms: str, **kw) -> Qwen3VLLoss:
    return build_loss("qwen3vl", terms=terms, temperature=0.1, gather=False, **kw)


@pytest.mark.parametrize("terms", ["five", "two"])
@pytest.mark.parametrize("with_neg", [True, False])
@pytest.mark.parametrize("mask", [True, False])
def test_matches_brute_force_over_every_term(terms: str, with_neg: bool, mask: bool) -> None:
    q, d, neg = _feats()
    neg_in = neg if with_neg else None
    loss, m = _loss(terms, mask=mask)(q, d, neg_in)
    want = brute_qwen3vl(q, d, neg_in, K if with_neg else 0, 0.1, terms, 0.1, mask)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    sides = [q, d, neg] if with_neg else [q, d]
    got = torch.autograd.grad(loss, sides)
    ref = torch.autograd.grad(want, sides)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-6)
    # the data has terms on both sides of the threshold: the mask is not vacuous here
    assert (0 < m["masked_fraction"].item() < 1) == mask
    if not mask:
        assert m["masked_fraction"].item() == 0.0


def test_variants_and_margin_change_the_loss() -> None:
    q, d, neg = _feats()
    five, two = _loss("five")(q, d, neg)[0], _loss("two")(q, d, neg)[0]
    assert five.item() > two.item() + 1e-3  # more terms in every Z_i
    wide = _loss("five", margin=10.0)(q, d, neg)[0]
    assert wide.item() > five.item() + 1e-3  # nothing above pos + 10: fewer terms masked
    assert wide.item() == pytest.approx(_loss("five", mask=False)(q, d, neg)[0].item())
    chance = _loss("five", mask=False)(q, d, neg)[1]["chance_loss"]
    assert chance == pytest.approx(math.log(1 + K + 3 * (N - 1)))


def _planted(seed: int = 1) -> list[torch.Tensor]:
    """Row 3's positive is a copy of row 0's (another document showing the same page), and
    query 1's first hard negative is a copy of its own positive."""
    q, d, neg = (t.detach().clone() for t in _feats(seed))
    d[3] = d[0]
    neg[1 * K] = d[1]
    return [t.requires_grad_(True) for t in (q, d, neg)]


@pytest.mark.parametrize("terms", ["five", "two"])
def test_planted_copy_of_the_positive_is_masked(terms: str) -> None:
    q, d, neg = _planted()
    loss = _loss(terms, margin=10.0)(q, d, neg)[0]  # the margin rule masks nothing here
    # the loop with those copies left out by hand
    kept = brute_qwen3vl(q, d, neg, K, 0.1, terms, 10.0, mask=True)
    assert loss.item() == pytest.approx(kept.item(), rel=1e-5)
    # control: with the mask off the copies are negatives and the loss rises
    off = _loss(terms, mask=False)(q, d, neg)[0]
    assert off.item() > loss.item() + 1e-2
    assert off.item() == pytest.approx(brute_qwen3vl(q, d, neg, K, 0.1, terms, 0, False).item())


def test_margin_rule_alone_keeps_a_copy_of_the_positive() -> None:
    """Why the identity clause exists: a copy scores exactly s(q_i, d_i+), never above it by
    the margin, so without the clause the copy stays in Z_i as a negative."""
    q, d, neg = _planted()
    with_clause = _loss("two")(q, d, neg)[0]
    without = _loss("two", duplicate_cosine=2.0)(q, d, neg)[0]  # identity clause off
    assert without.item() > with_clause.item() + 1e-2
    assert without.item() == pytest.approx(
        brute_qwen3vl(q, d, neg, K, 0.1, "two", 0.1, dup=2.0).item(), rel=1e-5
    )


def test_a_term_above_the_positive_by_the_margin_is_masked() -> None:
    q, d, neg = (t.detach().clone() for t in _feats(2))
    neg[0] = F.normalize(q[0] + 0.05 * d[0], dim=0)  # scores ~1, far above s(q_0, d_0) + 0.1
    masked = _loss("two")(q, d, neg)[0]
    assert masked.item() == pytest.approx(brute_qwen3vl(q, d, neg, K, 0.1, "two", 0.1).item())
    kept = _loss("two", margin=1.5)(q, d, neg)[0]  # control: a wide margin keeps it
    assert kept.item() > masked.item() + 0.1


def test_each_query_owns_its_hard_negatives() -> None:
    q, d, neg = _feats(k=3)
    with pytest.raises(ValueError, match="objective.hard_negatives"):
        _loss("five", negatives_per_query=2)(q, d, neg)  # 18 rows are not 2 per query
    with pytest.raises(ValueError, match="own hard negatives"):
        _loss("five")(q, d, neg[:-1])  # 17 rows: not a multiple of the 6 queries
    a = _loss("five", negatives_per_query=3)(q, d, neg)[0]
    b = _loss("five")(q, d, neg)[0]  # None: rows / queries
    assert a.item() == b.item()
    # control: query 0's negatives are not query 1's (moving one changes the loss)
    swapped = neg.detach().clone()
    swapped[[0, 3]] = swapped[[3, 0]]
    assert _loss("five")(q, d, swapped)[0].item() != pytest.approx(a.item())


def test_logits_are_fp32_under_bf16_autocast() -> None:
    q, d, neg = _feats()
    want = _loss("five")(q, d, neg)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _loss("five")(q, d, neg)[0]
    assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=1e-6)


# ---- GradCache ----------------------------------------------------------------------------

B, T, VOCAB = 8, 12, 60


def _model(terms: str = "five") -> ContrastiveModel:
    torch.manual_seed(0)
    enc = DualEncoder(
        vision_config("tiny", image_size=32, layers=1, dropout=0.2),
        text_config("tiny", vocab_size=VOCAB, context_length=T, layers=1, dropout=0.2),
        embed_dim=32,
    )
    return ContrastiveModel(enc, _loss(terms, negatives_per_query=K)).train()


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = B + B * K
    lengths = torch.randint(3, T + 1, (rows,), generator=g)
    ids = torch.randint(3, VOCAB, (rows, T), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return {
        "images": torch.rand(B, 3, 32, 32, generator=g),
        "input_ids": ids[:B] * mask[:B],
        "attention_mask": mask[:B],
        "neg_ids": ids[B:] * mask[B:],
        "neg_mask": mask[B:],
    }


def _uncached(model: ContrastiveModel, batch: dict, chunk: int) -> dict[str, torch.Tensor]:
    """The uncached computation in GradCache's chunks and order (same dropout draws), one
    loss over the whole batch, one backward; returns the gradients."""
    enc = model.encoder
    img = torch.cat([enc.encode_image(c) for c in batch["images"].split(chunk)])

    def texts(ids: str, mask: str) -> torch.Tensor:
        chunks, order = length_sorted_chunks((batch[ids], batch[mask]), chunk)
        return torch.cat([enc.encode_text(*c) for c in chunks])[order.argsort()]

    txt, neg = texts("input_ids", "attention_mask"), texts("neg_ids", "neg_mask")
    model.loss(img, txt, neg)[0].backward()
    return _grads(model)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_grad_cache_equals_uncached_with_the_five_term_loss() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, batch, chunk = _model(), _batch(0), 3
        torch.manual_seed(1)
        ref = _uncached(model, batch, chunk)
        torch.manual_seed(1)
        loss, metrics = dual_encoder_grad_cache(model, batch, chunk, 1.0)
        got = _grads(model)
        assert got.keys() == ref.keys() and "loss.logit_scale" in got
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6)
        assert torch.isfinite(loss) and 0 < float(metrics["masked_fraction"]) < 1
        # control: the two-term loss's gradients are another computation
        model.loss.terms = "two"
        torch.manual_seed(1)
        dual_encoder_grad_cache(model, batch, chunk, 1.0)
        other = _grads(model)
        assert max((other[n] - ref[n]).abs().max().item() for n in ref) > 1e-4
    finally:
        torch.set_num_threads(before)


# ---- config and bad input -----------------------------------------------------------------


def test_from_config_and_registry() -> None:
    o = ObjectiveConfig(
        loss="qwen3vl", terms="two", false_negative_margin=0.2, hard_negatives=5, temperature=0.05
    )
    loss = build_loss_from_config(o)
    assert isinstance(loss, Qwen3VLLoss)
    assert (loss.terms, loss.margin, loss.mask, loss.negatives_per_query) == ("two", 0.2, True, 5)
    assert loss.duplicate_cosine == qwen3vl.DUPLICATE_COSINE == o.false_negative_duplicate_cosine
    assert loss.scale().item() == pytest.approx(20.0)
    assert loss.no_weight_decay() == ["logit_scale"]
    cfg = load_run_config(None, ["objective.loss=qwen3vl", "objective.terms=two"])
    assert cfg.objective.false_negative_margin == 0.1 and cfg.objective.false_negative_mask
    with pytest.raises(ValueError, match="terms"):
        Qwen3VLLoss(terms="three")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["objective.false_negative_margin=-0.1"], "'objective.false_negative_margin' must be >="),
        (["objective.loss=qwen3vl", "objective.terms=four"], "'objective.terms' must be one of"),
        (["objective.false_negative_duplicate_cosine=0"], "duplicate_cosine' must be > 0"),
        (["objective.terms=two"], "objective.terms='two' .objective.loss=qwen3vl's"),
        (["objective.loss=siglip", "objective.false_negative_margin=0.2"], "qwen3vl's"),
        (
            ["objective.loss=qwen3vl", "model.kind=hf_siglip", "model.path=m"],
            "objective.loss=qwen3vl .* does not train model.kind=hf_siglip",
        ),
        (["model.kind=vlm", "model.matryoshka_dims=[16,8]"], "'model.matryoshka_dims' must be"),
        (["model.kind=vlm", "model.matryoshka_dims=[8,8]"], "increasing order"),
        (["model.kind=vlm", "model.matryoshka_dims=[0,8]"], "prefix sizes >= 1"),
    ],
)
def test_bad_input_fails_at_load_naming_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        load_run_config(None, overrides)
    assert "\n" not in str(err.value)


def test_matryoshka_dims_beyond_the_embedding_width(tmp_path: Path) -> None:
    """The VLM's width comes from its config.json, before any weights load."""
    text = {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1}
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_vl", "text_config": text, "vision_config": {}})
    )
    base = ["model.kind=vlm", f"model.path={tmp_path}"]
    with pytest.raises(ConfigError, match="'model.matryoshka_dims' .* embedding width 32"):
        load_run_config(None, [*base, "model.matryoshka_dims=[8,64]"])
    load_run_config(None, [*base, "model.matryoshka_dims=[8,32]"])  # control: it fits


def test_records_with_too_few_negatives_are_refused() -> None:
    o = load_config(None, ["objective.loss=qwen3vl", "objective.hard_negatives=2"]).objective
    good = [{"id": "a", "negatives": ["x", "y"]}, {"id": "b", "negatives": ["x"],
            "caption_negatives": [["z"], ["w", "v"]]}]  # fmt: skip
    qwen3vl.check_negatives_per_query(o, good, "t.jsonl")
    with pytest.raises(ConfigError, match="1 of 3 records of t.jsonl .*first: id c"):
        qwen3vl.check_negatives_per_query(o, [*good, {"id": "c", "negatives": ["x"]}], "t.jsonl")
    infonce = load_config(None, ["objective.hard_negatives=2"]).objective  # control: fewer ok
    qwen3vl.check_negatives_per_query(infonce, [{"id": "c", "negatives": ["x"]}], "t.jsonl")
