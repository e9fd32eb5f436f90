"""The one training loop. Stages plug in a task object; nothing else copies this loop."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from vltrain.config.schema import Config, dump_config
from vltrain.data.records import BadSampleTracker, split_bad
from vltrain.engine import checkpoint as C
from vltrain.engine import distributed as D
from vltrain.engine.logging import RunLogger
from vltrain.engine.optim import build_optimizer, set_lr
from vltrain.engine.runtime import eval_mode, setup, to_device, worker_init
from vltrain.stages.base import BatchSampler, Stage, get_stage


class TrainingAborted(RuntimeError):
    """Training stopped on purpose (non-finite steps, bad data); the message says why."""


@dataclass
class LoopState:
    """Everything besides weights and optimizer that a resumed run needs."""

    step: int = 0
    position: tuple[int, int] = (0, 0)
    skipped_steps: int = 0
    consecutive_skips: int = 0
    best_value: float | None = None
    best_step: int = -1
    history: list[dict] = field(default_factory=list)


class _Collate:
    """Picklable collate: drops bad samples (counted by the engine), then the stage collates."""

    def __init__(self, stage_collate: Any) -> None:
        self.stage_collate = stage_collate

    def __call__(self, samples: list[dict]) -> dict[str, Any]:
        good, bad = split_bad(samples)
        batch = self.stage_collate(good) if good else {}
        batch["_n_seen"] = len(samples)
        batch["_bad"] = bad
        batch["_last_key"] = tuple(samples[-1]["key"])
        batch["_n_good"] = len(good)
        return batch


def _loader(
    stage: Stage, cfg: Config, start: tuple[int, int], device: torch.device
) -> tuple[BatchSampler, Iterator[dict]]:
    dataset = stage.train_dataset()
    sampler = stage.train_sampler(dataset, start)
    # A private generator keeps DataLoader seeding off the global RNG, so creating the
    # iterator at a different moment (resume) leaves the dropout RNG stream untouched.
    gen = torch.Generator().manual_seed(cfg.run.seed)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=_Collate(stage.collate),
        num_workers=cfg.data.num_workers,
        worker_init_fn=worker_init,
        generator=gen,
        persistent_workers=cfg.data.num_workers > 0,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if cfg.data.num_workers > 0 else None,
    )
    return sampler, iter(loader)


def _trainer_state(
    state: LoopState,
    optimizer: torch.optim.Optimizer,
    stage: Stage,
    tracker: BadSampleTracker,
    world: int,
) -> dict[str, Any]:
    return {
        "step": state.step,
        "epoch": state.position[0],
        "batch_in_epoch": state.position[1],
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "best_value": state.best_value,
        "best_step": state.best_step,
        "optimizer": optimizer.state_dict(),
        "rng": C.rng_state(),
        "stage": stage.state_dict(),
        "bad_samples": tracker.state_dict(),
        "world_size": world,
    }


def _restore(
    ckpt: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stage: Stage,
    tracker: BadSampleTracker,
) -> LoopState:
    C.load_weights(model, ckpt)
    ts = C.load_trainer_state(ckpt)
    optimizer.load_state_dict(ts["optimizer"])
    stage.load_state_dict(ts["stage"])
    tracker.load_state_dict(ts["bad_samples"])
    C.set_rng_state(ts["rng"])
    return LoopState(
        step=ts["step"],
        position=(ts["epoch"], ts["batch_in_epoch"]),
        skipped_steps=ts["skipped_steps"],
        consecutive_skips=ts["consecutive_skips"],
        best_value=ts["best_value"],
        best_step=ts["best_step"],
    )


def _count_bad(batches: list[dict], tracker: BadSampleTracker) -> int:
    """Reduce this step's bad-sample counts over ranks so every rank decides alike.

    Returns how many micro-batches, over all ranks, hold no valid sample at all (one
    all-reduce carries both, so every rank skips such a step together).
    """
    bad = [pair for b in batches for pair in b["_bad"]]
    vec = BadSampleTracker.step_vector(sum(b["_n_seen"] for b in batches), bad)
    vec.append(sum(1 for b in batches if b["_n_good"] == 0))
    total = D.all_reduce_sum(torch.tensor(vec, dtype=torch.int64)).tolist()
    tracker.merge_counts(total[:-1], examples=bad)
    tracker.check()
    return int(total[-1])


def _is_better(value: float, best: float | None, mode: str) -> bool:
    if best is None or not math.isfinite(best):
        return math.isfinite(value)
    return value > best if mode == "max" else value < best


class Trainer:
    """Drives a stage: the loop, evaluation, checkpoints and resume."""

    def __init__(self, cfg: Config, on_eval: Callable[[int, dict], None] | None = None) -> None:
        """`on_eval(step, metrics)` runs on every rank after each evaluation; it may raise to
        stop training (e.g. a pruned hyperparameter trial), identically on all ranks."""
        self.cfg = cfg
        self.on_eval = on_eval
        self.ctx = setup(cfg)
        self.out_dir = Path(cfg.run.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        if self.ctx.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            dump_config(cfg, self.out_dir / "config.yaml")
        D.barrier()
        self.stage = get_stage(cfg.stage)(cfg, self.out_dir, self.ctx)
        self.best_metric = cfg.train.best_metric or self.stage.best_metric
        self.best_mode = cfg.train.best_mode or self.stage.best_mode

    def run(self) -> dict[str, Any]:
        """Train to `train.max_steps` (resuming if asked); return the final summary."""
        cfg, ctx, stage = self.cfg, self.ctx, self.stage
        stage.prepare()
        model = stage.build_model().to(ctx.device)
        optimizer = build_optimizer(model, cfg.optim)
        tracker = BadSampleTracker(cfg.data.max_bad_fraction)
        state = LoopState()
        ckpt = C.latest_checkpoint(self.ckpt_root) if cfg.train.resume else None
        if ckpt is not None:
            state = _restore(ckpt, model, optimizer, stage, tracker)
        elif self.ctx.is_main and C.latest_checkpoint(self.ckpt_root) is not None:
            print(
                f"vltrain: {self.ckpt_root} already holds checkpoints; starting over "
                "(set train.resume=true to continue)"
            )
        ddp = DDP(model) if ctx.world_size > 1 else None
        logger = RunLogger(cfg, self.out_dir, ctx.is_main, state.step)
        if ckpt is not None:
            logger.message(f"resumed from {ckpt} at step {state.step}")
        t_start = time.time()
        try:
            self._loop(model, ddp, optimizer, tracker, state, logger)
            summary = self._finish(model, optimizer, tracker, state, logger, t_start)
        finally:
            logger.close()
        return summary

    def _loop(self, model, ddp, optimizer, tracker, state: LoopState, logger: RunLogger) -> None:
        cfg, ctx, stage = self.cfg, self.ctx, self.stage
        sampler, batches = _loader(stage, cfg, state.position, ctx.device)
        accum = cfg.optim.accum_steps
        window = {"t": time.time(), "samples": 0}
        model.train()
        while state.step < cfg.train.max_steps:
            micro = [next(batches) for _ in range(accum)]
            n_empty = _count_bad(micro, tracker)
            loss_sum, metrics = torch.zeros((), dtype=torch.float64), {}
            grad_norm, bad_anywhere = torch.full((), float("nan")), False
            if n_empty:  # a rank has nothing to forward: every rank skips (no DDP hang)
                loss_sum.fill_(float("nan"))
            else:
                for i, batch in enumerate(micro):
                    sync = ddp is None or i == accum - 1
                    with contextlib.nullcontext() if sync else ddp.no_sync():
                        b = to_device(batch, ctx.device)
                        with ctx.autocast():
                            loss, m = stage.backward(ddp or model, b, 1.0 / accum)
                    loss_sum += loss.double().cpu() / accum
                    for k, v in m.items():
                        metrics[k] = metrics.get(k, 0.0) + float(v) / accum
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), cfg.optim.grad_clip or float("inf")
                )
                bad = (~torch.isfinite(loss_sum)) | (~torch.isfinite(grad_norm.double().cpu()))
                bad_anywhere = bool(D.all_reduce_max(bad.double()).item() > 0)
            lr = set_lr(optimizer, state.step, cfg.train.max_steps, cfg.optim)
            if n_empty:
                state.skipped_steps += 1
                logger.message(
                    f"step {state.step}: {n_empty} micro-batch(es) held no valid sample "
                    "(all bad), step skipped on every rank"
                )
            elif bad_anywhere:
                state.skipped_steps += 1
                state.consecutive_skips += 1
                logger.message(f"step {state.step}: non-finite loss/grad, step skipped")
                if state.consecutive_skips >= cfg.train.max_consecutive_skips:
                    raise TrainingAborted(
                        f"{state.consecutive_skips} consecutive steps had a non-finite loss or "
                        f"gradient (last loss {float(loss_sum):.4g}, grad norm "
                        f"{float(grad_norm):.4g}); lower optim.lr, enable optim.grad_clip, or "
                        "check the data; raise train.max_consecutive_skips to tolerate more"
                    )
            else:
                optimizer.step()
                state.consecutive_skips = 0
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.position = sampler.position_after(micro[-1]["_last_key"])
            window["samples"] += sum(b["_n_good"] for b in micro) * ctx.world_size
            self._log_step(state, logger, loss_sum, metrics, lr, grad_norm, tracker, window)
            self._maybe_eval_and_save(model, optimizer, tracker, state, logger)

    def _log_step(self, state, logger, loss_sum, metrics, lr, grad_norm, tracker, window) -> None:
        cfg = self.cfg
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
        logger.log(state.step, row)
        window["t"], window["samples"] = now, 0

    def _maybe_eval_and_save(self, model, optimizer, tracker, state, logger) -> None:
        cfg = self.cfg
        last = state.step == cfg.train.max_steps
        do_eval = bool(cfg.data.eval) and (
            last or (cfg.train.eval_every and state.step % cfg.train.eval_every == 0)
        )
        do_save = last or (cfg.train.save_every and state.step % cfg.train.save_every == 0)
        improved = False
        if do_eval:
            metrics = {f"eval_{k}": v for k, v in self.evaluate(model, "val").items()}
            logger.log(state.step, metrics)
            state.history.append({"step": state.step, **metrics})
            if self.on_eval is not None:
                self.on_eval(state.step, metrics)
            value = metrics.get(self.best_metric)
            if value is None:
                raise KeyError(
                    f"train.best_metric '{self.best_metric}' is not among the eval "
                    f"metrics {sorted(metrics)}"
                )
            improved = _is_better(value, state.best_value, self.best_mode)
            if improved:
                state.best_value, state.best_step = value, state.step
        if do_save or improved:
            self._save(model, optimizer, tracker, state, improved)

    def _save(self, model, optimizer, tracker, state: LoopState, improved: bool) -> None:
        if self.ctx.is_main:
            ts = _trainer_state(state, optimizer, self.stage, tracker, self.ctx.world_size)
            path = C.write_checkpoint(
                self.ckpt_root,
                state.step,
                model,
                ts,
                self.stage.checkpoint_files(),
                writer=lambda folder: self.stage.export(model, folder),
            )
            if improved:
                C.update_best(self.ckpt_root, path, self.best_metric, state.best_value, state.step)
            C.prune(self.ckpt_root, self.cfg.train.keep_last)
        D.barrier()

    def evaluate(self, model: torch.nn.Module, split: str) -> dict[str, float]:
        """Run the stage's (sharded) evaluation with training RNG untouched."""
        with eval_mode(model), self.ctx.autocast():
            return self.stage.evaluate(model, split)

    def _finish(self, model, optimizer, tracker, state, logger, t_start) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "out_dir": str(self.out_dir),
            "steps": state.step,
            "skipped_steps": state.skipped_steps,
            "bad_samples": tracker.counts(),
            "best_metric": self.best_metric,
            "best_value": state.best_value,
            "best_step": state.best_step,
            "train_seconds": round(time.time() - t_start, 1),
        }
        if state.history:
            summary["val"] = state.history[-1]
        if self.cfg.data.test:
            best = self.ckpt_root / "best"
            if (best / "model.safetensors").is_file():
                C.load_weights(model, best)
            summary["test"] = self.evaluate(model, "test")
            logger.log(state.step, {f"test_{k}": v for k, v in summary["test"].items()})
        if self.ctx.is_main:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
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
    lines.append(f"  skipped steps: {summary['skipped_steps']}; bad samples: {bad or 'none'}")
    return "\n".join(lines)


def train(cfg: Config) -> dict[str, Any]:
    """Train a config end to end (single process or one rank of torchrun)."""
    return Trainer(cfg).run()
