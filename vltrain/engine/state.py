"""Trainer state: what a resumed run needs besides the weights, saved and restored by one path.

Every stateful part (loop counters, optimizer, loader position, stage extras, bad-sample
counts, RNG) has ``state_dict`` / ``load_state_dict``; :func:`collect` and :func:`restore`
walk one ordered table of them, so save and restore cannot drift apart. Everything loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from vltrain.core import checkpoint


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """The loop's own counters and the best checkpoint so far."""

    step: int = 0
    skipped_steps: int = 0
    scaler_skips: int = 0  # fp16: steps the loss scaler skipped on overflow (not in the above)
    consecutive_skips: int = 0
    best_value: float | None = None
    best_step: int = -1
    history: list[dict[str, float]] = field(default_factory=list)  # one row per evaluation

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])


class RngState:
    """Python, numpy and torch (CPU and CUDA) generators as one stateful part."""

    def state_dict(self) -> dict[str, Any]:
        return checkpoint.rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        checkpoint.set_rng_state(state)


def collect(parts: Mapping[str, Stateful], **extra: Any) -> dict[str, Any]:
    """Every part's state under its name, plus plain `extra` values (e.g. world size)."""
    return {**{name: part.state_dict() for name, part in parts.items()}, **extra}


def restore(parts: Mapping[str, Stateful], state: Mapping[str, Any]) -> None:
    """Load every part from `state`, in the table's order (RNG last, so nothing after it
    draws random numbers)."""
    missing = [name for name in parts if name not in state]
    if missing:
        raise ValueError(f"trainer state lacks {missing}: was it written by another vltrain?")
    for name, part in parts.items():
        part.load_state_dict(state[name])
