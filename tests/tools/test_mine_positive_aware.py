"""Positive-aware mining (`vltrain mine --margin`): copies of a query's positive planted in the
corpus under other ids are never mined as its negatives; controls with the rule off."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vltrain.tools.mine import MineOptions, false_negative, mine_pair_negatives

Q, E, DISTRACTORS = 200, 32, 1000


def _planted(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, their positives, and a corpus: rows 0..Q-1 the positives (under their own ids),
    Q..2Q-1 a copy of each positive under another id (the same page encoded again: rounding
    noise), then random distractors. Positives range from near the query to unrelated."""
    g = torch.Generator().manual_seed(seed)

    def unit(*shape: int) -> torch.Tensor:
        return F.normalize(torch.randn(*shape, generator=g), dim=-1)

    q = unit(Q, E)
    pull = torch.empty(Q, 1).uniform_(-0.5, 3.0, generator=g)  # how close each positive is
    p = F.normalize(pull * q + unit(Q, E), dim=-1)
    copies = F.normalize(p + 1e-4 * torch.randn(Q, E, generator=g), dim=-1)
    return q, p, torch.cat([p, copies, unit(DISTRACTORS, E)])


def _copies_mined(mined: list[list[int]]) -> int:
    """Queries whose own positive's copy (corpus row Q + i) was mined as a negative."""
    return sum(Q + i in rows for i, rows in enumerate(mined))


def test_planted_copies_of_the_positive_are_not_mined() -> None:
    q, p, corpus = _planted()
    excluded = [{i} for i in range(Q)]  # the positive itself, by its id
    mined = mine_pair_negatives(q, p, corpus, excluded, MineOptions(k=5, margin=0.95))
    assert _copies_mined(mined) <= Q // 100  # >= 99% of the 200 planted copies never mined
    assert sum(len(m) for m in mined) > 3 * Q  # and the others are still mined
    # control: without the rule (margin 10 keeps anything up to 10x the positive) the copies,
    # ranked at the positive's own score, are mined for most queries
    loose = mine_pair_negatives(q, p, corpus, excluded, MineOptions(k=5, margin=10.0))
    assert _copies_mined(loose) > Q // 2


def test_a_positive_scoring_below_zero_still_guards_its_copy() -> None:
    """An untrained model can score a positive <= 0; `margin x pos` would then lie above the
    positive and let its copy through, so the rule measures the gap by |pos|."""
    assert false_negative(-0.2, -0.2, 0.95) and false_negative(0.5, 0.5, 0.95)
    assert not false_negative(-0.3, -0.2, 0.95) and not false_negative(0.4, 0.5, 0.95)
    assert -0.2 < 0.95 * -0.2  # the plain product rule would keep the copy (score -0.2)
    q = F.normalize(torch.tensor([[1.0, 0.0, 0.0]]), dim=-1)
    pos = F.normalize(torch.tensor([[-0.2, 0.98, 0.0]]), dim=-1)  # s(q, pos) ~ -0.2
    others = F.normalize(torch.tensor([[-0.6, 0.0, 0.8], [-0.7, 0.7, 0.1]]), dim=-1)
    corpus = torch.cat([pos, pos.clone(), others])  # row 1: the copy, ranked first
    mined = mine_pair_negatives(q, pos, corpus, [{0}], MineOptions(k=2, margin=0.95))
    assert mined == [[2, 3]]
    loose = mine_pair_negatives(q, pos, corpus, [{0}], MineOptions(k=2, margin=10.0))
    assert loose[0][0] == 1  # control: the copy ranks first and is taken without the rule
