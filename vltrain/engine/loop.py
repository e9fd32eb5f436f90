"""The one training loop. Stages plug in a task object; nothing else copies this loop."""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from vltrain.config.schema import Config, dump_config
from vltrain.core import checkpoint, distributed
from vltrain.core.async_checkpoint import AsyncWriter
from vltrain.core.files import atomic_write_text
from vltrain.data.batches import to_device
from vltrain.data.loaders import Batch
from vltrain.data.records import BadSampleTracker
from vltrain.diagnostics.doctor import Doctor
from vltrain.diagnostics.record import StepRecord, severity_rank
from vltrain.engine import run_dir
from vltrain.engine import state as trainer_state
from vltrain.engine.logging import RunLogger
from vltrain.engine.optim import build_optimizer, build_scaler, set_lr
from vltrain.engine.parallel import ParallelModel, build_parallel, options_from
from vltrain.engine.runtime import eval_mode, setup
from vltrain.engine.state import RngState, TrainState
from vltrain.engine.stops import TrainingAborted, TrainingStopped
from vltrain.engine.task import Stage, check_stage


def _say_findings(logger: RunLogger, found: list) -> None:
    """The doctor's findings above info on the console; info ones (minor grad blips, a dozen
    per short run) stay in doctor.jsonl and the report, where they do not bury the warnings."""
    for f in found:
        if severity_rank(f.severity) > severity_rank("info"):
            logger.message(f"doctor: {f.line()}")


def _vote(
    batches: list[Batch], tracker: BadSampleTracker, stop: int, save: int
) -> tuple[int, int, int]:
    """Reduce this step's bad-sample counts, stop and checkpoint requests over ranks (one
    all-reduce), so every rank decides alike.

    Returns how many micro-batches, over all ranks, hold no valid sample at all (every rank
    then skips the step together), how many ranks received SIGTERM/SIGINT (then every rank
    stops at this boundary) and how many received a `train.checkpoint_on` signal (then every
    rank saves after this step and goes on).
    """
    bad = [pair for b in batches for pair in b.bad]
    vec = BadSampleTracker.step_vector(sum(b.n_seen for b in batches), bad)
    vec += [sum(1 for b in batches if b.n_good == 0), int(stop != 0), int(save != 0)]
    total = distributed.all_reduce_sum(torch.tensor(vec, dtype=torch.int64)).tolist()
    tracker.merge_counts(total[:-3], examples=bad)
    tracker.check()
    return int(total[-3]), int(total[-2]), int(total[-1])


def _is_better(value: float, best: float | None, mode: str) -> bool:
    if best is None or not math.isfinite(best):
        return math.isfinite(value)
    return value > best if mode == "max" else value < best


class Trainer:
    """Drives a stage: the loop, evaluation, checkpoints and resume.

    ``Trainer(cfg, stage=StageClass).run()`` trains any object that implements
    :class:`vltrain.engine.task.Stage` (``vltrain.runs.train(cfg)`` picks the built-in stage
    that ``cfg.stage`` names, and resolves budgets).
    """

    def __init__(
        self,
        cfg: Config,
        stage: type[Stage],
        on_eval: Callable[[int, dict], None] | None = None,
        budget: Callable[[Config, int], Config] | None = None,
    ) -> None:
        """`on_eval(step, metrics)` runs on every rank after each evaluation; it may raise to
        stop training (e.g. a pruned hyperparameter trial), identically on all ranks.
        `budget(cfg, world_size)` turns a budget (``train.max_samples`` / ``train.max_flops``)
        into ``train.max_steps`` (`vltrain.scaling.budget.resolve_budget`), once, before the
        run folder is planned, so the schedule ends at the budget."""
        self.best_metric, self.best_mode = check_stage(cfg, stage)  # before any compute
        if budget is not None:  # torchrun's world size, before the process group exists
            cfg = budget(cfg, distributed.launched_world_size())
        self.cfg = cfg
        # train.epochs: the budget hook derived max_steps as whole steps per epoch x epochs
        self.steps_per_epoch = cfg.train.max_steps // max(cfg.train.epochs, 1)
        self.on_eval = on_eval
        self.ctx = setup(cfg)
        self.out_dir = Path(cfg.run.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self.plan = run_dir.plan_run(cfg, self.ctx.world_size)  # every rank; nothing written yet
        # every rank has read the run folder before rank 0 changes it: a rank that read
        # config.yaml after rank 0 rewrote it saw the new batch size and refused a resume
        distributed.barrier()
        if self.ctx.is_main:
            run_dir.apply_plan(self.plan)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if not self.plan.changed:  # else once the checkpoint is known to fit (run)
                dump_config(cfg, self.out_dir / "config.yaml")
            if self.plan.fresh or "data.train" in cfg.train.allow_changes:
                run_dir.record_data_version(cfg, self.out_dir)
        distributed.barrier()
        self._started = False  # the first step began: a later error leaves the folder as is
        try:
            self.stage: Stage = stage(cfg, self.out_dir, self.ctx)
        except Exception:
            self._undo_fresh()
            raise
        self._signal, self._saved_step = 0, -1  # a stop request; the step last checkpointed
        self.writer: AsyncWriter | None = None  # train.async_save: the background writer
        self._save_signal, self._save_requested = 0, ""  # train.checkpoint_on

    def _undo_fresh(self) -> None:
        """A new run refused before its first step leaves its folder as it found it."""
        if self.ctx.is_main and not self._started:
            run_dir.undo_fresh(self.plan)

    def run(self) -> dict[str, Any]:
        """Train to `train.max_steps` (resuming if asked); return the final summary."""
        try:
            return self._run()
        except Exception:
            self._undo_fresh()
            raise
        finally:
            if self.ctx.is_main:
                run_dir.release_lock(self.out_dir)

    def _run(self) -> dict[str, Any]:
        cfg, ctx, stage, plan = self.cfg, self.ctx, self.stage, self.plan
        if plan.finished:
            summary = json.loads((self.out_dir / "summary.json").read_text())
            summary.setdefault("step", summary["steps"])  # written before "step" existed
            if ctx.is_main:
                done = summary["steps"]
                print(f"vltrain: {self.out_dir} already finished its {done} steps; nothing to do")
            return summary
        stage.prepare()
        module = stage.build_model().to(ctx.device)
        if plan.changed:  # train.allow_changes: the checkpoint must fit the changed model
            run_dir.check_changed_model(module, plan)
            if ctx.is_main:
                dump_config(cfg, self.out_dir / "config.yaml")
        options = options_from(cfg.train, cfg.run.precision)
        self.model = model = build_parallel(module, cfg.train.parallel, ctx.world_size, options)
        self.optimizer = build_optimizer(module, cfg.optim)  # after sharding: FSDP's params
        self.scaler = build_scaler(cfg.run.precision, ctx.device, model.mode == "fsdp")
        self.tracker = BadSampleTracker(cfg.data.max_bad_fraction)
        self.state = TrainState()
        self.loader = stage.build_loader()
        ckpt = plan.resume_from
        if ckpt is not None:
            model.load_checkpoint(ckpt, self.optimizer)
            trainer_state.restore(self._stateful(), checkpoint.load_trainer_state(ckpt))
        self.doctor = None
        if cfg.doctor.enabled:  # its probe watches the plain module and the optimizer
            self.doctor = Doctor.for_training(
                cfg,
                self.out_dir,
                ctx.is_main,
                module,
                self.optimizer,
                distributed.all_gather_object,
                start_step=self.state.step if ckpt is not None else 0,
            )
        self._started = True
        logger = RunLogger(cfg, self.out_dir, ctx.is_main, self.state.step)
        if self.doctor is not None:  # what it found before the first step (frozen parts, ...)
            _say_findings(logger, self.doctor.findings)
        if ckpt is not None:
            for line in plan.messages:
                logger.message(line)
            if ctx.is_main:
                fixed = checkpoint.repair_best(
                    self.ckpt_root, self.best_metric, self.state.best_value
                )
                if fixed:
                    logger.message(fixed)
            distributed.barrier()
            logger.message(f"resumed from {ckpt} at step {self.state.step}")
        t_start = time.time()
        # the optimizer step waits for a save's copy of the weights (taken in the background)
        self.writer = AsyncWriter(self.optimizer) if cfg.train.async_save else None
        try:
            try:
                with self._stop_on_signals():
                    self._loop(model, logger)
            finally:  # the save in flight completes before the run ends, stops or fails
                if self.writer is not None:
                    self.writer.wait()
            if self.writer is not None:
                distributed.barrier()  # every rank reads the last checkpoint (best) complete
            if self.doctor is not None:
                self.doctor.finish()
            summary = self._finish(model, logger, t_start)
            logger.finished = True
        finally:
            logger.close()
            if self.doctor is not None:
                self.doctor.close()
        return summary

    def _stateful(self) -> dict[str, trainer_state.Stateful]:
        """Every part a checkpoint saves and a resume restores, in restore order (RNG last)."""
        parts: dict[str, trainer_state.Stateful] = {
            "loop": self.state,
            "optimizer": self.model.optimizer_part(self.optimizer),
            "loader": self.loader,
            "stage": self.stage,
            "bad_samples": self.tracker,
        }
        if self.scaler is not None:  # fp16: the loss scale and its growth tracker
            parts["scaler"] = self.scaler
        return {**parts, "rng": RngState()}

    def _loop(self, model: ParallelModel, logger: RunLogger) -> None:
        batches = iter(self.loader)
        try:
            self._steps(batches, model, logger)
        finally:  # shut the DataLoader workers down now (they ignore the stop signals)
            close = getattr(batches, "close", None)
            if close is not None:
                close()

    def _steps(self, batches: Iterator[Batch], model: ParallelModel, logger: RunLogger) -> None:
        cfg, state = self.cfg, self.state
        window = {"t": time.time(), "samples": 0}
        model.train()
        while state.step < cfg.train.max_steps:
            t_step = time.time()
            position = self.loader.state_dict()  # before this step's batches
            micro = [next(batches) for _ in range(cfg.optim.accum_steps)]
            save_signal, self._save_signal = self._save_signal, 0
            n_empty, n_stop, n_save = _vote(micro, self.tracker, self._signal, save_signal)
            if n_stop:  # every rank stops here, before the step: save, then say so
                self.loader.load_state_dict(position)
                self._stop(model, logger)
            if n_save:  # every rank saves after this step (a clean boundary), then goes on
                self._save_requested = (
                    f"{signal.Signals(save_signal).name} received"
                    if save_signal
                    else "another rank got a checkpoint signal"
                )
            if n_empty:  # a rank has nothing to forward: every rank skips (no DDP hang)
                loss, metrics, grad_norm, finite = torch.tensor(float("nan")), {}, None, False
                overflow = False
            else:
                loss, metrics, grad_norm, finite, overflow = self._forward_backward(model, micro)
            lr = set_lr(self.optimizer, state.step, cfg.train.max_steps, cfg.optim)
            self._apply_step(n_empty, finite, overflow, loss, grad_norm, logger)
            if not n_empty:  # a step skipped for want of samples trained nothing to judge
                self._doctor_step(
                    micro, loss, grad_norm, lr, finite, t_step, logger, metrics, overflow
                )
            self.optimizer.zero_grad(set_to_none=True)
            state.step += 1
            window["samples"] += sum(b.n_good for b in micro) * self.ctx.world_size
            if grad_norm is None:
                grad_norm = torch.tensor(float("nan"))
            self._log_step(logger, loss, metrics, lr, grad_norm, window)
            self._maybe_eval_and_save(model, logger)

    def _stop(self, model: ParallelModel, logger: RunLogger) -> None:
        """Checkpoint at this step boundary and raise TrainingStopped (every rank alike)."""
        step = self.state.step
        if self._saved_step != step:  # the same answer on every rank (no file-system read)
            self._save(model, improved=False)
        sig = self._signal or signal.SIGTERM
        what = (
            f"{signal.Signals(sig).name} received" if self._signal else "another rank got a signal"
        )
        raise TrainingStopped(
            f"{what}: stopped at step {step} of {self.cfg.train.max_steps} and saved "
            f"{self.ckpt_root / f'step_{step}'}; continue with `vltrain train "
            f"{self.out_dir / 'config.yaml'} train.resume=true`",
            sig,
        )

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT only set a flag: the loop stops at the next step boundary. The
        `train.checkpoint_on` signals set another: a checkpoint after the next step, then on.
        (DataLoader workers ignore all of them: `vltrain.data.loaders.worker_init`.)"""
        self._signal, self._saved_step, self._save_signal = 0, -1, 0
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return

        def handler(signum: int, frame: Any) -> None:
            self._signal = signum

        def save_handler(signum: int, frame: Any) -> None:
            self._save_signal = signum

        old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
        for name in self.cfg.train.checkpoint_on:
            sig = signal.Signals[name]
            old[sig] = signal.signal(sig, save_handler)
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def _forward_backward(
        self, model: ParallelModel, micro: list[Batch]
    ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor, bool, bool]:
        """Accumulate the micro-batches' gradients, clip; (loss, metrics, grad norm, finite?,
        overflow?). Overflow (fp16): every rank's loss is finite but a gradient is not, the
        loss scaler's skip; both verdicts are global (one all-reduce)."""
        ctx, accum = self.ctx, len(micro)
        loss_sum, metrics = torch.zeros((), dtype=torch.float64), {}
        # fp16: backpropagate loss x the loss scale (what GradScaler.scale does), unscale after
        one = torch.ones((), device=ctx.device)
        scale = 1.0 if self.scaler is None else float(self.scaler.scale(one))  # lazy-inits it
        for i, batch in enumerate(micro):
            with model.micro_step(sync=i == accum - 1), ctx.autocast():
                out = self.stage.forward_backward(
                    model, to_device(batch.data, ctx.device), scale / accum
                )
            loss_sum += out.loss.double().cpu() / accum
            for k, v in out.metrics.items():
                metrics[k] = metrics.get(k, 0.0) + float(v) / accum
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # inf/nan where the scaled gradients overflowed
        grad_norm = model.clip_grad_norm_(self.cfg.optim.grad_clip or float("inf"))
        bad = torch.stack([~torch.isfinite(loss_sum), ~torch.isfinite(grad_norm.double().cpu())])
        bad_loss, bad_grad = (distributed.all_reduce_max(bad.double()) > 0).tolist()
        finite = not (bad_loss or bad_grad)
        overflow = self.scaler is not None and bad_grad and not bad_loss
        return loss_sum, metrics, grad_norm, finite, overflow

    def _apply_step(self, n_empty: int, finite: bool, overflow: bool, loss, grad_norm, logger):
        """Take the optimizer step, or skip it (all ranks alike) and say why. fp16: a finite
        loss with overflowing gradients is the loss scaler's skip (its scale halves), counted
        apart from the non-finite steps."""
        state, scaler = self.state, self.scaler
        if n_empty:
            state.skipped_steps += 1
            logger.message(
                f"step {state.step}: {n_empty} micro-batch(es) held no valid sample "
                "(all bad), step skipped on every rank"
            )
            return
        if scaler is not None:
            if finite:
                scaler.step(self.optimizer)  # gradients already unscaled: a plain step
            scaler.update()  # halves the scale after an overflow, grows it after a clean run
        if overflow:
            state.scaler_skips += 1
            logger.message(
                f"step {state.step}: fp16 gradient overflow, step skipped by the loss scaler "
                f"(scale now {scaler.get_scale():.4g})"
            )
        elif not finite:
            state.skipped_steps += 1
            state.consecutive_skips += 1
            logger.message(f"step {state.step}: non-finite loss/grad, step skipped")
            if state.consecutive_skips >= self.cfg.train.max_consecutive_skips:
                raise TrainingAborted(
                    f"{state.consecutive_skips} consecutive steps had a non-finite loss or "
                    f"gradient (last loss {float(loss):.4g}, grad norm "
                    f"{float(grad_norm):.4g}); lower optim.lr, enable optim.grad_clip, or "
                    "check the data; raise train.max_consecutive_skips to tolerate more"
                )
        else:
            if scaler is None:
                self.optimizer.step()
            state.consecutive_skips = 0

    def _doctor_step(
        self, micro, loss, grad_norm, lr, finite, t_step, logger, metrics, overflow
    ) -> None:
        """One StepRecord to the doctor (before zero_grad: gradients are still there for
        non-finite provenance); its warnings and errors go to the console, its finding counts
        to metrics.jsonl."""
        if self.doctor is None:
            return
        keys = [k for b in micro for k in b.keys]
        rec = StepRecord(
            step=self.state.step,
            loss=float(loss),
            grad_norm=float("nan") if grad_norm is None else float(grad_norm),
            lr=lr,
            finite=finite,
            time_s=time.time() - t_step,
            sample_ids=[i for _, i in keys],
            epoch=keys[0][0] if keys else -1,
            # per sample only when the step's micro-batches straddle an epoch boundary
            sample_epochs=[e for e, _ in keys] if len({e for e, _ in keys}) > 1 else [],
            lengths=[n for b in micro for n in b.lengths],
            bucket=micro[0].bucket if micro else None,
            chance_loss=metrics.get("chance_loss"),  # a contrastive loss's no-information level
            scaler_skip=overflow,
        )
        found = self.doctor.observe(rec)  # gathers over ranks inside: every rank calls it
        _say_findings(logger, found)
        if found:
            worst = max(severity_rank(f.severity) for f in found)
            logger.log(self.state.step + 1, {"doctor_findings": len(found), "doctor_worst": worst})

    def _log_step(self, logger, loss_sum, metrics, lr, grad_norm, window) -> None:
        cfg, state, tracker = self.cfg, self.state, self.tracker
        now = time.time()
        sps = window["samples"] / max(now - window["t"], 1e-9)
        logger.progress(state.step, float(loss_sum), lr, sps)
        if state.step % cfg.train.log_every and state.step != cfg.train.max_steps:
            return
        row = {
            "loss": float(loss_sum),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "samples_per_s": sps,
            "skipped_steps": state.skipped_steps,
            "bad_samples": tracker.total_bad,
            **{f"train_{k}": v for k, v in metrics.items()},
            **{f"bad_{k}": v for k, v in tracker.counts().items() if v},
        }
        if cfg.train.epochs:  # epochs done, fractional: the schedule is whole steps per epoch
            row["epoch"] = state.step / self.steps_per_epoch
        if self.scaler is not None:
            row.update(scaler_skips=state.scaler_skips, loss_scale=self.scaler.get_scale())
        logger.log(state.step, row)
        window["t"], window["samples"] = now, 0

    def _maybe_eval_and_save(self, model: ParallelModel, logger: RunLogger) -> None:
        cfg, state = self.cfg, self.state
        last = state.step == cfg.train.max_steps
        do_eval = bool(cfg.data.eval) and (
            last or (cfg.train.eval_every and state.step % cfg.train.eval_every == 0)
        )
        do_save = last or (cfg.train.save_every and state.step % cfg.train.save_every == 0)
        epoch_end = bool(cfg.train.epochs) and state.step % self.steps_per_epoch == 0
        do_save = do_save or (cfg.train.save_every_epoch and epoch_end)
        requested, self._save_requested = self._save_requested, ""
        improved = False
        if do_eval:
            try:
                metrics = {f"eval_{k}": v for k, v in self.evaluate(model, "val").items()}
            except Exception:
                self._save(model, improved=False)  # a failing evaluation never loses the weights
                raise
            logger.log(state.step, metrics)
            state.history.append({"step": state.step, **metrics})
            if self.on_eval is not None:
                self.on_eval(state.step, metrics)
            value = metrics.get(self.best_metric)
            if value is None:  # eval_metrics() promised it: a stage bug, not a user mistake
                raise TrainingAborted(
                    f"stage '{cfg.stage}' declared '{self.best_metric}' among its metrics but "
                    f"its evaluation returned only {sorted(metrics)}"
                )
            improved = _is_better(value, state.best_value, self.best_mode)
            if improved:
                state.best_value, state.best_step = value, state.step
        if do_save or improved or requested:
            self._save(model, improved)
        if requested:
            logger.message(
                f"{requested}: saved {self.ckpt_root / f'step_{state.step}'} at step "
                f"{state.step} of {cfg.train.max_steps}; training continues"
            )

    def _save(self, model: ParallelModel, improved: bool) -> None:
        """Every rank takes part (a sharded mode gathers here); rank 0 writes. Under
        train.async_save the write (then best and pruning) runs in the writer's thread."""
        self._saved_step = self.state.step
        ts = trainer_state.collect(self._stateful(), world_size=self.ctx.world_size)
        best = (self.best_metric, self.state.best_value, self.state.step) if improved else None
        root, keep = self.ckpt_root, self.cfg.train.keep_last

        def done(path: Path) -> None:  # rank 0, once `path` is complete
            if best is not None:
                checkpoint.update_best(root, path, *best)
            checkpoint.prune(root, keep)

        model.save_checkpoint(
            root, self.state.step, self.optimizer, ts, self.stage.checkpoint_files(),
            self.stage.export, done, self.writer,
        )  # fmt: skip
        distributed.barrier()

    def evaluate(self, model: ParallelModel | torch.nn.Module, split: str) -> dict[str, float]:
        """Run the stage's (sharded) evaluation with training RNG untouched (`model`: the
        wrapped model, or a plain module)."""
        plain = not isinstance(model, ParallelModel)
        modules = contextlib.nullcontext(model) if plain else model.evaluating()
        with modules as module, eval_mode(module), self.ctx.autocast():
            return self.stage.evaluate(module, split)

    def _finish(self, model: ParallelModel, logger: RunLogger, t_start: float) -> dict[str, Any]:
        state = self.state
        summary: dict[str, Any] = {
            "out_dir": str(self.out_dir),
            "step": state.step,  # the final optimizer step
            "steps": state.step,  # the same number, under the name older readers use
            "skipped_steps": state.skipped_steps,
            **({"scaler_skips": state.scaler_skips} if self.scaler is not None else {}),
            "bad_samples": self.tracker.counts(),
            "best_metric": self.best_metric,
            "best_value": state.best_value,
            "best_step": state.best_step,
            "train_seconds": round(time.time() - t_start, 1),
        }
        if state.history:
            summary["val"] = state.history[-1]
        if self.cfg.data.test:
            best = self.ckpt_root / "best"
            if checkpoint.has_weights(best):
                checkpoint.load_weights(model.module, best)
            summary["test"] = self.evaluate(model, "test")
            logger.log(state.step, {f"test_{k}": v for k, v in summary["test"].items()})
        if self.ctx.is_main:
            atomic_write_text(self.out_dir / "summary.json", json.dumps(summary, indent=2))
            logger.message(format_summary(summary))
        return summary


def format_summary(summary: dict[str, Any]) -> str:
    """A short human summary of a finished run."""
    lines = [
        f"run finished: {summary['out_dir']}  ({summary['steps']} steps, "
        f"{summary['train_seconds']} s)"
    ]
    if summary.get("best_value") is not None:
        lines.append(
            f"  best {summary['best_metric']} = {summary['best_value']:.4f} "
            f"at step {summary['best_step']}"
        )
    bad = {k: v for k, v in summary.get("bad_samples", {}).items() if v}
    scaler = f"; fp16 scaler skips: {summary['scaler_skips']}" if "scaler_skips" in summary else ""
    lines.append(
        f"  skipped steps: {summary['skipped_steps']}{scaler}; bad samples: {bad or 'none'}"
    )
    return "\n".join(lines)
