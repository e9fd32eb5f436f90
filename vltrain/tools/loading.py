"""Rebuild a trained model from a checkpoint for inference tools (mine, eval, generate)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from vltrain.config import Config
from vltrain.config.schema import load_config
from vltrain.core.checkpoint import (
    CheckpointError,
    CheckpointMismatch,
    load_weights,
    resolve_loadable,
)
from vltrain.data.tokenizer import require_tokenizer
from vltrain.engine.runtime import RunContext
from vltrain.engine.task import Stage
from vltrain.stages import get_stage


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

    A checkpoint is self-contained: the stage reads the files saved with it (`tokenizer/`)
    from the checkpoint folder itself, so a copied checkpoint works without the rest of the run
    dir, and nothing here trains a tokenizer, writes into the checkpoint, or follows the run's
    `model.init_from` / `model.vision_init_from` (the weights are all in the checkpoint). An rl
    checkpoint loads as the captioner it is.
    """
    ckpt, skipped = resolve_loadable(checkpoint)
    if skipped:
        print(f"vltrain: {skipped}", file=sys.stderr)
    config_path = run_config_for(ckpt)
    cfg = load_config(config_path, overrides)
    cfg.model.init_from = cfg.model.vision_init_from = ""
    if cfg.model.kind in ("dual_encoder", "captioner") and cfg.stage != "drafter":
        # a drafter's model.kind names its target, whose own folder carries the tokenizer
        require_tokenizer(ckpt / "tokenizer")
    ctx = RunContext(
        device=torch.device(device),
        rank=0,
        world_size=1,
        precision=cfg.run.precision,
        seed=cfg.run.seed,
    )
    stage = get_stage("caption" if cfg.stage == "rl" else cfg.stage)(cfg, ckpt, ctx)
    stage.prepare()
    model = stage.build_model()
    try:
        load_weights(model, ckpt)
    except CheckpointMismatch as e:
        raise CheckpointError(
            f"{e}. The model is built from {config_path}, whose model.* keys (kind, vision, "
            "text, embed_dim, head, connector) and data.tokenizer_vocab decide these shapes: "
            "the weights or config.yaml were replaced; put back the run's own pair"
        ) from None
    return cfg, stage, model.to(ctx.device).eval()
