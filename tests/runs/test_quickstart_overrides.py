"""The quickstart's per-stage overrides: sizes, text depth, loader processes."""

from __future__ import annotations

import pytest

from vltrain.config import load_config
from vltrain.runs import quickstart


def _clip_config(size: str):
    over = quickstart.stage_overrides(size, 30, 16, 0, 0, [], [])["clip"]
    return load_config(quickstart.PRESET, over)


def test_the_tiny_recipe_keeps_one_text_block_and_the_other_sizes_their_presets() -> None:
    from vltrain.models.presets import text_config

    tiny = _clip_config("tiny")
    assert (tiny.model.vision, tiny.model.text, tiny.model.text_layers) == ("tiny_cnn", "tiny", 1)
    for size in ("tiny_vit", "small"):
        cfg = _clip_config(size)
        assert cfg.model.text_layers == 0  # 0: the preset's depth
        assert text_config(cfg.model.text, vocab_size=100).layers > 1


@pytest.mark.parametrize("cores, workers", [(1, 0), (2, 0), (4, 1), (64, 1)])
def test_default_workers_follow_the_cores(monkeypatch, cores: int, workers: int) -> None:
    monkeypatch.setattr(
        quickstart.os, "sched_getaffinity", lambda _pid: set(range(cores)), raising=False
    )
    monkeypatch.setattr(quickstart.os, "cpu_count", lambda: cores)
    assert quickstart.default_workers() == workers
