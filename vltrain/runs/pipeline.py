"""`vltrain pipeline PIPELINE.yaml [overrides]`: run training stages in order under one root.

A pipeline file (configs/pipeline.yaml; docs/rl.md) lists stages, each a config file (relative to
the pipeline file) plus dotted overrides, and a shared ``root``:

    root: runs/pipeline
    overrides: [data.num_workers=2]        # applied to every stage (before its own)
    stages:
      - {name: pretrain, config: caption_pretrain.yaml, overrides: [train.max_steps=300]}
      - {name: finetune, config: caption_finetune.yaml}
      - {name: rl, config: rl.yaml}

Stage ``name`` runs in ``<root>/<name>``; every stage after the first starts from the previous
stage's best checkpoint: its ``init`` key (default ``model.init_from``; e.g.
``model.vision_init_from`` to take only a CLIP run's image tower; ``""`` for none) is set to
``<root>/<previous>``. ``init`` may instead map keys to earlier stages by name
(``{model.init_from: pretrain, model.vision_path: clip}``: each key set to
``<root>/<that stage>``). A stage whose checks need an earlier stage's output that is not
there yet (a llava stage reads its ``model.vision_path`` tower's geometry) is checked when it
starts instead. Restarting the pipeline skips a finished stage (``summary.json`` with
``steps == train.max_steps`` and the same config) and resumes an interrupted one
(``train.resume=true``); a stage whose saved config differs trains afresh. At the end a table of
every stage's summary goes to stdout and ``<root>/report.md``. Command-line overrides apply to
every stage, last. The quickstart is one such pipeline (configs/quickstart_pipeline.yaml).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vltrain.config import load_config
from vltrain.config.core import ConfigError, config_path, load_yaml, to_dict
from vltrain.config.schema import Config
from vltrain.core import checkpoint
from vltrain.core.files import atomic_write_text
from vltrain.engine import run_dir
from vltrain.runs.report import cell, markdown_table
from vltrain.stages import check_config, load_run_config

_KEYS = {"root", "overrides", "stages"}
_STAGE_KEYS = {"name", "config", "overrides", "init"}
#: summary columns shown first in the report, when present
_FIRST = ("eval_loss", "eval_BLEU-4", "eval_CIDEr-D", "eval_beam_BLEU-4", "eval_beam_CIDEr-D")


@dataclass
class PipelineStage:
    """One resolved stage: its name, its full config, and what the runner will do."""

    name: str
    cfg: Config
    action: str = "train"  # train | resume | skip
    checked: bool = True  # False: stage checks wait for an earlier stage's output


def _overrides(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, dict):  # {key: value} reads better in YAML for a few keys
        return [
            f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in value.items()
        ]
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return list(value)
    raise ConfigError(f"{where}: overrides must be a list of 'key=value' strings or a mapping")


def load_pipeline(
    path: str | Path,
    overrides: list[str] | None = None,
    stage_overrides: dict[str, list[str]] | None = None,
    root: str | Path | None = None,
    only: list[str] | None = None,
) -> list[PipelineStage]:
    """Read and validate a pipeline file; every stage config is loaded before any compute.

    `stage_overrides` adds overrides to named stages (after the file's, before `overrides`);
    `root` replaces the file's root; `only` keeps the named stages (in file order), each still
    chained to the previous one kept.
    """
    path = config_path(path)  # stage configs are relative to the file actually read
    spec = load_yaml(path)
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown pipeline keys {unknown}; valid: {sorted(_KEYS)}")
    root = root if root is not None else spec.get("root")
    stages = spec.get("stages")
    if not root or not isinstance(stages, list) or not stages:
        raise ConfigError(f"{path}: needs 'root' (a folder) and a non-empty 'stages' list")
    shared = _overrides(spec.get("overrides"), f"{path}: overrides")
    names = [st.get("name") for st in stages if isinstance(st, dict)]
    for name in [*(stage_overrides or {}), *(only or [])]:
        if name not in names:
            raise ConfigError(f"{path}: no stage named {name!r}; stages: {names}")
    out: list[PipelineStage] = []
    for i, st in enumerate(stages):
        if only is not None and isinstance(st, dict) and st.get("name") not in only:
            continue
        where = f"{path}: stages[{i}]"
        if not isinstance(st, dict) or not {"name", "config"} <= set(st):
            raise ConfigError(f"{where} needs 'name' and 'config'")
        bad = sorted(set(st) - _STAGE_KEYS)
        if bad:
            raise ConfigError(f"{where}: unknown keys {bad}; valid: {sorted(_STAGE_KEYS)}")
        name = str(st["name"])
        if not name or "/" in name or name in {s.name for s in out}:
            raise ConfigError(f"{where}: name {name!r} must be unique and a plain folder name")
        cfg_path = path.parent / st["config"]
        if not cfg_path.is_file():
            raise ConfigError(
                f"{where}: config {cfg_path} not found (paths are relative to {path})"
            )
        inputs = _inputs(st.get("init", "model.init_from"), out, names[:i], where)
        chain = [f"run.out_dir={Path(root) / name}"]
        chain += [f"{key}={Path(root) / src}" for key, src in inputs.items()]
        own = _overrides(st.get("overrides"), where) + list((stage_overrides or {}).get(name, []))
        over = shared + own + list(overrides or []) + chain
        pending = any(not (Path(root) / src).exists() for src in inputs.values())
        try:
            cfg, checked = load_run_config(cfg_path, over), True
        except ConfigError as e:
            if not pending:
                raise ConfigError(f"pipeline stage '{name}' ({cfg_path}): {e}") from None
            try:  # the keys alone now; the stage checks once its inputs exist
                cfg, checked = load_config(cfg_path, over), False
            except ConfigError as e2:
                raise ConfigError(f"pipeline stage '{name}' ({cfg_path}): {e2}") from None
        out.append(PipelineStage(name, cfg, checked=checked))
    return out


def _inputs(init: Any, out: list[PipelineStage], earlier: list[Any], where: str) -> dict:
    """A stage's ``init`` as {dotted key: source stage name}: a key string means the previous
    stage kept; a mapping names earlier stages of the file."""
    if isinstance(init, dict):
        for key, src in init.items():
            if src not in earlier:
                raise ConfigError(
                    f"{where}: init {key}: {src!r} is not an earlier stage; earlier: {earlier}"
                )
        return {str(k): str(v) for k, v in init.items()}
    if init and not isinstance(init, str):
        raise ConfigError(f"{where}: init must be a dotted key or a mapping {{key: stage}}")
    return {init: out[-1].name} if out and init else {}


def _same_run(cfg: Config, run: Path) -> bool:
    """True when `run` holds a config.yaml equal to `cfg` but for the keys a resume may change
    without permission (`run_dir.HARMLESS`: logging, workers, eval batch size, ...)."""
    saved = run / "config.yaml"
    if not saved.is_file():
        return False
    changes = run_dir.config_changes(yaml.safe_load(saved.read_text()) or {}, to_dict(cfg))
    return all(key.startswith(run_dir.HARMLESS) for key in changes)


def plan(stages: list[PipelineStage]) -> None:
    """Decide per stage: skip (finished), resume (checkpoints present) or train (fresh)."""
    for st in stages:
        run = Path(st.cfg.run.out_dir)
        summary = _summary(run)
        same = _same_run(st.cfg, run)
        if same and summary is not None and summary.get("steps") == st.cfg.train.max_steps:
            st.action = "skip"
        elif same and checkpoint.latest_checkpoint(run / "checkpoints") is not None:
            st.action = "resume"
            st.cfg.train.resume = True
        else:
            st.action = "train"


def _summary(run: Path) -> dict[str, Any] | None:
    p = run / "summary.json"
    return json.loads(p.read_text()) if p.is_file() else None


def run_pipeline(
    path: str | Path,
    overrides: list[str] | None = None,
    *,
    stage_overrides: dict[str, list[str]] | None = None,
    root: str | Path | None = None,
    only: list[str] | None = None,
    announce: Callable[[PipelineStage], None] | None = None,
    report: bool = True,
) -> list[dict[str, Any]]:
    """Run (or continue) a pipeline; one row per stage: name, action, summary, seconds.

    `announce(stage)` runs on rank 0 before each stage; `report=False` leaves the table and
    report.md to the caller (the quickstart writes its own).
    """
    from vltrain.core import distributed
    from vltrain.engine.runtime import setup
    from vltrain.runs import train
    from vltrain.runs.run_report import write_report

    stages = load_pipeline(path, overrides, stage_overrides, root, only)
    setup(stages[0].cfg)  # join torchrun's process group now, so only rank 0 prints below
    root = Path(stages[0].cfg.run.out_dir).parent
    rows: list[dict[str, Any]] = []
    for st in stages:
        plan([st])  # decided just before the stage: an earlier stage may have just finished
        # Rank 0's reading of the run folder decides for all ranks: a rank that sees the files
        # differently (a shared file system's lag) must not train while the others skip.
        st.action = distributed.broadcast_object(st.action)
        # a stage folder holding an older run of another config (or an unfinished one without
        # a checkpoint) is the pipeline's own: a fresh stage starts it over on purpose
        st.cfg.train.resume = st.action == "resume"
        st.cfg.train.overwrite = st.action == "train"
        if distributed.is_main():
            print(f"vltrain pipeline: stage '{st.name}': {st.action} -> {st.cfg.run.out_dir}")
            if announce is not None:
                announce(st)
        if not st.checked and st.action != "skip":
            check_config(st.cfg)  # the earlier stages it reads have run by now
        run = Path(st.cfg.run.out_dir)
        t = time.time()
        summary = (_summary(run) or {}) if st.action == "skip" else train(st.cfg)
        row = {"name": st.name, "action": st.action, "summary": summary}
        rows.append({**row, "seconds": time.time() - t})
    if distributed.is_main() and report:
        table = report_table(rows)
        print(table)
        atomic_write_text(root / "report.md", f"# Pipeline report: {path}\n\n{table}\n")
        write_report(
            [st.cfg.run.out_dir for st in stages], root / "report.html", f"pipeline {path}"
        )
    return rows


def report_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: one row per stage, its summary metrics as columns."""
    vals = [{k: v for k, v in (r["summary"].get("val") or {}).items() if k != "step"} for r in rows]
    keys = [k for k in _FIRST if any(k in v for v in vals)]
    keys += sorted({k for v in vals for k in v} - set(keys))
    head = ["stage", "action", "steps", "best", "best step", *keys]
    body = []
    for r, v in zip(rows, vals, strict=True):
        s = r["summary"]
        best = s.get("best_value")
        best_cell = f"{s.get('best_metric')} = {best:.4f}" if best is not None else "-"
        body.append(
            [r["name"], r["action"], cell(s.get("steps")), best_cell, cell(s.get("best_step"))]
            + [cell(v.get(k)) for k in keys]
        )
    return markdown_table(head, body)
