"""Hyperparameter search with Optuna: `vltrain tune CONFIG.yaml` (see docs/tuning.md)."""

from __future__ import annotations

from typing import Any

from vltrain.runs.tune.storage import TuneError, redact

__all__ = ["TuneError", "redact", "run_search"]


def run_search(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """`vltrain.runs.tune.search.run_search`, imported on first use (it pulls in the engine)."""
    from vltrain.runs.tune.search import run_search as _run

    return _run(*args, **kwargs)
