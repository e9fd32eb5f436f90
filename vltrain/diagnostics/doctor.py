"""The doctor: runs every check on each StepRecord, writes doctor.jsonl, aborts on `fail_on`.

Online, the loop builds a StepRecord per optimizer step and calls :meth:`Doctor.observe`;
offline, :func:`analyse_run` replays a run directory's ``doctor_steps.jsonl`` (or, for a run
trained without the doctor, its ``metrics.jsonl``) through the same checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from vltrain.config.schema import Config, load_config
from vltrain.core.files import atomic_write_lines
from vltrain.diagnostics.card import write_run_card
from vltrain.diagnostics.checks import CHECKS
from vltrain.diagnostics.contrastive_checks import ChanceLoss, config_chance
from vltrain.diagnostics.data_checks import (
    BatchComposition,
    DataOrder,
    batch_norm_split,
    eval_overlap,
    train_duplicates,
)
from vltrain.diagnostics.probe import Probe
from vltrain.diagnostics.record import Finding, StepRecord, severity_rank

_RECORD_FIELDS = tuple(f.name for f in fields(StepRecord))  # one doctor_steps.jsonl row

#: every check, by name (the online and offline doctor run the same table)
ALL_CHECKS: dict[str, Any] = {
    **CHECKS,
    "batch_composition": BatchComposition,
    "data_order": DataOrder,
    ChanceLoss.name: ChanceLoss,
}


#: findings that need the live model (the step records cannot reproduce them offline)
ONLINE_ONLY = {"not_in_optimizer", "frozen_unasked", "frozen_gets_grad"}


class DoctorAbort(RuntimeError):
    """A finding at or above `doctor.fail_on`."""


class Doctor:
    """Checks for one run. `probe` (None offline) reads the model and the optimizer."""

    def __init__(
        self,
        cfg: Config,
        out_dir: Path | None,
        is_main: bool,
        probe: Probe | None = None,
        gather: Callable[[Any], list[Any]] | None = None,
        history: History | None = None,
    ) -> None:
        """`gather(obj) -> [obj of every rank]` (the engine's all_gather_object) makes the
        loss, sample ids and weight fingerprints global before any check reads them.
        `history` (a resumed run's, `read_history`): its step rows are replayed through the
        checks, so they judge the resumed steps as they would have judged them unbroken, and
        rank 0 rewrites both files with only that history before appending."""
        self.cfg, self.probe, self.gather = cfg, probe, gather
        self.checks = [cls(cfg) for cls in ALL_CHECKS.values()]
        self.findings: list[Finding] = []
        self.files: dict[str, Any] = {}
        for row in history.steps if history is not None else []:
            rec = _record(row)
            for c in self.checks:
                c.observe(rec)  # restores the check's state; its findings are already written
        if out_dir is not None and is_main:
            names = ["doctor.jsonl"] + (["doctor_steps.jsonl"] if cfg.doctor.write_steps else [])
            mode = "a" if history is not None else "w"  # a fresh start writes anew
            for name in names:
                if history is not None:
                    kept = history.findings if name == "doctor.jsonl" else history.steps
                    atomic_write_lines(out_dir / name, (json.dumps(r) for r in kept))
                self.files[name] = open(out_dir / name, mode, buffering=1)

    @classmethod
    def for_training(
        cls,
        cfg: Config,
        out_dir: Path,
        is_main: bool,
        module: nn.Module,
        optimizer: Optimizer,
        gather: Callable[[Any], list[Any]] | None = None,
        start_step: int = 0,
    ) -> Doctor:
        """The online doctor: a probe on `module`/`optimizer`, then the checks known before the
        first step (parameters outside the optimizer, frozen parts, eval/train overlap).
        `start_step` > 0 (a resume): rank 0 reads the run's doctor history before that step
        and every rank takes rank 0's copy (one collective), so all ranks' checks agree."""
        mine = read_history(out_dir, start_step) if is_main and start_step > 0 else None
        got = gather(mine) if gather is not None else [mine]  # a collective: every rank calls it
        world, history = len(got), got[0]  # rank 0's history on every rank
        probe = Probe(module, optimizer, list(cfg.model.freeze), cfg.model.lora_r == 0)
        doc = cls(cfg, out_dir, is_main, probe, gather, history)
        if is_main:
            write_run_card(out_dir, world, str(next(module.parameters()).device))
        opt_check = next(c for c in doc.checks if c.name == "optimizer")
        found = opt_check.structure(
            probe.not_in_optimizer,
            probe.frozen_unasked,
            probe.frozen_trainable,
            probe.unasked_parts,
        )
        data = eval_overlap(cfg) + train_duplicates(cfg)
        doc._emit(found + data + batch_norm_split(cfg, module, world))
        return doc

    def _emit(self, found: list[Finding]) -> None:
        self.findings += found
        f = self.files.get("doctor.jsonl")
        for x in found:
            if f is not None:
                f.write(x.to_json() + "\n")
        fail_on = self.cfg.doctor.fail_on
        if fail_on != "never":
            bad = [x for x in found if severity_rank(x.severity) >= severity_rank(fail_on)]
            if bad:
                self.close()
                raise DoctorAbort(
                    "the doctor stopped the run (doctor.fail_on="
                    + fail_on
                    + "): "
                    + "; ".join(x.line() for x in bad[:3])
                )

    def observe(self, rec: StepRecord) -> list[Finding]:
        """Check one step; returns (and writes) its new findings."""
        if self.probe is not None:
            self.probe.fill(rec)
        if self.gather is not None:
            rows = self.gather((rec.loss, rec.sample_ids, rec.weight_fp, rec.sample_epochs))
            if len(rows) > 1:
                losses = [r[0] for r in rows]
                rec.loss = sum(losses) / len(losses)
                rec.rank_ids = [r[1] for r in rows]
                rec.rank_weights = [r[2] for r in rows]
                rec.rank_epochs = [r[3] for r in rows]
        found = [f for c in self.checks for f in c.observe(rec)]
        for f in found:
            f.detected_at = rec.step
        steps = self.files.get("doctor_steps.jsonl")
        if steps is not None:
            steps.write(json.dumps({k: getattr(rec, k) for k in _RECORD_FIELDS}) + "\n")
        self._emit(found)
        return found

    def finish(self) -> list[Finding]:
        """End-of-run summaries (loss modes per length bucket, spikes after saves)."""
        found = [f for c in self.checks for f in c.finish()]
        try:
            self._emit(found)
        finally:
            self.close()
        return found

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        for f in self.files.values():
            f.close()
        self.files = {}


@dataclass
class History:
    """A resumed run's doctor files up to the step it resumes from (their JSON rows)."""

    steps: list[dict[str, Any]]  # doctor_steps.jsonl rows of steps before the resume step
    findings: list[dict[str, Any]]  # doctor.jsonl findings raised by those steps


def read_history(out_dir: Path, start_step: int) -> History:
    """What the doctor wrote for the steps a checkpoint at `start_step` (finished steps) holds.

    Dropped: rows of later steps (lost work the resumed run does again, which used to appear
    twice), findings those steps raised, and the before-training and end-of-run findings
    (detected_at -1), which the resumed run raises again.
    """
    steps = [r for r in _read_jsonl(out_dir / "doctor_steps.jsonl") if r["step"] < start_step]
    findings = [
        r
        for r in _read_jsonl(out_dir / "doctor.jsonl")
        if 0 <= int(r.get("detected_at", -1)) < start_step
    ]
    return History(steps, findings)


_RECORD_NAMES = frozenset(_RECORD_FIELDS)


def _record(row: dict[str, Any]) -> StepRecord:
    """A StepRecord from a doctor_steps.jsonl row (its summary-only keys dropped)."""
    return StepRecord(**{k: v for k, v in row.items() if k in _RECORD_NAMES})


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    return rows


def load_records(run_dir: Path) -> list[StepRecord]:
    """The run's StepRecords: doctor_steps.jsonl, else rebuilt from metrics.jsonl."""
    rows = _read_jsonl(run_dir / "doctor_steps.jsonl")
    if rows:
        return [_record(r) for r in rows]
    out = []
    for r in _read_jsonl(run_dir / "metrics.jsonl"):
        if "loss" in r and "grad_norm" in r:
            loss, g = float(r["loss"]), float(r["grad_norm"])
            out.append(
                StepRecord(
                    step=int(r["step"]) - 1,
                    loss=loss,
                    grad_norm=g,
                    lr=float(r.get("lr", 0.0)),
                    finite=loss == loss and g == g,
                    chance_loss=r.get("train_chance_loss"),
                )
            )
        # metrics.jsonl 'step' counts finished steps; records are 0-based
    return out


def _world_size(run_dir: Path) -> int:
    path = run_dir / "run_card.json"
    return int(json.loads(path.read_text()).get("world_size", 1)) if path.is_file() else 1


def run_config(run_dir: Path) -> Config:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    return load_config(path)


def analyse_run(run_dir: str | Path) -> list[Finding]:
    """Re-run the checks over a (finished or running) run directory; sorted by step.

    Findings only the online doctor can make (it saw the model: parameters outside the
    optimizer, stale gradients, provenance) come from doctor.jsonl and are kept.
    """
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    doc = Doctor(cfg, None, False)
    found = eval_overlap(cfg)
    records = load_records(run_dir)
    if any(r.chance_loss is None for r in records):  # a run recorded before chance_loss
        chance = config_chance(cfg, _world_size(run_dir))
        for r in records:
            r.chance_loss = chance if r.chance_loss is None else r.chance_loss
    for rec in records:
        found += [f for c in doc.checks for f in c.observe(rec)]
    found += [f for c in doc.checks for f in c.finish()]
    seen = {(f.check, f.step) for f in found}
    replayed = (run_dir / "doctor_steps.jsonl").is_file()
    for row in _read_jsonl(run_dir / "doctor.jsonl"):
        f = Finding.from_dict(row)
        if replayed and f.check not in ONLINE_ONLY:
            continue  # the replay above re-decided it with the current checks
        if (f.check, f.step) not in seen:
            seen.add((f.check, f.step))
            found.append(f)
    return sorted(found, key=lambda f: (f.step, -severity_rank(f.severity)))
