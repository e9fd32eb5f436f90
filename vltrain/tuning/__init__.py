"""Hyperparameter search with Optuna: `vltrain tune CONFIG.yaml` (see docs/tuning.md)."""

from vltrain.tuning.storage import TuneError, redact

__all__ = ["TuneError", "redact", "run_search"]


def run_search(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - thin lazy re-export
    """See `vltrain.tuning.search.run_search` (imported lazily: optuna loads only when used)."""
    from vltrain.tuning.search import run_search as _run

    return _run(*args, **kwargs)
