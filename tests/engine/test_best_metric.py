"""`train.best_metric` must name a metric the stage will log, exactly (not a pattern match)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tiny_overrides
from vltrain.config import load_config
from vltrain.config.core import ConfigError
from vltrain.engine.task import best_metric_of
from vltrain.stages import get_stage


def _cfg(shapes_dir: Path, tmp_path: Path, metric: str, groups: list[str] | None = None):
    val = tmp_path / "val.jsonl"
    rows = [json.loads(x) for x in (shapes_dir / "val.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        row["image"] = str(shapes_dir / row["image"])
        if groups:
            row["group"] = groups[i % len(groups)]
    val.write_text("".join(json.dumps(r) + "\n" for r in rows))
    over = tiny_overrides(shapes_dir, tmp_path / "run", **{"data.eval": val})
    return load_config(None, [*over, f"train.best_metric={metric}"])


@pytest.mark.parametrize("metric", ["eval_R@1_men", "eval_R@3", "eval_R@x", "eval_chance_R@2"])
def test_a_pattern_match_is_not_enough(shapes_dir: Path, tmp_path: Path, metric: str) -> None:
    cfg = _cfg(shapes_dir, tmp_path, metric, groups=["women", "body phrase"])
    with pytest.raises(ConfigError, match="train.best_metric"):
        best_metric_of(cfg, get_stage(cfg.stage))


@pytest.mark.parametrize(
    "metric", ["eval_R@1_mean", "eval_R@5", "eval_R@1_women", "eval_R@5_body_phrase"]
)
def test_metrics_the_stage_logs_are_accepted(shapes_dir: Path, tmp_path: Path, metric) -> None:
    """Negative control: plain names, computed ranks and the groups the eval records name."""
    cfg = _cfg(shapes_dir, tmp_path, metric, groups=["women", "body phrase"])
    assert best_metric_of(cfg, get_stage(cfg.stage))[0] == metric
