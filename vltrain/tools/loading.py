"""Rebuild a trained model from a checkpoint for inference tools (mine, eval, generate)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from vltrain.config import Config
from vltrain.engine.checkpoint import load_weights, resolve_checkpoint
from vltrain.engine.runtime import RunContext
from vltrain.engine.task import Stage
from vltrain.stages import get_stage, load_run_config


def run_config_for(ckpt: Path) -> Path:
    """The config.yaml of the run that owns a checkpoint folder."""
    for parent in (ckpt, *ckpt.parents[:3]):
        if (parent / "config.yaml").is_file():
            return parent / "config.yaml"
    raise FileNotFoundError(
        f"no config.yaml found above {ckpt}: pass a checkpoint that lives in a vltrain run dir"
    )


def load_trained(
    checkpoint: str | Path, overrides: list[str] | None = None, device: str = "cpu"
) -> tuple[Config, Stage, nn.Module]:
    """(config, stage, model in eval mode) of a run dir or checkpoint folder, single process.

    The stage reads files it saved with the checkpoint (e.g. `tokenizer/`) from the checkpoint
    folder itself, so a copied checkpoint works without the rest of the run dir.
    """
    ckpt = resolve_checkpoint(checkpoint)
    cfg = load_run_config(run_config_for(ckpt), overrides)
    ctx = RunContext(
        device=torch.device(device),
        rank=0,
        world_size=1,
        precision=cfg.run.precision,
        seed=cfg.run.seed,
    )
    stage = get_stage(cfg.stage)(cfg, ckpt, ctx)
    stage.prepare()
    model = stage.build_model()
    load_weights(model, ckpt)
    return cfg, stage, model.to(ctx.device).eval()
