"""Orchestration: one training run, pipelines of runs, the quickstart, hyperparameter search.

``train(cfg)`` is the Python entry point of `vltrain train`: it picks the built-in stage that
``cfg.stage`` names and drives it with the engine's Trainer. A stage of your own trains with
``Trainer(cfg, stage=MyStage).run()`` (docs/internals.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vltrain.config.schema import Config
from vltrain.engine.loop import Trainer, TrainingAborted
from vltrain.stages import check_config


def train(cfg: Config, on_eval: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Train `cfg` end to end (one process, or one rank of torchrun); the run's summary.

    A budget (`train.max_samples` / `train.max_flops`) is resolved into `train.max_steps` here,
    once, before the run, so the schedule ends at the budget."""
    import os

    from vltrain.scaling.budget import resolve_budget

    cfg = resolve_budget(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # torchrun sets it
    return Trainer(cfg, stage=check_config(cfg), on_eval=on_eval).run()


__all__ = ["Trainer", "TrainingAborted", "train"]
