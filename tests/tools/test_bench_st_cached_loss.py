"""bench/bench_st_cached_loss.py's float64 mode and its comparison helper (the sentence-
transformers side runs in the bench venv; these parts need no sentence-transformers)."""

from __future__ import annotations

import pytest
import torch

from tests.bench_scripts import load_bench

pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_keep_float64_keeps_float64_and_still_upcasts_half_precision() -> None:
    mod = load_bench("bench_st_cached_loss")
    wide, half = torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)
    with mod.keep_float64(True):
        assert wide.float().dtype == torch.float64
        assert half.float().dtype == torch.float32
    assert wide.float().dtype == torch.float32  # restored on exit
    with mod.keep_float64(False):
        assert wide.float().dtype == torch.float32


def test_compare_reports_the_largest_gradient_difference_and_refuses_other_parameters() -> None:
    mod = load_bench("bench_st_cached_loss")
    a = {"loss": 1.0, "grads": {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}}
    b = {"loss": 1.25, "grads": {"w": torch.tensor([1.0, 2.5]), "b": torch.tensor([0.5])}}
    assert mod._compare(a, b) == (0.25, 0.5, 2.0)
    with pytest.raises(AssertionError, match="different trainable parameters"):
        mod._compare(a, {"loss": 1.0, "grads": {"w": torch.zeros(2)}})
