"""The contract between the engine and a stage: what the one loop drives, and what crosses it.

A stage is a small task object (model, data, one forward-backward, evaluation). The engine owns
everything else: the loop, parallelism, precision, checkpoints, resume and logging. Stages
implement :class:`Stage`; the built-in ones are listed in ``vltrain.stages.STAGES``. A user
stage plugs in the same way: ``Trainer(cfg, stage=MyStage).run()`` (docs/internals.md).

What crosses the seam is typed: the loader yields :class:`Batch` (the stage's tensors plus the
engine's bookkeeping beside them, never inside them); the stage's part of it is the stage's own
batch type (a `TypedDict` of `vltrain.data.batches`, the parameter of :class:`Stage`), moved to
the device; a step returns :class:`StepOutput`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from torch import Tensor, nn

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.core import hub
from vltrain.data.loaders import Batch, Loader
from vltrain.engine import trackers

if TYPE_CHECKING:  # imported for annotations only: the runtime module imports this one
    from vltrain.engine.parallel import ParallelModel


@dataclass
class StepOutput:
    """What one micro-batch's forward-backward returns: the detached loss and metrics."""

    loss: Tensor  # scalar, detached: the loss of this micro-batch (global-batch mean)
    metrics: dict[str, float | Tensor] = field(default_factory=dict)


#: what a stage's collate builds and its forward_backward reads (e.g. `ImageTextBatch`)
BatchT = TypeVar("BatchT", contravariant=True)


@runtime_checkable
class Stage(Protocol[BatchT]):
    """What the engine drives. Construct as ``StageClass(cfg, out_dir, ctx)``.

    Class attributes: ``best_metric`` / ``best_mode`` pick ``checkpoints/best`` unless
    ``train.best_metric`` overrides them.
    """

    best_metric: str
    best_mode: str

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Raise ConfigError for any key this stage cannot honour (runs before any compute)."""

    @classmethod
    def eval_metrics(cls, cfg: Config) -> Sequence[str]:
        """Names (fnmatch patterns allowed) of the metrics `evaluate` returns, prefixed eval_."""

    def prepare(self) -> None:
        """One-time work before the model is built (e.g. train or load a tokenizer)."""

    def build_model(self) -> nn.Module:
        """The trainable module (everything the optimizer updates, incl. loss parameters)."""

    def build_loader(self) -> Loader:
        """This rank's training loader (the engine restores its state on resume)."""

    def forward_backward(self, model: ParallelModel, batch: BatchT, scale: float) -> StepOutput:
        """Forward one micro-batch (on the device) and backpropagate ``loss * scale`` (through
        `model`, which syncs gradients as the parallel mode requires)."""

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Metrics on `split` ('val' or 'test'); called on every rank, sharded internally."""

    def checkpoint_files(self) -> dict[str, Path]:
        """Files copied into every checkpoint (e.g. the tokenizer)."""

    def export(self, model: nn.Module, folder: Path) -> None:
        """Write extra artifacts into a checkpoint folder being saved (e.g. HF save_pretrained)."""

    def state_dict(self) -> dict[str, Any]:
        """Extra stage state saved with the trainer state (tensors, numbers, strings)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of state_dict."""


def _logs(metric: str, pattern: str, cfg: Config) -> bool:
    """Whether a stage reporting `pattern` logs `metric`. A rank pattern (``eval_R@*``) stands
    for the ranks computed, optionally per query group (``eval_R@1_<group>``, the groups the
    local eval records name), not for any text: ``eval_R@1_men`` needs a group ``men``."""
    if not fnmatch.fnmatchcase(metric, pattern):
        return False
    if not pattern.endswith("@*"):
        return True
    from vltrain.eval.corpus import KS

    k, _, group = metric[len(pattern) - 1 :].partition("_")
    if not k.isdigit() or int(k) not in KS:
        return False
    groups = _eval_groups(cfg.data.eval)
    return not group or groups is None or group in groups


def _eval_groups(source: str) -> set[str] | None:
    """The metric suffixes of the query groups a local JSONL eval set names (None: not a local
    JSONL file, so unknown until evaluation)."""
    import json

    from vltrain.eval.corpus import metric_suffix

    path = Path(source)
    if path.is_dir():
        path = path / "queries.jsonl"
    if path.suffix != ".jsonl" or not path.is_file():
        return None
    groups = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"group"' not in line:
                continue
            try:
                group = json.loads(line).get("group")
            except (ValueError, AttributeError):
                continue
            if isinstance(group, str):
                groups.add(metric_suffix(group))
    return groups


def best_metric_of(cfg: Config, stage: type[Stage]) -> tuple[str, str]:
    """(metric, mode) that picks ``checkpoints/best``; checked against the stage's metrics."""
    metric = cfg.train.best_metric or stage.best_metric
    mode = cfg.train.best_mode or stage.best_mode
    if cfg.data.eval:
        names = list(stage.eval_metrics(cfg))
        if not any(_logs(metric, pattern, cfg) for pattern in names):
            import difflib

            plain = [n for n in names if "*" not in n]
            close = difflib.get_close_matches(metric, plain, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(
                f"'train.best_metric' is {metric!r}, which stage '{cfg.stage}' does not report"
                f"{hint} (it reports {', '.join(names)})"
            )
    return metric, mode


#: what a stage class must define (the `Stage` protocol's methods)
STAGE_METHODS = (
    "check_config",
    "eval_metrics",
    "prepare",
    "build_model",
    "build_loader",
    "forward_backward",
    "evaluate",
)


def check_stage(cfg: Config, stage: type[Stage]) -> tuple[str, str]:
    """Every load-time check of a stage for this config; returns its best (metric, mode)."""
    missing = [m for m in STAGE_METHODS if not callable(getattr(stage, m, None))]
    if not isinstance(stage, type) or missing:
        what = f"a class without {', '.join(missing)}" if isinstance(stage, type) else repr(stage)
        raise ConfigError(
            f"Trainer(cfg, stage=...) takes a Stage class (docs/internals.md), not {what}; "
            f"the built-in stage config.stage names ({cfg.stage!r}) trains with "
            "vltrain.train(cfg)"
        )
    stage.check_config(cfg)
    hub.check_sources(cfg)  # hub ids in the HF cache, or allowed to download
    trackers.check_trackers(cfg)  # the packages of the loggers asked for
    return best_metric_of(cfg, stage)


__all__ = [
    "Batch",
    "Loader",
    "Stage",
    "StepOutput",
    "best_metric_of",
    "check_stage",
]
