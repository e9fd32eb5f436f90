"""A user's own stage trains through `Trainer(cfg, stage=...)`: the snippet in docs/internals.md
is executed as written, and a stage that cannot report `train.best_metric` fails before compute.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vltrain.config.core import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "internals.md"


def _snippet() -> dict:
    text = DOC.read_text()
    section = text.split("### Training your own stage from Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code, "docs/internals.md lost its custom-stage snippet"
    scope: dict = {}
    exec(compile(code.group(1), str(DOC), "exec"), scope)
    return scope


def test_documented_custom_stage_trains_evaluates_and_checkpoints(
    shapes_dir: Path, tmp_path: Path
) -> None:
    scope = _snippet()
    summary = scope["train_tiny_clip"](shapes_dir, tmp_path / "run")
    assert summary["steps"] == 4 and summary["best_metric"] == "eval_loss"
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(x == x for x in losses)  # logged, finite
    assert (tmp_path / "run" / "checkpoints" / "step_4" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "checkpoints" / "best" / "best.json").is_file()


def test_a_stage_without_the_best_metric_fails_before_anything_is_written(
    shapes_dir: Path, tmp_path: Path
) -> None:
    scope = _snippet()
    from vltrain.config import load_config
    from vltrain.engine.loop import Trainer

    class NoLoss(scope["TinyClipStage"]):
        @classmethod
        def eval_metrics(cls, cfg):
            return ("eval_acc",)

    run = tmp_path / "run"
    cfg = load_config(
        None,
        [f"run.out_dir={run}", f"data.train={shapes_dir}/train.jsonl"]
        + [f"data.eval={shapes_dir}/val.jsonl", "train.best_metric=eval_loss"],
    )
    with pytest.raises(ConfigError, match="does not report.*eval_acc"):
        Trainer(cfg, stage=NoLoss)
    assert not run.exists()  # nothing written: the check ran before setup
    Trainer(cfg, stage=scope["TinyClipStage"])  # control: the documented stage passes the check
    assert run.is_dir()


@pytest.mark.parametrize("stage", ["contrastive", "half", 3])
def test_what_is_not_a_stage_class_is_a_config_error(stage, tmp_path: Path) -> None:
    """A built-in stage's name, a class without the protocol's methods, or any other value:
    one ConfigError saying what Trainer takes (it was an AttributeError), nothing written."""
    from vltrain import Trainer, load_config

    class Half:  # a stage begun: check_config only
        @classmethod
        def check_config(cls, cfg) -> None:
            pass

    cfg = load_config(None, [f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"takes a Stage class.*vltrain\.train\(cfg\)"):
        Trainer(cfg, stage=Half if stage == "half" else stage)
    assert not (tmp_path / "run").exists()
