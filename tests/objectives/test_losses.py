"""InfoNCE and SigLIP against brute-force definitions (float64 loops), registry and config."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vltrain.config.core import ConfigError
from vltrain.config.schema import ObjectiveConfig, load_config
from vltrain.objectives.contrastive import (
    LOSSES,
    Features,
    InfoNCELoss,
    SigLIPLoss,
    build_loss,
    build_loss_from_config,
    caption_contrast_loss,
    gather_features,
)
from vltrain.stages import load_run_config

N, M, E = 6, 4, 8


def _feats(n: int = N, m: int = M, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = [F.normalize(torch.randn(k, E, generator=g), dim=-1) for k in (n, n, m)]
    return tuple(t.requires_grad_(True) for t in x)


def _neg_log_softmax(row: list[torch.Tensor], k: int) -> torch.Tensor:
    """-log softmax(row)[k], written out."""
    return -(row[k] - torch.log(sum(torch.exp(v) for v in row)))


def _ce(row: list[torch.Tensor], target: int, eps: float) -> torch.Tensor:
    """Cross-entropy with label smoothing: (1 - eps) * one-hot + eps / K uniform."""
    k = len(row)
    nll = [_neg_log_softmax(row, j) for j in range(k)]
    return (1 - eps) * nll[target] + eps / k * sum(nll)


def brute_infonce(img, txt, neg, scale, symmetric: bool, eps: float) -> torch.Tensor:
    """Image i against texts 0..N-1 then negatives; text j against images (float64 loops)."""
    img, txt, scale = img.double(), txt.double(), scale.double()
    cands = list(txt) + ([] if neg is None else list(neg.double()))
    n = len(img)
    i2t = sum(_ce([scale * (img[i] @ c) for c in cands], i, eps) for i in range(n)) / n
    if not symmetric:
        return i2t
    t2i = sum(_ce([scale * (txt[j] @ img[i]) for i in range(n)], j, eps) for j in range(n)) / n
    return 0.5 * (i2t + t2i)


def brute_siglip(img, txt, neg, t, b) -> torch.Tensor:
    """-sum_ij log sigmoid(z_ij (t x_i.y_j + b)) / N; hard negatives: extra z = -1 pairs."""
    img, txt, t, b = img.double(), txt.double(), t.double(), b.double()
    cands = list(txt) + ([] if neg is None else list(neg.double()))
    total = 0.0
    for i in range(len(img)):
        for j, c in enumerate(cands):
            z = 1.0 if i == j else -1.0
            total = total - torch.log(1.0 / (1.0 + torch.exp(-z * (t * (img[i] @ c) + b))))
    return total / len(img)


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("with_neg", [False, True])
@pytest.mark.parametrize("learn", [True, False])
def test_infonce_matches_brute_force(
    symmetric: bool, eps: float, with_neg: bool, learn: bool
) -> None:
    img, txt, neg = _feats()
    neg = neg if with_neg else None
    loss_fn = InfoNCELoss(
        temperature=0.1,
        learn_temperature=learn,
        symmetric=symmetric,
        label_smoothing=eps,
        gather=False,
    )
    assert (len(list(loss_fn.parameters())) == 1) == learn
    loss, metrics = loss_fn(img, txt, neg)
    ref = brute_infonce(img, txt, neg, loss_fn.scale(), symmetric, eps)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert metrics["logit_scale"].item() == pytest.approx(10.0, rel=1e-6)
    inputs = [img, txt] + ([neg] if with_neg else [])
    inputs += [loss_fn.logit_scale] if learn else []
    for got, want in zip(_grads(loss, inputs), _grads(ref, inputs), strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)


def test_infonce_negatives_and_options_change_the_loss() -> None:
    """Negative controls: the brute force tells the variants apart, so the parity is not vacuous."""
    img, txt, neg = _feats()
    base = InfoNCELoss(temperature=0.1, gather=False)
    with_neg = base(img, txt, neg)[0].item()
    assert with_neg > base(img, txt, None)[0].item() + 1e-3  # extra columns only add mass
    one_dir = InfoNCELoss(temperature=0.1, symmetric=False, gather=False)(img, txt, neg)[0]
    assert abs(one_dir.item() - with_neg) > 1e-3
    ref_wrong_scale = brute_infonce(img, txt, neg, torch.tensor(5.0), True, 0.0)
    assert abs(ref_wrong_scale.item() - with_neg) > 1e-3


def brute_caption(txt, pairs, neg, scale) -> torch.Tensor:
    """Caption-caption InfoNCE written out: caption i picks pair i among pairs + negatives, pair
    i picks caption i among captions + negatives; float64."""
    t, p = txt.double(), pairs.double()
    ng = [] if neg is None else list(neg.double())
    s = float(scale)
    fwd = [_neg_log_softmax([s * (t[i] @ c) for c in list(p) + ng], i) for i in range(len(t))]
    bwd = [_neg_log_softmax([s * (p[i] @ c) for c in list(t) + ng], i) for i in range(len(t))]
    return 0.5 * (sum(fwd) / len(t) + sum(bwd) / len(t))


@pytest.mark.parametrize("with_neg", [True, False])
def test_caption_contrast_matches_brute_force_and_adds_to_the_loss(with_neg: bool) -> None:
    img, txt, neg = _feats()
    pairs = _feats(seed=1)[1]
    neg = neg if with_neg else None
    plain = InfoNCELoss(temperature=0.1, gather=False)
    weighted = InfoNCELoss(temperature=0.1, gather=False, caption_contrast=0.5)
    base, base_m = plain(img, txt, neg)
    # off: second captions are ignored, the loss and its chance are the plain ones
    off, off_m = plain(img, txt, neg, pairs=pairs)
    assert off.item() == base.item() and "caption_loss" not in off_m
    assert off_m["chance_loss"] == base_m["chance_loss"]
    loss, m = weighted(img, txt, neg, pairs=pairs)
    ref = brute_caption(txt, pairs, neg, 10.0)
    assert m["caption_loss"].item() == pytest.approx(ref.item(), rel=1e-5)
    assert loss.item() == pytest.approx(base.item() + 0.5 * ref.item(), rel=1e-5)
    k = N + (M if with_neg else 0)
    assert m["chance_loss"] == pytest.approx(base_m["chance_loss"] + 0.5 * math.log(k))
    inputs = [txt, pairs] + ([neg] if with_neg else [])
    want_loss = brute_infonce(img, txt, neg, torch.tensor(10.0), True, 0.0) + 0.5 * ref
    for got, want in zip(_grads(loss, inputs), _grads(want_loss, inputs), strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)
    # chance is what uninformative embeddings cost: all captions alike -> ln(N + M)
    same = F.normalize(torch.ones(N, E), dim=-1)
    negs = None if neg is None else F.normalize(torch.ones(M, E), dim=-1)
    f = Features(img.detach(), same, negs, same.clone())
    assert caption_contrast_loss(f, torch.tensor(10.0)).item() == pytest.approx(math.log(k))
    # negative control: a hard negative equal to the pair costs more than an unrelated one
    if with_neg:
        close = torch.cat([pairs[:1].detach(), neg[1:].detach()])
        worse = caption_contrast_loss(Features(img, txt, close, pairs), torch.tensor(10.0))
        assert worse.item() > ref.item() + 1e-3
    with pytest.raises(ValueError, match="caption_contrast"):
        InfoNCELoss(caption_contrast=-1.0)


def test_infonce_scale_is_clamped() -> None:
    img, txt, _ = _feats()
    loss_fn = InfoNCELoss(temperature=1e-3, max_logit_scale=100.0, gather=False)
    loss, metrics = loss_fn(img, txt)
    assert metrics["logit_scale"].item() == pytest.approx(100.0, rel=1e-6)
    ref = brute_infonce(img, txt, None, torch.tensor(100.0), True, 0.0)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    loss.backward()
    assert loss_fn.logit_scale.grad.item() == 0.0  # clamped: no gradient


@pytest.mark.parametrize("with_neg", [False, True])
def test_siglip_matches_brute_force(with_neg: bool) -> None:
    img, txt, neg = _feats()
    neg = neg if with_neg else None
    loss_fn = SigLIPLoss(init_scale=3.0, init_bias=-2.0, gather=False)
    loss, metrics = loss_fn(img, txt, neg)
    ref = brute_siglip(img, txt, neg, loss_fn.scale(), loss_fn.logit_bias)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert metrics["logit_bias"].item() == pytest.approx(-2.0)
    inputs = [img, txt] + ([neg] if with_neg else []) + [loss_fn.logit_scale, loss_fn.logit_bias]
    for got, want in zip(_grads(loss, inputs), _grads(ref, inputs), strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)


def test_siglip_negative_controls() -> None:
    """Hard negatives add pairs; a different bias or positive labels change the value."""
    img, txt, neg = _feats()
    loss_fn = SigLIPLoss(init_scale=3.0, init_bias=-2.0, gather=False)
    with_neg = loss_fn(img, txt, neg)[0].item()
    assert with_neg > loss_fn(img, txt, None)[0].item() + 1e-3
    t = loss_fn.scale()
    assert abs(brute_siglip(img, txt, neg, t, torch.tensor(-1.0)).item() - with_neg) > 1e-3
    # all pairs negative (no diagonal) is a different loss
    all_neg = -F.logsigmoid(-(t * img @ torch.cat([txt, neg]).t() - 2.0)).sum() / N
    assert abs(all_neg.item() - with_neg) > 1e-3


def test_siglip_init_and_no_decay_from_config() -> None:
    loss_fn = build_loss_from_config(ObjectiveConfig(loss="siglip"))
    assert isinstance(loss_fn, SigLIPLoss)
    assert loss_fn.scale().item() == pytest.approx(10.0, rel=1e-6)
    assert loss_fn.logit_bias.item() == -10.0
    assert set(loss_fn.no_weight_decay()) == {"logit_scale", "logit_bias"}
    fixed = build_loss_from_config(ObjectiveConfig(loss="siglip", learn_temperature=False))
    assert [n for n, _ in fixed.named_parameters()] == ["logit_bias"]


def test_registry_and_config() -> None:
    assert set(LOSSES) >= {"infonce", "siglip"}
    assert isinstance(build_loss_from_config(ObjectiveConfig()), InfoNCELoss)
    assert isinstance(build_loss("siglip", init_scale=10.0), SigLIPLoss)
    with pytest.raises(KeyError, match="known: \\['infonce', 'qwen3vl', 'siglip'\\]"):
        build_loss("clip")
    cfg = load_config(
        None,
        ["objective.loss=siglip", "objective.hard_negatives=3", "objective.grad_cache_chunk=8"],
    )
    assert (cfg.objective.hard_negatives, cfg.objective.grad_cache_chunk) == (3, 8)
    with pytest.raises(ConfigError, match="objective.loss.*did you mean 'siglip'"):
        load_run_config(None, ["objective.loss=sigmoid"])  # the stage knows its losses
    with pytest.raises(ConfigError, match="grad_cache_chunk"):
        load_config(None, ["objective.grad_cache_chunk=-1"])


@pytest.mark.parametrize("name", ["infonce", "siglip"])
def test_logits_are_fp32_under_bf16_autocast(name: str) -> None:
    """The loss disables autocast: same value as fp32 (a bf16 matmul is off by ~1e-2)."""
    img, txt, neg = _feats(n=32, m=8)
    loss_fn = build_loss(name, gather=False)
    want = loss_fn(img, txt, neg)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_fn(img, txt, neg)[0]
        bf16 = loss_fn.scale() * (img @ torch.cat([txt, neg]).t())  # what autocast would do
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    fp32 = loss_fn.scale() * (img @ torch.cat([txt, neg]).t())
    assert (bf16.float() - fp32).abs().max().item() > 1e-3  # control: autocast would matter


def test_gather_features_single_process_is_identity() -> None:
    img, txt, neg = _feats()
    f = gather_features(img, txt, None, gather=True)
    assert isinstance(f, Features) and f.image is img and f.text is txt and f.negatives is None
    assert gather_features(img, txt, neg, gather=True).negatives is neg


def test_acc_metrics() -> None:
    img, _, neg = _feats()
    txt = img.detach().clone()  # perfect match: accuracy 1 unless negatives win
    for loss_fn in (InfoNCELoss(gather=False), SigLIPLoss(gather=False)):
        m = loss_fn(img, txt)[1]
        assert m["acc_i2t"].item() == 1.0 and m["acc_t2i"].item() == 1.0
    assert math.isfinite(InfoNCELoss(gather=False)(img, txt, neg)[0].item())


@pytest.mark.parametrize("name", ["infonce", "siglip", "qwen3vl"])
def test_matryoshka_dims_train_each_prefix(name: str) -> None:
    """model.matryoshka_dims: the loss is the mean of the loss at full width and at each
    re-normalised prefix (brute force below); the prefix's coordinates get the extra
    gradient. Before, the dims were only evaluated (the export's card said "trained")."""
    img, txt, neg = _feats(n=4, m=4)
    loss_fn = build_loss(name, gather=False)
    plain, _ = loss_fn(img, txt, neg)
    loss_fn.matryoshka_dims = (2, 4)
    loss, metrics = loss_fn(img, txt, neg)
    cut = [
        loss_fn.loss_from_features(
            Features(*(F.normalize(t[:, :d], dim=-1) for t in (img, txt, neg)))
        )[0]
        for d in (2, 4)
    ]
    want = (plain + cut[0] + cut[1]) / 3
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert metrics["loss_d2"].item() == pytest.approx(cut[0].item(), rel=1e-6)
    assert metrics["loss_full"].item() == pytest.approx(plain.item(), rel=1e-6)
    g_full, g_mrl = _grads(plain, [img])[0], _grads(loss, [img])[0]
    assert not torch.allclose(g_full[:, :2], g_mrl[:, :2])  # the prefixes train
    torch.testing.assert_close(g_mrl[:, 4:], g_full[:, 4:] / 3)  # the rest: the full term only
