"""Length penalty, rep-4 rate and caption length (words) on captions worked out by hand."""

from __future__ import annotations

import pytest
import torch

from vltrain.objectives.caption_shaping import caption_stats, length_penalty, repeated_ngram_rate


def test_repeated_ngram_rate_by_hand() -> None:
    # a b c d a b c d: 5 four-grams, (a b c d) twice -> 4 distinct -> 1 - 4/5
    assert repeated_ngram_rate("a b c d a b c d".split()) == pytest.approx(0.2)
    # all distinct, too short, empty: 0
    assert repeated_ngram_rate("a red square on a blue circle".split()) == 0.0
    assert repeated_ngram_rate("a b c".split()) == 0.0
    assert repeated_ngram_rate([]) == 0.0
    # bigrams of "x x x x": 3 bigrams, 1 distinct
    assert repeated_ngram_rate(["x"] * 4, n=2) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="n-gram order"):
        repeated_ngram_rate(["a"], n=0)


def test_caption_stats_use_the_reward_s_ptb_words() -> None:
    caps = [
        "A dog. A dog, a dog a dog!",  # ptb: a dog a dog a dog a dog (8): 2 of 5 distinct
        "A red square.",  # 3 words, no 4-gram
        "a b c d e",  # 5 words, 2 distinct four-grams
    ]
    stats = caption_stats(caps)
    assert set(stats) == {"rep4_rate", "caption_words"}
    assert float(stats["rep4_rate"]) == pytest.approx((0.6 + 0.0 + 0.0) / 3)
    assert float(stats["caption_words"]) == pytest.approx((8 + 3 + 5) / 3)
    # negative control: without punctuation removal the first caption would count 10 tokens
    assert float(caption_stats(caps[:1])["caption_words"]) == 8.0


def test_length_penalty_linear_and_target() -> None:
    n = torch.tensor([0, 3, 7, 12])
    torch.testing.assert_close(length_penalty(n, 0.1), torch.tensor([0.0, 0.3, 0.7, 1.2]))
    torch.testing.assert_close(length_penalty(n, 0.5, target=7), torch.tensor([3.5, 2.0, 0.0, 2.5]))
    assert torch.equal(length_penalty(n, 0.0), torch.zeros(4))
    with pytest.raises(ValueError, match="coeff >= 0"):
        length_penalty(n, -1.0)
