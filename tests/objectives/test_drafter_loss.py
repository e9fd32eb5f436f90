"""The drafter objective: weights, D-PACE, chunked loss == unchunked, exact vs marginal tau,
a reduced draft vocabulary."""

from __future__ import annotations

import math

import torch

from tests.models.test_drafter_guards import K, V, _drafter, _inputs
from vltrain.models.drafter import Drafter, DrafterConfig, SharedParts, draft_vocab_ids
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


def _labels(j: int, seed: int = 0):
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


def _vocab_drafter(ids: list[int]):
    """The guard tests' drafter with a draft vocabulary of ``ids`` (weights as the full one's)."""
    full = _drafter()
    cfg = DrafterConfig(**{**full.cfg.to_dict(), "draft_vocab": len(ids)})
    d = Drafter(cfg).share(SharedParts(full.shared.embed, full.shared.head, _params(full)))
    d.load_state_dict({**full.state_dict(), "vocab_ids": torch.tensor(ids)})
    return full, d.eval()


def _params(full):
    head = full.shared.head
    return lambda: (head.weight, head.bias)


def test_draft_vocabulary_scores_the_head_rows_and_counts_outside_labels_as_misses() -> None:
    """A reduced draft vocabulary: logits = the full head's rows of its ids; the loss is the
    CE of that restricted softmax over labels inside it (outside: no loss); outside labels
    never match, so a block whose slot 1 is outside accepts nothing, and coverage counts them."""
    feats, pos, valid = _inputs(16)
    a_pos = torch.tensor([[2, 5, 9]])
    a_ids = torch.tensor([[3, 4, 5]])
    ids = list(range(0, V, 2))  # the even tokens
    full, d = _vocab_drafter(ids)
    h = d(feats, pos, valid, a_ids, a_pos)
    torch.testing.assert_close(d.logits(h), full.logits(h)[..., ids], atol=1e-6, rtol=0)
    assert d.to_token(torch.tensor([0, 3])).tolist() == [0, 6]
    assert d.to_draft(torch.tensor([6, 7])).tolist() == [3, -1]
    # labels: the drafter's own argmax (inside) except block 1 slot 1 (odd: outside)
    logits = d.logits(h)
    lab = d.to_token(logits.argmax(-1))
    lab[0, 1, 1] = 7
    ok = torch.ones_like(lab, dtype=torch.bool)
    ok[..., 0] = False
    loss_mod = BlockDraftLoss(d, gamma=4.0, chunk_blocks=64)
    loss, weight, sums = loss_mod(feats, pos, valid, a_ids, a_pos, lab, ok)
    inside = ok.clone()
    inside[0, 1, 1] = False
    logp = torch.log_softmax(logits.detach().float(), -1)
    ce = -logp.gather(-1, d.to_draft(lab).clamp(min=0)[..., None])[..., 0]
    w = position_weights(K, 4.0)[None, None] * inside
    assert abs(float((loss / weight).detach()) - float((ce * w).sum() / w.sum())) < 1e-5
    m = summarize_metrics(sums)
    assert m["tau"] == (K + 1 + K) / 3  # blocks 0 and 2 accept all, block 1 nothing
    assert m["vocab_coverage"] == (3 * (K - 1) - 1) / (3 * (K - 1))


def test_draft_vocabulary_ids_and_the_checkpoint() -> None:
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7])
    assert draft_vocab_ids(counts, 3).tolist() == [2, 3, 6]  # ties to the lower id
    assert draft_vocab_ids(counts, 3, always=(5,)).tolist() == [2, 3, 5]
    _, d = _vocab_drafter([1, 4, 9, 20])
    state = d.state_dict()
    assert state["vocab_ids"].tolist() == [1, 4, 9, 20] and "vocab_index" not in state
    again = Drafter(d.cfg)
    again.load_state_dict(state)
    assert again.to_draft(torch.tensor([9, 10])).tolist() == [2, -1]  # index follows the load
    full = again.full_vocab(torch.log_softmax(torch.randn(2, 4), -1))
    assert full.shape == (2, V) and torch.isinf(full[:, 0]).all()
    assert torch.allclose(full[:, [1, 4, 9, 20]].exp().sum(-1), torch.ones(2))


def test_draft_vocabulary_soft_labels_and_dpace_treat_outside_tokens_as_unproposable() -> None:
    """Soft labels are restricted to the draft vocabulary and renormalised; with D-PACE a
    valid slot whose label lies outside is a certain miss (q = 0) for the slots after it."""
    feats, pos, valid = _inputs(16)
    a_pos, a_ids = torch.tensor([[2, 5]]), torch.tensor([[3, 4]])
    ids = list(range(0, V, 2))
    _, d = _vocab_drafter(ids)
    g = torch.Generator().manual_seed(5)
    soft = torch.softmax(torch.randn(1, 2, K, V, generator=g), -1)
    lab = torch.tensor([[[0, 2, 4, 6], [0, 8, 10, 12]]])
    ok = torch.ones_like(lab, dtype=torch.bool)
    ok[..., 0] = False
    loss, weight, _ = BlockDraftLoss(d, gamma=4.0)(feats, pos, valid, a_ids, a_pos, lab, ok, soft)
    logp = torch.log_softmax(d.logits(d(feats, pos, valid, a_ids, a_pos)).detach(), -1)
    sub = soft[..., ids] / soft[..., ids].sum(-1, keepdim=True)
    ce = -(sub * logp).sum(-1)
    w = position_weights(K, 4.0)[None, None] * ok
    want = float((ce * w).sum() / w.sum())
    assert abs(float((loss / weight).detach()) - want) < 1e-5
    # D-PACE: slot 1 of block 0 is outside (odd label): slots 2 and 3 weigh as after a miss
    lab[0, 0, 1] = 7
    _, weight_d, _ = BlockDraftLoss(d, gamma=4.0, dpace=0.5)(
        feats, pos, valid, a_ids, a_pos, lab, ok
    )
    inside = ok & (lab % 2 == 0)
    ce_in = -logp.gather(-1, d.to_draft(lab).clamp(min=0)[..., None])[..., 0] * inside
    miss = ce_in.masked_fill(ok & ~inside, float("inf"))
    want_w = float((dpace_weights(miss, ok, 0.5) * inside).sum())
    as_if_hit = float((dpace_weights(ce_in, inside, 0.5) * inside).sum())  # the old bug
    assert abs(float(weight_d) - want_w) < 1e-5 and abs(as_if_hit - want_w) > 0.1


def test_sparse_top_k_soft_labels_equal_their_dense_form_in_a_draft_vocabulary() -> None:
    """Soft labels given as the target's top-k (ids, probs) train exactly like the same labels
    as a vocabulary-wide tensor, with a reduced draft vocabulary (outside ids dropped, the rest
    renormalised); a slot whose top-k all lie outside carries no loss and no weight."""
    feats, pos, valid = _inputs(16)
    a_pos, a_ids = torch.tensor([[2, 5]]), torch.tensor([[3, 4]])
    _, d = _vocab_drafter(list(range(0, V, 2)))
    g = torch.Generator().manual_seed(7)
    # per slot one id inside the (even) draft vocabulary and two outside, all distinct
    even = 2 * torch.randint(V // 2, (2 * K, 1), generator=g)
    odd = torch.stack([2 * torch.randperm(V // 2, generator=g)[:2] + 1 for _ in range(2 * K)])
    ids = torch.cat([even, odd], 1).view(1, 2, K, 3)
    ids[0, 1, 2] = torch.tensor([1, 3, 5])  # every one outside the (even) draft vocabulary
    probs = torch.softmax(torch.randn(1, 2, K, 3, generator=g), -1)
    dense = probs.new_zeros(1, 2, K, V).scatter_(-1, ids, probs)
    lab = torch.tensor([[[0, 2, 4, 6], [0, 8, 10, 12]]])
    ok = torch.ones_like(lab, dtype=torch.bool)
    ok[..., 0] = False
    loss_fn = BlockDraftLoss(d, gamma=4.0)
    s_loss, s_w, _ = loss_fn(feats, pos, valid, a_ids, a_pos, lab, ok, (ids, probs))
    d_loss, d_w, _ = loss_fn(feats, pos, valid, a_ids, a_pos, lab, ok, dense)
    w = position_weights(K, 4.0)
    assert abs(float(d_w) - float(w[1:].sum() * 2)) < 1e-6  # dense: the empty slot still weighs
    assert abs(float(s_w) - float(d_w - w[2])) < 1e-6  # sparse: it does not
    assert abs(float(s_loss.detach()) - float(d_loss.detach())) < 1e-5  # its CE: 0 either way
    chunked = BlockDraftLoss(d, gamma=4.0, chunk_blocks=1)
    c_loss, c_w, _ = chunked(feats, pos, valid, a_ids, a_pos, lab, ok, (ids, probs))
    assert (
        abs(float(c_loss.detach()) - float(s_loss.detach())) < 1e-5
        and abs(float(c_w) - float(s_w)) < 1e-6
    )
