"""The dense reading loss: cross-entropy per grid cell, background down-weighted, no-word
images ignored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vltrain.objectives.reading import BACKGROUND_WEIGHT, ReadingLoss


def test_reading_loss_is_the_weighted_cross_entropy() -> None:
    torch.manual_seed(0)
    loss_fn = ReadingLoss(width=8, vocab_size=5, weight=2.0)
    grid = torch.randn(2, 4, 8)
    targets = torch.tensor([[0, 5, 5, 3], [-100, -100, -100, -100]])
    loss, m = loss_fn(grid, targets)
    logits = loss_fn.head(grid).flatten(0, 1)
    w = torch.tensor([1.0] * 5 + [BACKGROUND_WEIGHT])
    want = F.cross_entropy(logits, targets.flatten(), weight=w, ignore_index=-100)
    torch.testing.assert_close(loss, 2.0 * want)
    assert float(m["reading_loss"]) == pytest.approx(float(want.detach()), rel=1e-6)
    hits = (logits.argmax(-1)[[0, 3]] == torch.tensor([0, 3])).float().mean()
    assert float(m["reading_acc"]) == pytest.approx(float(hits))  # word cells only


def test_reading_loss_learns_and_ignores_images_without_words() -> None:
    torch.manual_seed(0)
    loss_fn = ReadingLoss(width=16, vocab_size=10, weight=1.0)
    grid = torch.randn(4, 9, 16)
    targets = torch.randint(0, 11, (4, 9))
    opt = torch.optim.SGD(loss_fn.parameters(), lr=1.0)
    first = float(loss_fn(grid, targets)[0])
    for _ in range(50):
        opt.zero_grad()
        loss, m = loss_fn(grid, targets)
        loss.backward()
        opt.step()
    assert float(loss) < 0.3 * first and float(m["reading_acc"]) > 0.9
    none = torch.full((4, 9), -100)
    loss, m = loss_fn(grid, none)
    assert float(loss) == 0.0 and loss.requires_grad and float(m["reading_acc"]) == 0.0
    with pytest.raises(ValueError, match="grid"):
        loss_fn(grid, targets[:, :4])
