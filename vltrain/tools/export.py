"""`vltrain export`: one checkpoint (sharded or not) as consolidated, portable files."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from safetensors.torch import save_model

from vltrain.config.core import ConfigError
from vltrain.core.checkpoint import resolve_checkpoint
from vltrain.core.files import OutputError, check_not_input, is_disk_full, write_failure
from vltrain.models.drafter import DRAFTER_FILE
from vltrain.tools import export_drafter, export_st
from vltrain.tools.loading import load_trained, run_config_for


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, force: bool = False, target_id: str = ""
) -> Path:
    """Write `out/model.safetensors` (the keys a single-process run saves), the stage's own
    export (`hf_model/` via save_pretrained for HF backbones), the tokenizer and config.yaml.

    Runs in one process: a sharded (fsdp) checkpoint is resharded into the plain model.
    """
    ckpt = resolve_checkpoint(checkpoint)
    out = Path(out)
    export_drafter.check_out(out, force)
    _, stage, model = load_trained(ckpt)
    export_drafter.clear_out(out)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / "model.safetensors"))  # the same writer as every checkpoint
    stage.export(model, out)
    meta = out / DRAFTER_FILE
    if meta.is_file():  # a drafter: its measured tau travels; --target-id names the target
        tree = json.loads(meta.read_text())
        if (ckpt / DRAFTER_FILE).is_file():
            measured = json.loads((ckpt / DRAFTER_FILE).read_text()).get("eval")
            tree.update({"eval": measured} if measured else {})
        if target_id:
            tree["target"] = {**tree["target"], "id": target_id}
            tree["target"].pop("path", None)
        meta.write_text(json.dumps(tree, indent=2))
    if (ckpt / "tokenizer").is_dir():
        shutil.copytree(ckpt / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    shutil.copy2(run_config_for(ckpt), out / "config.yaml")
    return out


def export_hf(checkpoint: str | Path, out: str | Path, force: bool = False) -> Path:
    """A caption run of model.kind hf_vlm / llava as a folder plain transformers loads
    (``AutoModelForImageTextToText`` + ``AutoProcessor``), LoRA merged."""
    ckpt = resolve_checkpoint(checkpoint)
    out = Path(out)
    export_drafter.check_out(out, force)
    _, stage, model = load_trained(ckpt)
    if not hasattr(stage, "export_hf"):
        raise ConfigError("--format hf exports caption runs of model.kind hf_vlm or llava")
    export_drafter.clear_out(out)
    folder = stage.export_hf(model, out)
    (folder / export_drafter.MARKER).write_text(json.dumps({"format": "hf"}) + "\n")
    return folder


def export_command(
    checkpoint: str,
    out: str,
    fmt: str = "vltrain",
    force: bool = False,
    target: str = "",
    target_id: str = "",
) -> int:
    check_not_input(out, [checkpoint], "--out")
    try:
        return _export(checkpoint, out, fmt, force, target, target_id)
    except Exception as e:
        if not is_disk_full(e):
            raise
        # the partial export goes (the user's other files stay), so the space is back and
        # nothing half-written looks like a model
        with contextlib.suppress(OSError):
            export_drafter.clear_out(Path(out))
            Path(out).rmdir()  # only when nothing else is in it
        raise OutputError(f"{write_failure(out, e)}; nothing was exported") from None


def _export(checkpoint: str, out: str, fmt: str, force: bool, target: str, target_id: str) -> int:
    if fmt == "vltrain":
        path = export_checkpoint(checkpoint, out, force, target_id)
    elif fmt == "hf":
        path = export_hf(checkpoint, out, force)
        print(f"vltrain: exported {checkpoint} as {fmt} to {path} (transformers from_pretrained)")
        return 0
    elif fmt == export_st.FORMAT:
        path = export_st.export_sentence_transformers(checkpoint, out, force)
        print(f"vltrain: exported {checkpoint} as {fmt} to {path} (SentenceTransformer(path))")
        return 0
    else:
        path = export_drafter.export_drafter(checkpoint, out, fmt, target, target_id, force)
        print(f"vltrain: exported {checkpoint} as {fmt} to {path}")
        return 0
    print(f"vltrain: exported {resolve_checkpoint(checkpoint)} to {path}")
    return 0
