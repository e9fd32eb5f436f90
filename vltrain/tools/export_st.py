"""`vltrain export --format sentence-transformers`: a `model.kind: vlm` run as a directory that
``SentenceTransformer(path)`` loads (sentence-transformers >= 5.4, multimodal).

The directory is what sentence-transformers itself saves for a VLM embedder: the transformers
model in the root (LoRA merged, `save_pretrained`) read by its ``Transformer`` module
(``feature-extraction``, text / image / message inputs through the model's processor and chat
template), then ``Pooling`` (``lasttoken`` for ``model.pooling: eos``, ``mean``) and
``Normalize``. The run's instructions are the prompts ``query`` and ``document``
(`encode_query` / `encode_document` apply them); sentence-transformers injects a prompt as the
system message, and the exported chat template renders that system message where vltrain trained
the instruction (`model.instruction_role`: at the start of the user turn's text, after the image;
or as the system message itself, with the model's own template), so the tokens the model sees
equal vltrain's. ``model.matryoshka_dims`` are listed in the model card and in
``vltrain_export.json``: load with ``truncate_dim=d`` and encode with
``normalize_embeddings=True`` for vltrain's re-normalised prefix.

Nothing here imports sentence-transformers: the files are plain JSON, written from the run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from vltrain.config import ConfigError, load_config
from vltrain.config.hub_ids import is_model_id
from vltrain.core.checkpoint import resolve_checkpoint
from vltrain.tools import export_drafter
from vltrain.tools.loading import load_trained, run_config_for

FORMAT = "sentence-transformers"
# model.pooling -> sentence-transformers' Pooling mode
POOLING_MODES = {"eos": "lasttoken", "mean": "mean"}
ST_FILES = (
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    "1_Pooling",
    "2_Normalize",
    "vltrain_export.json",
    "README.md",
)
# The module paths and Pooling keys of the hub's sentence-transformers models: 5.4 reads them and
# 6.x maps them to its own (sentence_transformers/util/deprecated_import.py).
MODULES = [
    {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{name}"}
    for i, (path, name) in enumerate(
        (("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize"))
    )
]
_FORWARD = {"method": "forward", "method_output_name": "last_hidden_state"}
# Placed before the model's own chat template. The first text of the first user turn is
# stripped of surrounding whitespace (vltrain strips every text it reads: training, evaluation,
# `load_run`), and a leading system message (how sentence-transformers passes a prompt) becomes
# its head, or a text after the image when the turn has none, as vltrain's collate builds its
# prompts (`vltrain.data.hf_collate.HFCollate`); with `model.instruction_role: system` the
# system message stays where it is (`SYSTEM_KEPT`). The rest of the conversation is unchanged.
_PREFIX = (
    "{%- set sys = namespace(text='', on=false) -%}\n"
    "{%- set rest = messages -%}\n"
    "{%- set ns = namespace(msgs=[]) -%}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "{%- if TO_USER -%}\n"
    "{%- set sys.on = true -%}\n"
    "{%- set sys.text = messages[0]['content'] if messages[0]['content'] is string else "
    "messages[0]['content'] | map(attribute='text') | join('') -%}\n"
    "{%- else -%}{%- set ns.msgs = [messages[0]] -%}{%- endif -%}\n"
    "{%- set rest = messages[1:] -%}\n"
    "{%- endif -%}\n"
    "{%- for m in rest -%}\n"
    "{%- if loop.first and m['role'] == 'user' -%}\n"
    "{%- set items = [{'type': 'text', 'text': m['content']}] if m['content'] is string "
    "else m['content'] -%}\n"
    "{%- set c = namespace(items=[], done=false) -%}\n"
    "{%- for it in items -%}\n"
    "{%- if it['type'] == 'text' and not c.done -%}\n"
    "{%- set c.items = c.items + [{'type': 'text', 'text': sys.text ~ (it['text'] | trim)}] -%}\n"
    "{%- set c.done = true -%}\n"
    "{%- else -%}{%- set c.items = c.items + [it] -%}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if sys.on and not c.done -%}"
    "{%- set c.items = c.items + [{'type': 'text', 'text': sys.text}] -%}{%- endif -%}\n"
    "{%- set ns.msgs = ns.msgs + [{'role': 'user', 'content': c.items}] -%}\n"
    "{%- else -%}{%- set ns.msgs = ns.msgs + [m] -%}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- set messages = ns.msgs -%}\n"
)
SYSTEM_TO_USER = _PREFIX.replace("TO_USER", "true")
SYSTEM_KEPT = _PREFIX.replace("TO_USER", "false")


def check_expressible(kind: str) -> None:
    """A one-line error for a model kind sentence-transformers cannot load from this export."""
    if kind == "vlm":
        return
    native = (
        "its hf_model/ is a transformers model"
        if kind in ("hf_clip", "hf_siglip")
        else "the built-in towers load with vltrain (load_run)"
    )
    raise ConfigError(
        f"--format {FORMAT} exports model.kind: vlm runs; this run is model.kind: {kind}. "
        f"Use the native export (vltrain export RUN --out DIR): {native}."
    )


def wrap_chat_template(template: Any, system_to_user: bool = True) -> str:
    """The model's chat template with `SYSTEM_TO_USER` (`SYSTEM_KEPT`) in front of it."""
    if not isinstance(template, str) or not template:
        raise ConfigError(
            f"--format {FORMAT}: the model's tokenizer has no single chat template "
            f"({type(template).__name__}); vltrain's VLM prompts are built with one"
        )
    return (SYSTEM_TO_USER if system_to_user else SYSTEM_KEPT) + template


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _set_chat_template(out: Path, wrap: bool) -> None:
    """One chat template in chat_template.jinja, wrapped: `SYSTEM_TO_USER` for instructions
    trained in the user turn (`wrap`), `SYSTEM_KEPT` for instructions trained as the system
    message (sentence-transformers' prompt is that message); the tokenizer's and the
    processor's copies elsewhere are removed so neither shadows it."""
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(out, local_files_only=True).chat_template
    (out / "chat_template.jinja").write_text(wrap_chat_template(template, wrap), encoding="utf-8")
    (out / "chat_template.json").unlink(missing_ok=True)
    for name in ("tokenizer_config.json", "processor_config.json"):
        p = out / name
        if p.is_file():
            cfg = json.loads(p.read_text(encoding="utf-8"))
            if cfg.pop("chat_template", None) is not None:
                _write_json(p, cfg)


def _cap_visual_tokens(out: Path, max_tokens: int) -> None:
    """The visual-token budget as the image processor's max_pixels (the processor resizes
    over-budget pages with its own rule, within the same budget)."""
    p = out / "preprocessor_config.json"
    if not p.is_file():
        return
    cfg = json.loads(p.read_text(encoding="utf-8"))
    cell = int(cfg["patch_size"]) * int(cfg["merge_size"])
    cap = max_tokens * cell * cell
    size = cfg.get("size") or {}
    if "longest_edge" in size:
        size["longest_edge"] = min(int(size["longest_edge"]), cap)
        cfg["size"] = size
    if "max_pixels" in cfg:
        cfg["max_pixels"] = min(int(cfg["max_pixels"]), cap)
    _write_json(p, cfg)


def _model_card(kind_path: str, prompts: dict[str, str], dims: list[int], width: int) -> str:
    dims_line = (
        f"Matryoshka dimensions trained: {dims} (of {width}): "
        "`SentenceTransformer(path, truncate_dim=d)` and `encode(..., normalize_embeddings=True)`."
        if dims
        else f"Embedding width {width}."
    )
    return (
        "---\nlibrary_name: sentence-transformers\npipeline_tag: sentence-similarity\n---\n\n"
        f"# vltrain export of {kind_path}\n\n"
        "A vltrain `model.kind: vlm` run (last-token or mean pooling, normalised, LoRA merged).\n"
        "`model.encode_query(texts)` applies the query instruction, "
        "`model.encode_document(images)` the document one:\n\n"
        f"```json\n{json.dumps(prompts, indent=2)}\n```\n\n{dims_line}\n"
    )


def base_model_name(path: str) -> str:
    """A hub id as is; a local directory by its folder name (no absolute path leaves)."""
    return path if is_model_id(path) and not Path(path).exists() else Path(path).name


def write_st_files(out: Path, cfg: Any, width: int, source: str) -> None:
    """The sentence-transformers side of the export (beside the transformers model in `out`)."""
    m = cfg.model
    _write_json(out / "modules.json", MODULES)
    _write_json(
        out / "sentence_bert_config.json",
        {
            "transformer_task": "feature-extraction",
            "modality_config": {
                "text": _FORWARD,
                "image": _FORWARD,
                "message": {**_FORWARD, "format": "structured"},
            },
            "module_output_name": "token_embeddings",
            "processing_kwargs": {"chat_template": {"add_generation_prompt": True}},
        },
    )
    prompts = {"query": m.instruction_query, "document": m.instruction_doc}
    _write_json(
        out / "config_sentence_transformers.json",
        {
            "model_type": "SentenceTransformer",
            "prompts": prompts,
            "default_prompt_name": None,
            "similarity_fn_name": "cosine",
        },
    )
    _write_json(
        out / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": width,
            "pooling_mode": POOLING_MODES[m.pooling],
            "include_prompt": True,
        },
    )
    _write_json(
        out / "2_Normalize" / "config.json",
        {"module_input_name": "sentence_embedding", "module_output_name": "sentence_embedding"},
    )
    config_text = Path(source).read_bytes()
    _write_json(
        out / "vltrain_export.json",
        {
            "format": FORMAT,
            "base_model": base_model_name(m.path),
            "pooling": m.pooling,
            "matryoshka_dims": list(m.matryoshka_dims),
            "embedding_dim": width,
            "max_text_len": cfg.data.max_text_len,
            "max_visual_tokens": cfg.data.max_visual_tokens,
            "run_config_sha256": hashlib.sha256(config_text).hexdigest(),
        },
    )
    card = _model_card(base_model_name(m.path), prompts, list(m.matryoshka_dims), width)
    (out / "README.md").write_text(card, encoding="utf-8")


def export_sentence_transformers(
    checkpoint: str | Path, out: str | Path, force: bool = False
) -> Path:
    """Write `out` for ``SentenceTransformer(out)``; refuses model kinds it cannot express
    before loading any weights."""
    ckpt = resolve_checkpoint(checkpoint)
    out = Path(out)
    source = run_config_for(ckpt)
    check_expressible(load_config(source).model.kind)
    export_drafter.check_out(out, force)
    cfg, _, model = load_trained(ckpt)
    export_drafter.clear_out(out)
    for name in ST_FILES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    encoder = model.encoder
    encoder.save_pretrained(out)  # LoRA merged into a copy; processor files copied
    _set_chat_template(out, wrap=cfg.model.instruction_role == "user")
    if cfg.data.max_visual_tokens:
        _cap_visual_tokens(out, int(cfg.data.max_visual_tokens))
    write_st_files(out, cfg, int(encoder.embed_dim), str(source))
    return out
