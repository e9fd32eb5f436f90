"""`vltrain export DRAFTER --format speculators|dflash`: a drafter the serving engines load.

``speculators`` writes what vLLM serves (``vllm serve ./export``); ``dflash`` writes z-lab's
format (SGLang ``--speculative-algorithm DFLASH``, z-lab's transformers model). The mapping and
what each format cannot express live in ``vltrain.models.dflash_format``; here: the target, the
refusals (before anything is written) and the files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vltrain.config.core import ConfigError
from vltrain.models import dflash_format
from vltrain.models.drafter import (
    Drafter,
    SharedParts,
    check_target_config,
    config_sha256,
    target_name,
)
from vltrain.models.drafter_checkpoint import load_drafter

FORMATS = ("speculators", "dflash")
MODELING_FILE = "modeling_dflash.py"
"""A dflash export's modelling file (`vltrain.models.dflash_modeling`), named in auto_map."""
TARGET_TYPES = {"llama": "Llama", "qwen3": "Qwen3"}
"""HF model types whose drafters the formats cover (SmolLM2 is a Llama)."""
EXPORT_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "drafter.json",
    "config.yaml",
    "hf_model",
    "tokenizer",
    "modeling_dflash.py",
    "vltrain_export.json",
)
"""What any `vltrain export` writes (``--force`` removes these from a folder it replaces)."""
MARKER = "vltrain_export.json"
"""Written by the sentence-transformers and hf exports (which are otherwise plain model folders)."""


def held_export(out: Path) -> list[str]:
    """The export files ``out`` already holds."""
    return [n for n in EXPORT_FILES if (out / n).exists()] if out.is_dir() else []


def is_export(out: Path) -> bool:
    """Whether ``out`` holds something `vltrain export` wrote: its marker, a vltrain-format
    export (``config.yaml`` without a run's ``checkpoints/``) or a drafter in the speculators
    or DFlash format."""
    if (out / MARKER).is_file():
        return True
    if (out / "config.yaml").is_file() and not (out / "checkpoints").exists():
        return True
    return dflash_format.is_speculators(out) or dflash_format.is_dflash(out)


def check_out(out: Path, force: bool) -> None:
    """Refuse a folder that already holds an export unless ``force``, and one that holds
    anything else (a model, a run: maybe the very target) even with it; nothing is written."""
    held = held_export(out)
    if held and not is_export(out):
        raise ConfigError(
            f"{out} holds {', '.join(held)} but no vltrain export (a model? a run?): an export "
            "never replaces it, even with --force; choose another --out"
        )
    if held and not force:
        raise ConfigError(
            f"{out} already holds an export ({', '.join(held)}): pass --force to replace it, "
            "or choose another --out"
        )


def clear_out(out: Path) -> None:
    """Remove the export files ``out`` holds (``--force``: no stale file of the old one)."""
    for name in held_export(out):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def load_target(path: str, target_id: str, out: Path) -> tuple[dflash_format.TargetInfo, Any]:
    """(what the export says about the target, the HF model) of a drafter's target."""
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if p.suffix == ".gguf" and not target_id:
        raise ConfigError(
            f"the target {p} is a GGUF file, which the engines do not load as a verifier: name "
            "the HF model it was made from with --target-id (e.g. HuggingFaceTB/SmolLM2-135M)"
        )
    if not p.exists():
        raise ConfigError(f"the drafter's target {p} does not exist: pass --target PATH")
    where, kw = (p.parent, {"gguf_file": p.name}) if p.suffix == ".gguf" else (p, {})
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # stderr keeps only vltrain's one line
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=torch.float32, local_files_only=True, **kw
        ).eval()  # the weights only: an export needs no tokenizer
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    c = model.config.get_text_config(decoder=True)
    if c.model_type not in TARGET_TYPES:
        raise ConfigError(
            f"the target {p} is a '{c.model_type}' model: the DFlash formats cover "
            f"{', '.join(TARGET_TYPES)} targets here"
        )
    name = target_id or os.path.relpath(p.resolve(), out.resolve())
    info = dflash_format.TargetInfo(
        name_or_path=name,
        architectures=list(getattr(model.config, "architectures", None) or [])
        or [f"{TARGET_TYPES[c.model_type]}ForCausalLM"],
        model_type=c.model_type,
        num_layers=c.num_hidden_layers,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        width=c.hidden_size,
        max_positions=c.max_position_embeddings,
        tie_word_embeddings=bool(getattr(model.config, "tie_word_embeddings", False)),
        config_sha256=config_sha256(model.config),
    )
    return info, model


def check_convertible(drafter: Drafter, target: dflash_format.TargetInfo, fmt: str) -> None:
    """One line naming every way ``drafter`` differs from what ``fmt`` describes."""
    c = drafter.cfg
    if c.draft_vocab > target.vocab_size:
        raise ConfigError(
            f"the drafter's draft vocabulary ({c.draft_vocab}) is larger than the target's "
            f"vocabulary ({target.vocab_size})"
        )
    if (c.width, c.vocab_size) != (target.width, target.vocab_size):
        raise ConfigError(
            f"the drafter (width {c.width}, vocabulary {c.vocab_size}) was not trained for the "
            f"target (width {target.width}, vocabulary {target.vocab_size})"
        )
    diff = dflash_format.differences(c, target.num_layers)
    if fmt == "dflash" and c.draft_vocab:
        diff.append(
            f"a reduced draft vocabulary ({c.draft_vocab} tokens; the dflash format has no "
            "d2t map: use --format speculators)"
        )
    if diff:
        raise ConfigError(f"this drafter cannot be written as {fmt}: {'; '.join(diff)}")


def write_export(
    drafter: Drafter,
    target: dflash_format.TargetInfo,
    out: Path,
    fmt: str,
    measured: dict | None = None,
    **config_args: Any,
) -> Path:
    """config.json + model.safetensors of ``drafter`` in ``fmt`` (checks already passed);
    ``measured``, the run's measured decoding (tau_decode, ...), travels in config.json's
    ``vltrain`` block (what ``generate --spec auto`` predicts from).

    ``config_args`` go to ``speculators_config`` (the bench's negative controls)."""
    if fmt == "speculators":
        config = dflash_format.speculators_config(drafter.cfg, target, **config_args)
        state = dflash_format.speculators_state(drafter)
    else:
        config = dflash_format.dflash_config(drafter.cfg, target)
        config["auto_map"] = {"AutoModel": f"{MODELING_FILE[:-3]}.DFlashDraftModel"}
        state = dflash_format.body_state(drafter)
    if measured:
        config.setdefault("vltrain", {})["eval"] = measured
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "dflash":  # plain transformers: AutoModel.from_pretrained(out, trust_remote_code)
        source = Path(dflash_format.__file__).with_name("dflash_modeling.py")  # not imported
        shutil.copyfile(source, out / MODELING_FILE)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_drafter(
    checkpoint: str | Path,
    out: str | Path,
    fmt: str,
    target: str = "",
    target_id: str = "",
    force: bool = False,
) -> Path:
    """Export a drafter run or checkpoint; ``target`` overrides the path it names (a moved
    model), ``target_id`` names the target by its HF id in the export."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format '{fmt}': choose from {', '.join(FORMATS)}")
    out = Path(out)
    drafter, meta = load_drafter(checkpoint)
    if meta.get("kind", "hf_lm") != "hf_lm":
        raise ConfigError(
            f"this drafter's target is a vltrain {meta['kind']}: the DFlash formats describe "
            "drafters of HF causal LMs (Llama, Qwen3)"
        )
    check_out(out, force)
    info, model = load_target(target or target_name(meta), target_id, out)
    check_target_config(meta, info.config_sha256, str(checkpoint))
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    drafter.share(
        SharedParts(
            embed=emb, head=head, head_params=lambda: (head.weight, getattr(head, "bias", None))
        )
    )
    check_convertible(drafter, info, fmt)
    clear_out(out)
    with torch.no_grad():
        return write_export(drafter, info, out, fmt, meta.get("eval"))
