"""The losses' `chance_loss` is their value on uninformative logits, brute-forced here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from vltrain.objectives.chance import infonce_chance, siglip_chance
from vltrain.objectives.contrastive import InfoNCELoss, SigLIPLoss

N, M, E = 6, 4, 8


def _same_rows(n: int) -> torch.Tensor:
    """n copies of one unit vector: every logit of a row is the same (no information)."""
    return F.normalize(torch.ones(n, E), dim=-1)


@pytest.mark.parametrize("m", [0, M])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_infonce_chance_is_its_loss_on_uninformative_logits(m, symmetric, smoothing) -> None:
    loss_fn = InfoNCELoss(temperature=0.05, symmetric=symmetric, label_smoothing=smoothing)
    neg = _same_rows(m) if m else None
    loss, metrics = loss_fn(_same_rows(N), _same_rows(N), neg)
    want = 0.5 * (math.log(N + m) + math.log(N)) if symmetric else math.log(N + m)
    assert metrics["chance_loss"] == pytest.approx(want, rel=1e-12)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    # negative control: informative embeddings (pairs match) are well below chance
    x = F.normalize(torch.randn(N, E, generator=torch.Generator().manual_seed(0)), dim=-1)
    learned, m2 = loss_fn(x, x, neg)
    assert float(learned.detach()) < want - 0.3 and m2["chance_loss"] == metrics["chance_loss"]


@pytest.mark.parametrize("m", [0, M])
def test_siglip_chance_is_its_best_constant_logit_loss(m) -> None:
    k = N + m
    neg = _same_rows(m) if m else None

    fn = SigLIPLoss(init_scale=1.0)

    @torch.no_grad()
    def loss_at(c: float) -> float:  # every logit = scale * 1 + bias = c
        fn.logit_bias.fill_(c - 1.0)
        return float(fn(_same_rows(N), _same_rows(N), neg)[0])

    grid = [loss_at(c / 20) for c in range(-160, 80)]  # brute force over constants
    _, metrics = SigLIPLoss()(_same_rows(N), _same_rows(N), neg)
    assert metrics["chance_loss"] == pytest.approx(siglip_chance(N, m), rel=1e-12)
    assert min(grid) == pytest.approx(siglip_chance(N, m), abs=1e-3)
    assert min(grid) >= siglip_chance(N, m) - 1e-6  # no constant does better
    assert loss_at(-math.log(k - 1)) == pytest.approx(siglip_chance(N, m), rel=1e-6)
    # negative control: SigLIP's initial bias (-10) is far above that floor
    assert loss_at(-10.0 + 10.0 * 1.0) > siglip_chance(N, m) + 1.0


def test_chance_grows_with_the_candidates() -> None:
    """What the gather (2 ranks: 2N rows) and hard negatives do to chance."""
    assert infonce_chance(2 * N, 0) == pytest.approx(math.log(2 * N))
    assert infonce_chance(N, M) > infonce_chance(N, 0)
    assert siglip_chance(2 * N, 0) > siglip_chance(N, 0)
