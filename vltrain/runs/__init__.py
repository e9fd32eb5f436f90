"""Orchestration: one training run, pipelines of runs, the quickstart, hyperparameter search.

``train(cfg)`` is the Python entry point of `vltrain train`: it picks the built-in stage that
``cfg.stage`` names and drives it with the engine's Trainer. A stage of your own trains with
``Trainer(cfg, stage=MyStage).run()`` (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vltrain.config.schema import Config
from vltrain.engine.loop import Trainer
from vltrain.engine.stops import TrainingAborted
from vltrain.scaling.budget import resolve_budget
from vltrain.stages import get_stage


def train(cfg: Config, on_eval: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Train `cfg` end to end (one process, or one rank of torchrun); the run's summary.

    A budget (`train.max_samples` / `train.max_flops`) becomes `train.max_steps` in the
    Trainer's setup, once, before the run, so the schedule ends at the budget."""
    return Trainer(cfg, get_stage(cfg.stage), on_eval=on_eval, budget=resolve_budget).run()


__all__ = ["Trainer", "TrainingAborted", "train"]
