"""The drafter objective: weights, D-PACE, chunked loss == unchunked, exact vs marginal tau."""

from __future__ import annotations

import math

import torch

from tests.models.test_drafter_guards import K, V, _drafter, _inputs
from vltrain.objectives.drafter import (
    BlockDraftLoss,
    block_metrics,
    dpace_weights,
    position_weights,
    summarize_metrics,
)


def test_position_weights_formula() -> None:
    for block, gamma in ((8, 4.0), (16, 7.0), (16, 10.0)):
        w = position_weights(block, gamma)
        want = [0.0] + [math.exp(-max(k - 1, 0) / gamma) for k in range(1, block)]
        assert torch.allclose(w, torch.tensor(want), atol=1e-7)


def test_dpace_weights_brute_force() -> None:
    g = torch.Generator().manual_seed(0)
    ce = torch.rand(3, 5, generator=g) * 3
    valid = torch.rand(3, 5, generator=g) > 0.2
    valid[:, 0] = False
    got = dpace_weights(ce, valid, 0.5)
    for r in range(3):
        q = [0.5 * math.exp(-float(ce[r, k])) + 0.5 if valid[r, k] else 1.0 for k in range(5)]
        q[0] = 1.0
        prefix = [math.prod(q[: k + 1]) * bool(valid[r, k]) for k in range(5)]
        want = [sum(prefix[k:]) * bool(valid[r, k]) for k in range(5)]
        assert torch.allclose(got[r], torch.tensor(want), atol=1e-6)


def _labels(j: int, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(0, V, (1, j, K), generator=g)
    ok = torch.ones(1, j, K, dtype=torch.bool)
    ok[..., 0] = False
    return lab, ok


def test_chunked_loss_equals_one_chunk() -> None:
    feats, pos, valid = _inputs(16)
    a_pos = torch.tensor([[2, 3, 5, 8, 9, 12]])
    a_ids = torch.randint(0, V, a_pos.shape, generator=torch.Generator().manual_seed(2))
    lab, ok = _labels(6)
    results = []
    for chunk in (1, 4, 64):
        d = _drafter()
        loss_mod = BlockDraftLoss(d, gamma=4.0, chunk_blocks=chunk)
        loss, weight, _ = loss_mod(feats, pos, valid, a_ids, a_pos, lab, ok)
        (loss / weight).backward()
        results.append((float((loss / weight).detach()), d.fc.weight.grad.clone()))
    for loss, grad in results[1:]:
        assert abs(loss - results[0][0]) < 1e-5
        torch.testing.assert_close(grad, results[0][1], atol=1e-5, rtol=1e-4)


def test_exact_tau_differs_from_the_marginal_estimate() -> None:
    # two blocks of 3 drafted slots: one all right, one all wrong -> per-slot accuracy 1/2
    labels = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    valid[..., 0] = False
    logits = torch.full((1, 2, 4, 10), -5.0)
    for k in range(4):
        logits[0, 0, k, k] = 5.0  # block 0 right everywhere
        logits[0, 1, k, (k + 1) % 10] = 5.0  # block 1 wrong everywhere ...
        logits[0, 1, k, k] = 4.0  # ... with the right token second
    m = summarize_metrics(block_metrics(logits, labels, valid))
    assert m["tau"] == (4 + 1) / 2  # exact: (1 + 3) and (1 + 0)
    assert abs(m["tau_marginal"] - (1 + 0.5 + 0.25 + 0.125)) < 1e-9  # independence guess
    assert m["top4"] == 1.0 and m["streak4"] == 4.0  # the right token is 2nd: a tree finds it
