"""One trial: its config (base + sampled params + budget), and training it with the engine.

The trial trains with the full engine (`Trainer`) in its own run dir. After each evaluation the
engine calls back; the search's `decide` function (rank 0 asks Optuna, every rank receives the
same answer) says whether to go on, prune, or fail the trial, and the trial stops by raising
out of the callback, so every rank stops at the same step. `trial.json` in the run dir says how
the trial ended and why.
"""

from __future__ import annotations

import gc
import json
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vltrain.config.core import ConfigError, build, deep_merge
from vltrain.config.schema import Config, TuneConfig, validate_cross_fields
from vltrain.runs.tune.space import ParamSpec, corner_params, params_tree
from vltrain.runs.tune.storage import TuneError

#: decide(report_step, value, metrics, final) -> None to continue, or (state, reason)
Decide = Callable[[int, float, dict[str, float], bool], "tuple[str, str] | None"]


@dataclass
class Outcome:
    """How a trial ended: state 'complete', 'pruned' or 'failed', with the reason."""

    state: str
    value: float | None
    reason: str
    step: int
    seconds: float


class _Stop(Exception):
    """Raised from the eval callback to end a trial (pruned or failed)."""

    def __init__(self, state: str, reason: str) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason


def config_from_tree(tree: dict) -> Config:
    """Build and validate a Config from a nested dict (what load_config does after merging)."""
    cfg = build(Config, tree)
    validate_cross_fields(cfg)
    return cfg


class TrialPlan:
    """Turns a parameter set into a trial's config, and checks a whole space up front."""

    def __init__(
        self,
        base_tree: dict,
        base: Config,
        world_size: int,
        storage_display: str,
        metric: str,
        direction: str,
    ) -> None:
        self.base_tree = base_tree
        self.tune: TuneConfig = base.tune
        self.world_size = world_size
        self.storage_display = storage_display
        self.metric = metric
        self.direction = direction
        self._n_records: dict[str, int] = {}

    @property
    def unit(self) -> str:
        """What the pruner's steps count: 'epoch' or 'step'."""
        return "epoch" if self.tune.epochs else "step"

    def steps_per_epoch(self, cfg: Config) -> int:
        """Optimizer steps in one epoch over the trial's training subset."""
        path = cfg.data.train
        if path not in self._n_records:
            from vltrain.data.records import read_records

            d = cfg.data
            self._n_records[path] = len(read_records(path, d.image_column, d.text_column))
        n = self._n_records[path]
        if self.tune.train_samples:
            n = min(n, self.tune.train_samples)
        global_batch = cfg.data.batch_size * self.world_size * cfg.optim.accum_steps
        if n < global_batch:
            raise ConfigError(
                f"tune.epochs needs at least one full batch per epoch, but the training subset "
                f"has {n} records and a global batch holds {global_batch} (data.batch_size "
                f"{cfg.data.batch_size} x {self.world_size} processes x optim.accum_steps "
                f"{cfg.optim.accum_steps}); raise tune.train_samples or search smaller batches"
            )
        return n // global_batch

    def _budget(self, cfg: Config) -> tuple[int, int]:
        """(max_steps, eval_every) of a trial whose params are already merged into `cfg`."""
        t = self.tune
        if t.epochs:
            spe = self.steps_per_epoch(cfg)
            return t.epochs * spe, spe
        return t.max_steps or cfg.train.max_steps, t.eval_every or cfg.train.eval_every

    def config(self, params: dict[str, Any], run_dir: Path) -> Config:
        """The config a trial trains: base + params + budget, validated."""
        tree = deep_merge(self.base_tree, params_tree(params))
        max_steps, eval_every = self._budget(build(Config, tree))
        budget = {
            "run": {"out_dir": str(run_dir)},
            "train": {
                "max_steps": max_steps,
                "epochs": 0,  # a trial's length is the tune budget, not the base's train.epochs
                "save_every_epoch": False,
                "eval_every": eval_every,
                "resume": False,
                "best_metric": self.metric,
                "best_mode": "max" if self.direction == "maximize" else "min",
            },
            "data": {"max_train_samples": self.tune.train_samples},
            "optim": {"warmup_epochs": 0.0},
            "tune": {"storage": self.storage_display},
        }
        return config_from_tree(deep_merge(tree, budget))

    def best_config(self, params: dict[str, Any], out_dir: Path) -> Config:
        """Base config (its full budget) + params: what `best.yaml` holds for stage 1."""
        tree = deep_merge(self.base_tree, params_tree(params))
        tree = deep_merge(tree, {"run": {"out_dir": str(out_dir)}})
        tree["tune"] = {}
        return config_from_tree(tree)

    def report_step(self, cfg: Config, step: int) -> int:
        """The step Optuna sees: the optimizer step, or the epoch for epoch budgets."""
        return step // self.steps_per_epoch(cfg) if self.tune.epochs else step

    def check_space(
        self, specs: list[ParamSpec], enqueue: list[dict[str, Any]], study_dir: Path
    ) -> int:
        """Validate the config of every corner of the space (and enqueued sets) before any
        trial runs; returns how many parameter sets were checked."""
        sets = corner_params(specs) + [dict(e) for e in enqueue]
        for params in sets:
            for what, make in (
                ("trial", lambda p: self.config(p, study_dir / "check")),
                ("best.yaml", lambda p: self.best_config(p, study_dir)),
            ):
                try:
                    make(params)
                except ConfigError as e:
                    raise ConfigError(
                        f"tune.space allows a {what} config that is invalid: "
                        f"with {params}: {e}. Narrow tune.space or change the "
                        "base config"
                    ) from None
        return len(sets)


def nonfinite_reason(metric: str, value: float, metrics: dict[str, float]) -> str | None:
    """Why the metrics count as non-finite (the objective or any loss), else None."""
    if not math.isfinite(value):
        return f"{metric} is {value}"
    for k, v in metrics.items():
        if "loss" in k and isinstance(v, float) and not math.isfinite(v):
            return f"{k} is {v}"
    return None


def run_trial(
    cfg: Config,
    plan: TrialPlan,
    decide: Decide,
    is_main: bool,
    extra_status: dict[str, Any] | None = None,
) -> Outcome:
    """Train one trial with the engine; never raises for a trial's own failure.

    A TuneError (e.g. the objective metric is not logged) and KeyboardInterrupt propagate:
    they concern the whole search, not this trial.
    """
    from vltrain.runs import train

    t0 = time.time()
    last: dict[str, Any] = {"step": 0, "value": None}

    def on_eval(step: int, metrics: dict[str, float]) -> None:
        if plan.metric not in metrics:
            import difflib

            close = difflib.get_close_matches(plan.metric, list(metrics), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise TuneError(
                f"tune.metric '{plan.metric}' is not among the eval metrics {sorted(metrics)}{hint}"
            )
        value = float(metrics[plan.metric])
        last["step"], last["value"] = plan.report_step(cfg, step), value
        verdict = decide(last["step"], value, metrics, step >= cfg.train.max_steps)
        if verdict is not None:
            raise _Stop(*verdict)

    try:
        train(cfg, on_eval=on_eval)
        out = Outcome("complete", last["value"], "", last["step"], 0.0)
    except _Stop as e:
        out = Outcome(e.state, last["value"], e.reason, last["step"], 0.0)
    except TuneError:
        raise
    except KeyboardInterrupt:
        if is_main:
            write_status(
                Path(cfg.run.out_dir),
                {"state": "failed", "reason": "interrupted", **(extra_status or {})},
            )
        raise
    except Exception as e:
        out = Outcome("failed", last["value"], f"{type(e).__name__}: {e}", last["step"], 0.0)
        if is_main:
            Path(cfg.run.out_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.run.out_dir) / "error.txt").write_text(traceback.format_exc())
    finally:
        gc.collect()
    out.seconds = round(time.time() - t0, 1)
    if out.state == "complete" and (out.value is None or not math.isfinite(out.value)):
        out.state, out.reason = "failed", f"no finite {plan.metric} at the end of training"
    if is_main:
        write_status(Path(cfg.run.out_dir), {**asdict(out), **(extra_status or {})})
    return out


def write_status(run_dir: Path, status: dict[str, Any]) -> None:
    """`trial.json` in the trial's run dir: how it ended and why."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "trial.json").write_text(json.dumps(status, indent=2, default=str))
