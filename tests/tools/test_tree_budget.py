"""bench/bench_tree_budget.py: a tree's expected acceptance from its path scores, and the
per-round budget rules it compares."""

from __future__ import annotations

import math

import pytest
import torch

from tests.bench_scripts import load_bench
from vltrain.inference import speculative

pytest.importorskip("transformers")


def _module():
    return load_bench("bench_tree_budget")


def test_path_scores_sum_log_q_along_each_path() -> None:
    m = _module()
    logq = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]))
    tokens, parents = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([-1, 0, 1, -1, 3])
    want = [0.5, 0.5 * 0.6, 0.5 * 0.6 * 0.9, 0.3, 0.3 * 0.3]
    got = m.path_scores(logq, tokens, parents)
    assert [math.exp(s) for s in got] == pytest.approx(want)


def test_expected_acceptance_is_the_sum_of_path_probabilities_when_q_is_calibrated() -> None:
    """A target whose choice at each depth is drawn from q itself: the mean accepted length of
    the DDTree equals 1 + sum exp(path score), the number the dynamic rule predicts from."""
    m = _module()
    g = torch.Generator().manual_seed(0)
    logq = torch.log_softmax(2 * torch.randn(5, 12, generator=g), -1)
    tokens, parents = speculative.ddtree(logq, 16)
    predicted = 1 + sum(math.exp(s) for s in m.path_scores(logq, tokens, parents))
    depth = {-1: -1}
    for i, p in enumerate(parents.tolist()):
        depth[i] = depth[p] + 1
    n, total = 4000, 0
    for _ in range(n):
        draws = torch.multinomial(logq.exp(), 1, generator=g)[:, 0].tolist() + [-1]  # per depth
        path, _ = speculative.accept_walk(tokens, parents, lambda node, d=draws: d[depth[node] + 1])
        total += 1 + len(path)
    assert total / n == pytest.approx(predicted, abs=0.05)
    # a drafter that is not calibrated (q sharpened) predicts more than it gets
    sharp = torch.log_softmax(3 * logq, -1)
    over = 1 + sum(math.exp(s) for s in m.path_scores(sharp, tokens, parents))
    assert over > predicted + 0.3


def test_dynamic_rule_with_exact_predictions_is_the_oracle_and_beats_every_fixed_budget() -> None:
    m = _module()
    sizes = [7, 16, 32]
    cost = {7: 50.0, 16: 60.0, 32: 80.0}
    # confident rounds gain nothing from a bigger tree, uncertain ones gain a lot
    easy = {"act": {7: 5, 16: 5, 32: 5}}
    hard = {"act": {7: 1, 16: 3, 32: 5}}
    rounds = [{**r, "pred": r["act"]} for r in [easy, hard] * 10]
    fixed = max(m.rate(rounds, lambda r, n=n: n, cost, 5.0)[0] for n in sizes)
    dyn = m.best_lambda(rounds, "pred", cost, 5.0, sizes)
    ora = m.best_lambda(rounds, "act", cost, 5.0, sizes)
    assert dyn[0] == pytest.approx(ora[0]) and dyn[0] > fixed * 1.1
    assert 7 < dyn[2] < 32  # it mixes sizes


def test_best_first_trees_are_read_off_a_chain_first_tree_by_path_score() -> None:
    """bench_tree_budget.py's best-first column: the N best-scored nodes of a 64-node
    chain-first DDTree are the nodes of the N-node best-first DDTree, for N up to 64 - depth."""
    m = _module()
    g = torch.Generator().manual_seed(2)

    def paths(tokens: torch.Tensor, parents: torch.Tensor, keep) -> set:
        out: dict[int, tuple] = {}
        for k, (t, p) in enumerate(zip(tokens.tolist(), parents.tolist(), strict=True)):
            out[k] = (*(out[p] if p >= 0 else ()), t)
        return {out[k] for k in range(len(out)) if keep(k)}

    differs = 0
    for _ in range(20):
        logq = torch.log_softmax(3 * torch.randn(7, 40, generator=g), -1)
        big_t, big_p = speculative.ddtree(logq, 64)
        rank = m.best_first_ranks(m.path_scores(logq, big_t, big_p), big_p.tolist())
        assert sorted(rank) == list(range(64))
        for n in (7, 11, 16, 32, 57):
            t, p = speculative.ddtree(logq, n, chain_first=False)
            want = paths(t, p, lambda k: True)
            assert paths(big_t, big_p, lambda k, n=n, rank=rank: rank[k] < n) == want, n
            differs += want != paths(*speculative.ddtree(logq, n), lambda k: True)
    assert differs  # the two shapes are different trees at some sizes
