"""`vltrain tune`: an Optuna search over a config's `tune.space`, resumable, torchrun-aware.

    base config --(sampled params + budget)--> trial config --Trainer--> eval metrics
         ^                                                                   |
         +--------------- best.yaml <-- best trial <-- study (storage) <-----+

Rank 0 alone talks to the study. Under torchrun it broadcasts each trial's parameters and,
after every evaluation, the verdict (go on / prune / fail), so all ranks train the same trial
and stop at the same step.
"""

from __future__ import annotations

import fnmatch
import os
import re
import time
from pathlib import Path
from typing import Any

from vltrain.config.core import ConfigError, deep_merge, load_yaml, parse_overrides
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.runs.tune.results import write_results
from vltrain.runs.tune.space import ParamSpec, check_enqueued, parse_space
from vltrain.runs.tune.storage import (
    StorageSpec,
    TuneError,
    fail_dead_trials,
    open_storage,
    resolve_storage,
    worker_identity,
)
from vltrain.runs.tune.trial import (
    Outcome,
    TrialPlan,
    config_from_tree,
    nonfinite_reason,
    run_trial,
    write_status,
)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def resolve_objective(cfg: Config) -> tuple[str, str]:
    """(metric, direction) from `tune.metric`/`tune.direction`, defaulting to the stage's."""
    from vltrain.stages import get_stage

    stage = get_stage(cfg.stage)
    metric = cfg.tune.metric or stage.best_metric
    if not metric.startswith("eval_"):
        raise ConfigError(
            f"tune.metric '{metric}' must name a logged eval metric, which start "
            f"with 'eval_' (did you mean eval_{metric}?)"
        )
    direction = cfg.tune.direction
    if not direction:
        if metric != stage.best_metric:
            raise ConfigError(
                f"tune.metric is '{metric}': set tune.direction to 'maximize' or "
                "'minimize' (the default only covers the stage's own metric "
                f"'{stage.best_metric}')"
            )
        direction = "maximize" if stage.best_mode == "max" else "minimize"
    if not cfg.data.eval:
        raise ConfigError("vltrain tune needs evaluation metrics: set data.eval")
    names = list(stage.eval_metrics(cfg))
    if not any(fnmatch.fnmatchcase(metric, pattern) for pattern in names):
        raise ConfigError(
            f"tune.metric '{metric}' is not a metric of stage '{cfg.stage}' "
            f"(it reports {', '.join(names)})"
        )
    return metric, direction


def _check_budget(tune: Any) -> None:
    """One budget unit per study: steps or epochs."""
    if tune.epochs and tune.max_steps:
        raise ConfigError(
            f"set either tune.epochs ({tune.epochs}) or tune.max_steps ({tune.max_steps}), not both"
        )
    if tune.epochs and tune.eval_every:
        raise ConfigError(
            "tune.eval_every applies to step budgets; with tune.epochs every trial "
            "evaluates (and reports to the pruner) once per epoch: unset it"
        )


def _base_tree(config_path: str, overrides: list[str], flags: dict[str, Any]) -> dict:
    tree = load_yaml(config_path)
    tree = deep_merge(tree, parse_overrides(overrides))
    set_flags = {k: v for k, v in flags.items() if v is not None}
    return deep_merge(tree, {"tune": set_flags}) if set_flags else tree


class Search:
    """One worker of a study: validates everything, then runs trials until the study is done."""

    def __init__(
        self,
        config_path: str,
        overrides: list[str] | None = None,
        trials: int | None = None,
        storage: str | None = None,
        study: str | None = None,
    ) -> None:
        self.config_path = config_path
        self.tree = _base_tree(
            config_path, overrides or [], {"trials": trials, "storage": storage, "study": study}
        )
        self.base = config_from_tree(self.tree)
        self.tune = self.base.tune
        self.specs: list[ParamSpec] = parse_space(self.tune.space)
        check_enqueued(self.specs, self.tune.enqueue)
        self.metric, self.direction = resolve_objective(self.base)
        _check_budget(self.tune)
        self.fatal: Exception | None = None
        self.outcomes: dict[int, Outcome] = {}

    # ---- setup -------------------------------------------------------------------------

    def _study_name(self) -> str:
        name = self.tune.study or f"{Path(self.config_path).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        name = distributed.broadcast_object(name)  # every rank uses rank 0's (timestamped) name
        if not _NAME.match(name):
            raise ConfigError(
                f"study name {name!r} must be letters, digits, '.', '_' or '-' (it names a folder)"
            )
        return name

    def _prepare(self) -> None:
        from vltrain.engine.runtime import setup

        self.ctx = setup(self.base)  # joins the torchrun process group, if any
        self.name = self._study_name()
        self.study_dir = (Path(self.base.run.out_dir) / self.name).resolve()
        self.storage_spec: StorageSpec = resolve_storage(self.tune.storage, self.study_dir)
        self.plan = TrialPlan(
            self.tree,
            self.base,
            self.ctx.world_size,
            self.storage_spec.display,
            self.metric,
            self.direction,
        )
        self.n_checked = self.plan.check_space(self.specs, self.tune.enqueue, self.study_dir)

    def _sampler(self, n_existing: int) -> Any:
        import optuna

        seed = self.base.run.seed + n_existing
        if self.storage_spec.kind != "sqlite" or self.tune.storage:
            seed += os.getpid()  # shared storages: several workers must not draw alike
        n_random = max(self.tune.n_startup_trials, 1)
        if self.tune.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_random)

    def _pruner(self) -> Any:
        import optuna

        if self.tune.pruner == "none":
            return optuna.pruners.NopPruner()
        return optuna.pruners.MedianPruner(
            n_startup_trials=self.tune.n_startup_trials, n_warmup_steps=self.tune.n_warmup_steps
        )

    def _open_study(self) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.ERROR)  # we print each trial ourselves
        self.storage = open_storage(self.storage_spec, self.tune.heartbeat_interval)
        try:
            n_existing = len(optuna.load_study(study_name=self.name, storage=self.storage).trials)
        except KeyError:
            n_existing = 0
        self.study = optuna.create_study(
            storage=self.storage,
            study_name=self.name,
            direction=self.direction,
            load_if_exists=True,
            sampler=self._sampler(n_existing),
            pruner=self._pruner(),
        )
        self._check_compatible()
        self.dead = fail_dead_trials(self.study, self.storage)
        if n_existing == 0:
            for params in self.tune.enqueue:
                self.study.enqueue_trial(params)

    def _check_compatible(self) -> None:
        """A resumed study must search the same space for the same objective, on as many
        processes: the global batch (data.batch_size x processes x optim.accum_steps) sets a
        trial's steps and metrics, so trials of two process counts do not compare (the
        pruner would judge one against the other's median). A study recorded before the
        process count was (no `world_size`) resumes without that check."""
        want = {
            "space": {s.key: s.describe() for s in self.specs},
            "metric": self.metric,
            "direction": self.direction,
            "world_size": self.ctx.world_size,
        }
        have = self.study.user_attrs.get("vltrain")
        if have is None:
            self.study.set_user_attr("vltrain", want)
            return
        before = have.get("world_size", want["world_size"])
        if before != want["world_size"]:
            raise TuneError(
                f"study '{self.name}' ran its trials on {_processes(before)} and this run has "
                f"{_processes(want['world_size'])}: the global batch (data.batch_size x "
                "processes x optim.accum_steps), and with it each trial's steps and metrics, "
                f"would not compare with its finished trials'; resume {_launch(before)}, or "
                "start a new --study"
            )
        diff = sorted(k for k in want if k in have and want[k] != have[k])
        if diff:
            raise TuneError(
                f"study '{self.name}' was created with a different {', '.join(diff)} "
                f"({have}); use a new --study name, or restore the original "
                "tune section to resume it"
            )

    # ---- trials ------------------------------------------------------------------------

    def _finished(self) -> int:
        from optuna.trial import TrialState

        return len(
            self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        )

    def _prune_reason(self, step: int, value: float) -> str:
        """Why the median pruner stopped a trial, with the median it compared against."""
        import statistics

        from optuna.trial import TrialState

        others = [
            t.intermediate_values[step]
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if step in t.intermediate_values
        ]
        median = f"{statistics.median(others):.6g}" if others else "n/a"
        return (
            f"pruned by the median pruner at {self.plan.unit} {step}: best {self.metric} so far "
            f"{value:.6g} is worse than the median {median} of {len(others)} completed "
            "trials there"
        )

    def _decide_main(self, trial: Any) -> Any:
        seen: list[float] = []
        best = min if self.direction == "minimize" else max

        def decide(step: int, value: float, metrics: dict[str, float], final: bool) -> Any:
            verdict = None
            why = nonfinite_reason(self.metric, value, metrics)
            if why is not None:
                verdict = ("failed", f"non-finite metrics at {self.plan.unit} {step}: {why}")
            else:
                trial.report(value, step)
                seen.append(value)
                if not final and trial.should_prune():
                    verdict = ("pruned", self._prune_reason(step, best(seen)))
            return distributed.broadcast_object(verdict)

        return decide

    def _train(self, number: int, params: dict[str, Any], decide: Any) -> Outcome:
        """Build the trial's config and train it (every rank)."""
        run_dir = self.study_dir / f"trial_{number:04d}"
        status = {"number": number, "params": params, "study": self.name}
        try:
            cfg = self.plan.config(params, run_dir)
        except ConfigError as e:
            out = Outcome("failed", None, f"invalid trial config: {e}", 0, 0.0)
            if self.ctx.is_main:
                write_status(run_dir, {**status, **out.__dict__})
            return out
        return run_trial(cfg, self.plan, decide, self.ctx.is_main, status)

    def _objective(self, trial: Any) -> float:
        import optuna

        # run_dir first: a trial whose worker is known also knows where its trial.json goes
        trial.set_user_attr("run_dir", str(self.study_dir / f"trial_{trial.number:04d}"))
        trial.set_user_attr("worker", worker_identity())
        params = {s.key: s.suggest(trial) for s in self.specs}
        distributed.broadcast_object((trial.number, params))
        try:
            out = self._train(trial.number, params, self._decide_main(trial))
        except TuneError as e:
            self.fatal = e
            trial.set_user_attr("fail_reason", str(e))
            return float("nan")
        except KeyboardInterrupt:
            trial.set_user_attr("fail_reason", "interrupted (Ctrl-C)")
            raise  # optuna marks the trial FAIL
        self.outcomes[trial.number] = out
        if out.state == "pruned":
            trial.set_user_attr("prune_reason", out.reason)
            raise optuna.TrialPruned(out.reason)
        if out.state == "failed":
            trial.set_user_attr("fail_reason", out.reason)
            return float("nan")  # optuna records FAIL; the search goes on
        return float(out.value)

    def _print_trial(self, number: int) -> None:
        out = self.outcomes.get(number)
        if out is None:
            return
        t = self.study.trials[number]
        params = " ".join(f"{k}={_fmt(v)}" for k, v in t.params.items())
        where = (
            "no eval"
            if out.value is None
            else (f"{self.metric}={out.value:.4f} at {self.plan.unit} {out.step}")
        )
        print(
            f"trial {number:3d} {out.state.upper():8s} {where}  {out.seconds:6.1f} s  {params}",
            flush=True,
        )
        if out.reason:
            print(f"          {out.reason}", flush=True)

    def _run_main(self) -> None:
        """Rank 0: run trials until the study has `tune.trials` finished ones."""
        fails_in_row = 0
        try:
            while self.fatal is None and self._finished() < self.tune.trials:
                before = set(self.outcomes)
                self.study.optimize(self._objective, n_trials=1, gc_after_trial=True)
                new = sorted(set(self.outcomes) - before)
                for n in new:
                    self._print_trial(n)
                failed = [n for n in new if self.outcomes[n].state == "failed"]
                fails_in_row = fails_in_row + 1 if failed else 0
                if fails_in_row >= self.tune.max_failed_trials and self.fatal is None:
                    last = self.outcomes[failed[-1]].reason
                    self.fatal = TuneError(
                        f"{fails_in_row} trials in a row failed (last: {last}); see trial.json "
                        f"and error.txt in {self.study_dir}, fix the cause, then resume with "
                        f"--study {self.name}"
                    )
        finally:
            distributed.broadcast_object(None)  # release the other ranks

    def _run_follower(self) -> None:
        """Ranks > 0 under torchrun: train whatever trial rank 0 announces."""
        while True:
            msg = distributed.broadcast_object(None)
            if msg is None:
                return
            number, params = msg
            try:
                self._train(number, params, lambda *a: distributed.broadcast_object(None))
            except TuneError:
                continue  # rank 0 reports it and ends the search

    def run(self) -> dict[str, Any]:
        """Run (or resume) the study; rank 0 writes results and returns the summary."""
        t0 = time.time()
        self._prepare()
        summary: dict[str, Any] = {}
        if self.ctx.is_main:
            try:
                self._open_study()
            except ConfigError as e:  # e.g. a resume on another process count
                distributed.broadcast_object(e)  # every rank stops with it, none hangs
                raise
            distributed.broadcast_object(None)
            self._print_header()
            self._run_main()
            summary = write_results(self, time.time() - t0)
        else:
            refused = distributed.broadcast_object(None)
            if refused is not None:
                raise refused
            self._run_follower()
        if self.fatal is not None:
            raise self.fatal
        return summary

    def _print_header(self) -> None:
        tune = self.tune
        if tune.epochs:
            budget = f"{tune.epochs} epochs"
        else:
            budget = f"{tune.max_steps or self.base.train.max_steps} steps"
        subset = f" on {tune.train_samples} samples" if tune.train_samples else ""
        pruner = (
            "none"
            if tune.pruner == "none"
            else f"median (after {tune.n_startup_trials} completed trials, from "
            f"{self.plan.unit} {tune.n_warmup_steps})"
        )
        lines = [
            f"vltrain tune: study '{self.name}' in {self.storage_spec.display}",
            f"  objective: {self.direction} {self.metric}; {tune.trials} trials of {budget}"
            f"{subset}; pruner: {pruner}",
            *(f"  {s.key}: {s.describe()}" for s in self.specs),
            f"  checked {self.n_checked} corner configs of the space; "
            f"{self._finished()} trials already finished",
            f"  trial run dirs: {self.study_dir}/trial_NNNN; resume with --study {self.name}",
        ]
        if self.dead:
            lines.append(f"  marked failed (their worker died): trials {self.dead}")
        print("\n".join(lines), flush=True)


def _processes(n: int) -> str:
    return f"{n} process" + ("es" if n != 1 else "")


def _launch(n: int) -> str:
    """How to start a search on `n` processes again."""
    if n == 1:
        return "on 1 process (without torchrun)"
    return f"on {n} processes (e.g. torchrun --nproc_per_node={n} on one machine)"


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def run_search(
    config_path: str,
    overrides: list[str] | None = None,
    trials: int | None = None,
    storage: str | None = None,
    study: str | None = None,
) -> dict[str, Any]:
    """Run `vltrain tune`; returns the results summary on rank 0 ({} on other ranks)."""
    try:
        result = Search(config_path, overrides, trials, storage, study).run()
    except BaseException:
        distributed.shutdown()
        raise
    distributed.shutdown(finished=True)
    return result
