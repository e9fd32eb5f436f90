"""The dense reading loss: cross-entropy per grid cell, background down-weighted, no-word
images ignored; with next-token targets, the next token on each word cell's line as well."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vltrain.models.word_pairs import Reading
from vltrain.objectives.reading import BACKGROUND_WEIGHT, ReadingLoss


def test_reading_loss_is_the_weighted_cross_entropy() -> None:
    torch.manual_seed(0)
    loss_fn = ReadingLoss(vocab_size=5, weight=2.0)
    logits = torch.randn(2, 4, 6)
    targets = torch.tensor([[0, 5, 5, 3], [-100, -100, -100, -100]])
    loss, m = loss_fn(Reading(logits), targets)
    flat = logits.flatten(0, 1)
    w = torch.tensor([1.0] * 5 + [BACKGROUND_WEIGHT])
    want = F.cross_entropy(flat, targets.flatten(), weight=w, ignore_index=-100)
    torch.testing.assert_close(loss, 2.0 * want)
    assert float(m["reading_loss"]) == pytest.approx(float(want.detach()), rel=1e-6)
    hits = (flat.argmax(-1)[[0, 3]] == torch.tensor([0, 3])).float().mean()
    assert float(m["reading_acc"]) == pytest.approx(float(hits))  # word cells only
    assert "reading_next_acc" not in m


def test_next_token_targets_add_the_following_cross_entropy_on_word_cells_only() -> None:
    torch.manual_seed(0)
    loss_fn = ReadingLoss(vocab_size=5, weight=1.0)
    logits, context = torch.randn(2, 4, 6), torch.randn(2, 4, 3)
    read_next = nn.Linear(3, 6)
    targets = torch.tensor(
        [[[0, 5, 5, 3], [3, -100, -100, 5]], [[-100] * 4, [-100] * 4]]
    )  # (B, 2, P): image 0's word cells 0 and 3 are followed by token 3 and the end of line
    loss, m = loss_fn(Reading(logits, context, read_next), targets)
    plain, _ = loss_fn(Reading(logits), targets[:, 0])
    nxt = read_next(context[0, [0, 3]])
    want = plain + F.cross_entropy(nxt, torch.tensor([3, 5]))
    torch.testing.assert_close(loss, want)
    hits = (nxt.argmax(-1) == torch.tensor([3, 5])).float().mean()
    assert float(m["reading_next_acc"]) == pytest.approx(float(hits))
    with pytest.raises(ValueError, match="no next tokens"):  # a tower that reads no next tokens
        loss_fn(Reading(logits), targets)


def test_reading_loss_learns_and_ignores_images_without_words() -> None:
    torch.manual_seed(0)
    loss_fn = ReadingLoss(vocab_size=10, weight=1.0)
    head = nn.Linear(16, 11)
    grid = torch.randn(4, 9, 16)
    targets = torch.randint(0, 11, (4, 9))
    opt = torch.optim.SGD(head.parameters(), lr=1.0)
    first = float(loss_fn(Reading(head(grid)), targets)[0].detach())
    for _ in range(50):
        opt.zero_grad()
        loss, m = loss_fn(Reading(head(grid)), targets)
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.3 * first and float(m["reading_acc"]) > 0.9
    none = torch.full((4, 9), -100)
    loss, m = loss_fn(Reading(head(grid)), none)
    assert float(loss.detach()) == 0.0 and loss.requires_grad and float(m["reading_acc"]) == 0.0
    with pytest.raises(ValueError, match="targets"):
        loss_fn(Reading(head(grid)), targets[:, :4])
