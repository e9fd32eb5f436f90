"""The built-in stages, as a plain table: ``stage:`` key -> stage class.

A new stage is one new module plus one line in :data:`STAGES`. Each stage implements
:class:`vltrain.engine.task.Stage`; its ``check_config`` names the model kinds, losses and
options it honours, so a config it cannot train fails at load.
"""

from __future__ import annotations

from pathlib import Path

from vltrain.config.core import ConfigError, check_choice
from vltrain.config.schema import Config, load_config
from vltrain.engine.task import Stage, check_stage
from vltrain.stages.caption import CaptionStage
from vltrain.stages.contrastive import ContrastiveStage
from vltrain.stages.drafter import DrafterStage
from vltrain.stages.rl import RLStage

STAGES: dict[str, type[Stage]] = {
    "contrastive": ContrastiveStage,
    "caption": CaptionStage,
    "rl": RLStage,
    "drafter": DrafterStage,
}


def get_stage(name: str) -> type[Stage]:
    """The stage class for a registry key; a ConfigError (with did-you-mean) otherwise."""
    check_choice("stage", name, STAGES)
    return STAGES[name]


def check_config(cfg: Config) -> type[Stage]:
    """Every registry-backed and stage-specific check of `cfg`; returns its stage class."""
    stage = get_stage(cfg.stage)
    check_stage(cfg, stage)
    return stage


def load_run_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """`vltrain.config.load_config` plus the stage checks: what `vltrain train` accepts."""
    cfg = load_config(path, overrides)
    check_config(cfg)
    return cfg


__all__ = ["STAGES", "ConfigError", "check_config", "get_stage", "load_run_config"]
