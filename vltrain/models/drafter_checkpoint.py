"""A drafter from any checkpoint it comes in: a vltrain drafter run or checkpoint folder
(``drafter.json`` + ``model.safetensors``), a speculators (vLLM) or a z-lab DFlash (SGLang)
export (`vltrain.models.dflash_format`); and the drafter ``model.init_from`` continues."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vltrain.config.core import ConfigError
from vltrain.core.checkpoint import resolve_checkpoint
from vltrain.models import dflash_format
from vltrain.models.drafter import DRAFTER_FILE, Drafter, DrafterConfig, check_target_config


def load_drafter(path: str | Path) -> tuple[Drafter, dict]:
    """(drafter in eval mode, its target dict) of a drafter run or checkpoint folder.

    The weights are the ``drafter.*`` entries of the checkpoint's ``model.safetensors`` (the
    stage trains ``BlockDraftLoss``, which holds the drafter); the caller attaches the target's
    shared parts with ``drafter.share``.
    """
    if dflash_format.is_speculators(path):  # a speculators (vLLM) DFlash checkpoint
        return dflash_format.load_speculators(path)
    if dflash_format.is_dflash(path):  # a z-lab DFlash checkpoint (SGLang's)
        return dflash_format.load_dflash(path)
    config = Path(path) / "config.json"
    if config.is_file() and not (Path(path) / DRAFTER_FILE).is_file():
        try:  # an export's config.json: a broken one says so (not "no drafter.json")
            c = json.loads(config.read_text())
        except ValueError as e:
            raise ConfigError(f"{config} is not valid JSON ({e})") from None
        if isinstance(c, dict) and c.get("model_type"):  # --model and --draft swapped?
            raise ConfigError(
                f"{path} holds a transformers model ({c['model_type']!r}), not a drafter (a "
                "vltrain drafter run or checkpoint, a speculators or DFlash export)"
            )
    ckpt = resolve_checkpoint(path)
    meta_path = ckpt / DRAFTER_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(f"{ckpt} holds no {DRAFTER_FILE}: not a drafter checkpoint")
    meta = json.loads(meta_path.read_text())
    target = meta["target"]
    if target.get("path") and not target.get("id"):  # relative to the folder (older: absolute)
        target["path"] = str((ckpt / target["path"]).resolve())
    if meta.get("eval"):
        target["eval"] = meta["eval"]  # the measured tau `generate --spec auto` predicts from
    drafter = Drafter(DrafterConfig(**meta["drafter"]))
    state = dflash_format.read_weights(ckpt / "model.safetensors")
    own = {k.removeprefix("drafter."): v for k, v in state.items() if k.startswith("drafter.")}
    drafter.load_state_dict(own, strict=True)
    return drafter.eval(), meta["target"]


#: DrafterConfig field -> what sets it, compared with a ``model.init_from`` drafter
INIT_KEYS = {
    "width": "model.target",
    "vocab_size": "model.target",
    "target_layer_ids": "drafter.layer_ids",
    "layers": "drafter.layers",
    "heads": "drafter.heads",
    "mlp_ratio": "drafter.mlp_ratio",
    "block_size": "drafter.block_size",
    "rope_theta": "no key: vltrain's drafters train at 10000",
    "qk_norm": "drafter.arch",
    "learned_mask": "drafter.arch",
    "norm_eps": "drafter.arch",
}


def drafter_to_continue(path: str | Path, dcfg: DrafterConfig, target: Any = None) -> Drafter:
    """The drafter ``model.init_from`` names (a vltrain run or checkpoint, a speculators or
    z-lab DFlash checkpoint), refused unless `dcfg` (what this config builds) has its shape
    and, given the run's `target` (its ``config_sha256`` and ``model``), it was made for that
    target: the checks ``generate --draft`` makes (verifier architecture, vocabulary and
    layers; the target's config hash)."""
    try:
        drafter, meta = load_drafter(path)
    except FileNotFoundError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    where = f"model.init_from={path}"
    if target is not None:
        hf = getattr(target.model, "model", None)  # the HF model of an HF target
        if hasattr(hf, "config") and hasattr(hf, "get_output_embeddings"):
            dflash_format.check_verifier(meta, hf, where, "model.target")
        check_target_config(meta, target.config_sha256, where)
    mine, theirs = dcfg.to_dict(), drafter.cfg.to_dict()
    diff = [
        f"{key} {theirs[key]} (this config: {mine[key]}; set {INIT_KEYS[key]})"
        for key in INIT_KEYS
        if mine[key] != theirs[key]
    ]
    if diff:
        raise ConfigError(
            f"model.init_from={path} is a drafter of another shape: {'; '.join(diff)}"
        )
    return drafter
