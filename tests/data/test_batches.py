"""Row chunks of a collated batch (`split_rows`; `length_sorted_chunks` is tested with
GradCache in tests/objectives/test_grad_cache.py)."""

from __future__ import annotations

import pytest
import torch

from vltrain.data.batches import split_rows


def test_split_rows() -> None:
    x = torch.arange(10).view(5, 2)
    assert [c.shape[0] for c in split_rows(x, 2)] == [2, 2, 1]
    pairs = split_rows((x, x + 1), 3)
    assert len(pairs) == 2 and torch.equal(pairs[1][1], x[3:] + 1)
    dicts = split_rows({"a": x, "b": x[:, 0]}, 4)
    assert torch.equal(dicts[1]["b"], x[4:, 0])
    with pytest.raises(ValueError, match=">= 1"):
        split_rows(x, 0)
    with pytest.raises(ValueError, match="different leading sizes \\[5, 12\\]"):
        split_rows({"pixel_values": torch.zeros(12, 3), "grid": x}, 2)  # flattened patches
    with pytest.raises(TypeError, match="cannot split a str"):
        split_rows("text", 2)
