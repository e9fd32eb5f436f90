"""What crosses the loop -> doctor seam: one StepRecord per optimizer step, Findings back.

The loop fills a :class:`StepRecord` from what it already has (loss, grad norm, LR, the
batches' bookkeeping); the doctor's probe adds what it reads from the model and the optimizer.
Every field that checks compare across ranks is already global (reduced by the loop) when a
check sees it, so every rank reaches the same verdict.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

#: severities in increasing order; `doctor.fail_on` names one of them (or "never")
SEVERITIES = ("info", "warn", "error")


def severity_rank(severity: str) -> int:
    """0 info, 1 warn, 2 error."""
    return SEVERITIES.index(severity)


@dataclass
class StepRecord:
    """One optimizer step as the doctor sees it (scalars; no tensors cross this seam)."""

    step: int  # the optimizer step this record describes (0-based)
    loss: float  # mean over micro-batches (and over ranks once the loop reduced it)
    grad_norm: float  # global pre-clip norm (nan when the step was skipped before backward)
    lr: float  # the base LR the configured schedule asks for at this step
    finite: bool = True  # loss and grad finite on every rank
    time_s: float = 0.0  # wall time of the step
    sample_ids: list[int] = field(default_factory=list)  # this rank's dataset indices
    epoch: int = -1  # the loader epoch of the step's first batch (-1: unknown)
    # the loader epoch of each of sample_ids (a step that accumulates micro-batches across an
    # epoch boundary holds two epochs); empty: every sample is of `epoch`
    sample_epochs: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # per-sample token lengths, when carried
    bucket: int | None = None  # the sampler's length bucket of the step's first batch, if any
    chance_loss: float | None = None  # the loss's value without information (contrastive)
    scaler_skip: bool = False  # fp16: the loss scaler skipped this step (gradient overflow)
    rank_ids: list[list[int]] = field(default_factory=list)  # every rank's ids (world > 1)
    rank_epochs: list[list[int]] = field(default_factory=list)  # and their epochs, likewise
    rank_weights: list[float] = field(default_factory=list)  # every rank's weight fingerprint
    # filled by the probe (vltrain.diagnostics.probe) from the model and the optimizer
    lr_applied: list[float] = field(default_factory=list)  # per group, read during the step
    lr_scales: list[float] = field(default_factory=list)  # per group multiplier of the base LR
    update_ratio: list[float] = field(default_factory=list)  # per group |dw| / |w| (sampled)
    stepped: bool = False  # the optimizer step ran
    no_grad: list[str] = field(default_factory=list)  # trainable, in the optimizer, grad None
    stale_grads: list[str] = field(default_factory=list)  # grads left over after zero_grad
    gates: dict[str, float] = field(default_factory=dict)  # tanh(gate) per gated layer
    temperature: dict[str, float] = field(default_factory=dict)  # log-scale and its clamp
    nonfinite: dict[str, Any] = field(default_factory=dict)  # provenance of a non-finite step
    weight_fp: float = 0.0  # fingerprint of sampled weights (DDP divergence)

    def keys(self) -> list[tuple[int, int]]:
        """(epoch, sample id) per sample: a sample is a repeat only within its own epoch."""
        epochs = self.sample_epochs or [self.epoch] * len(self.sample_ids)
        return list(zip(epochs, self.sample_ids, strict=True))

    def scalars(self) -> dict[str, Any]:
        """The record without per-sample lists: what `doctor_steps.jsonl` stores per line."""
        d = asdict(self)
        d.pop("rank_ids")
        d.pop("rank_epochs")
        d.pop("sample_ids")
        d.pop("sample_epochs")
        d["n_samples"] = len(self.sample_ids)
        if self.lengths:
            d["mean_len"] = sum(self.lengths) / len(self.lengths)
        return d


@dataclass
class Finding:
    """One thing the doctor noticed: where, how sure, the evidence, and what to change."""

    severity: str  # info | warn | error
    check: str  # the check's registry name, e.g. "loss_spike"
    step: int  # the step it concerns (the onset, where known)
    message: str  # one line for people
    fix: str = ""  # what to change
    evidence: dict[str, Any] = field(default_factory=dict)
    detected_at: int = -1  # the step whose record raised it (-1: before training / offline)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity {self.severity!r} is not one of {SEVERITIES}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=_jsonable)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(
            severity=d["severity"],
            check=d["check"],
            step=int(d["step"]),
            message=d["message"],
            fix=d.get("fix", ""),
            evidence=d.get("evidence", {}),
            detected_at=int(d.get("detected_at", -1)),
        )

    def line(self) -> str:
        """`SEVERITY step N [check] message -> fix`, as `vltrain doctor` prints it."""
        tail = f" -> {self.fix}" if self.fix else ""
        return f"{self.severity.upper():5s} step {self.step} [{self.check}] {self.message}{tail}"


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)
