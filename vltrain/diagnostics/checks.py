"""The doctor's checks: each reads StepRecords and returns Findings (the table CHECKS).

A check is a small object with ``observe(rec) -> list[Finding]`` and ``finish() ->
list[Finding]`` (end-of-run summaries). Checks see only what the record holds, so the same
code runs online (fed by the loop) and offline (`vltrain doctor RUN_DIR` replays
``doctor_steps.jsonl``). Every value a check compares across ranks was reduced by the loop
before it got here, so all ranks reach the same verdict.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from vltrain.config.schema import Config
from vltrain.diagnostics.record import Finding, StepRecord


class SpikeDetector:
    """Robust spike rule: `x` more than `sigma` MADs and `rise` x above the median of the last
    `window` non-spike values. Spikes do not enter the window, so a short plateau of spikes
    stays visible; once `min_history` steps in a row are spikes the level has changed (a
    reading loss that starts to learn raises the grad norm 30x over hundreds of steps), and
    they enter it, so the median follows the new level instead of freezing at the old one (a
    run of page retrieval reported 676 of 800 steps as spikes over a median of step 120)."""

    def __init__(self, window: int, sigma: float, rise: float, min_history: int) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.sigma, self.rise, self.min_history = sigma, rise, min_history
        self.in_a_row = 0  # spikes since the last value that was not one

    def update(self, x: float, judge: bool = True) -> dict[str, float] | None:
        if not math.isfinite(x):
            return None
        if judge and len(self.values) >= self.min_history:
            med = statistics.median(self.values)
            mad = statistics.median(abs(v - med) for v in self.values) * 1.4826
            scale = max(mad, 1e-3 * abs(med), 1e-12)
            z = (x - med) / scale
            if z > self.sigma and x > med * (1.0 + self.rise):
                self.in_a_row += 1
                if self.in_a_row >= self.min_history:  # a new level, not a spike: admit it
                    self.values.append(x)
                return {"value": x, "median": med, "z": round(z, 1)}
        self.in_a_row = 0
        self.values.append(x)
        return None


class Spikes:
    """Loss and grad-norm spikes; whether a grad spike preceded the loss spike; whether the
    spike came right after a checkpoint save."""

    name = "spikes"

    def __init__(self, cfg: Config) -> None:
        d = cfg.doctor
        self.loss = SpikeDetector(d.spike_window, d.spike_sigma, d.spike_rise, d.min_history)
        self.grad = SpikeDetector(d.spike_window, d.spike_sigma, d.spike_rise, d.min_history)
        self.save_every = cfg.train.save_every
        # LR warmup is not stationary (grad norms move by 10-100x as the LR ramps): its steps
        # neither get judged nor enter the history, so the first post-warmup steps are not
        # compared against a warmup median (which fired on a clean quickstart CLIP run)
        self.judge_from = cfg.optim.warmup_steps
        self.grad_warn = 1.0 + d.grad_spike_warn_rise
        self.clipped_warn = 1.0 + d.grad_spike_clipped_warn_rise
        self.clip = cfg.optim.grad_clip
        self.step_warn = 1.0 + d.grad_spike_step_rise if d.grad_spike_step_rise > 0 else 0.0
        self.prev_grad = math.nan  # the previous step's grad norm (warmup steps included)
        self.grad_spikes: list[int] = []
        self.after_save: list[int] = []

    def _after_save(self, step: int) -> bool:
        s = self.save_every
        return bool(s) and any(t >= 0 and (t + 1) % s == 0 for t in (step - 1, step - 2))

    def observe(self, rec: StepRecord) -> list[Finding]:
        prev, self.prev_grad = self.prev_grad, rec.grad_norm
        if rec.step < self.judge_from:
            return []
        out = []
        g = self.grad.update(rec.grad_norm)
        if g is not None:
            self.grad_spikes.append(rec.step)
            # grad norms are heavy-tailed at small batch: a tight MAD makes a 1.5-4x blip
            # "6 MADs" on clean runs; only a large rise is worth a warning by itself, and a
            # larger one where the clip capped the update (g["clipped"])
            ratio = g["value"] / g["median"] if g["median"] > 0 else math.inf
            g["clipped"] = 0 < self.clip < g["value"]
            # a level change (a run climbing out of a collapse) rises over a median of the
            # collapsed steps for many steps, by 1.4-2.7x a step; a spike jumps at once
            g["jump"] = g["value"] / prev if prev > 0 else math.inf
            severe = ratio >= (self.clipped_warn if g["clipped"] else self.grad_warn)
            severe = severe and g["jump"] >= self.step_warn
            out.append(
                Finding(
                    "warn" if severe else "info", "grad_spike", rec.step,
                    f"grad norm {g['value']:.4g} is {g['z']} MADs above the recent median "
                    f"{g['median']:.4g} ({ratio:.1f}x)",
                    "check the batch at this step (doctor_steps.jsonl sample_ids), lower "
                    "optim.lr or set optim.grad_clip",
                    g,
                )
            )  # fmt: skip
        spike = self.loss.update(rec.loss)
        if spike is not None:
            spike["preceded_by_grad_spike"] = any(
                rec.step - 3 <= s <= rec.step for s in self.grad_spikes
            )
            spike["after_checkpoint"] = self._after_save(rec.step)
            if spike["after_checkpoint"]:
                self.after_save.append(rec.step)
            why = " (grad norm spiked first)" if spike["preceded_by_grad_spike"] else ""
            out.append(
                Finding(
                    "warn", "loss_spike", rec.step,
                    f"loss {spike['value']:.4g} is {spike['z']} MADs above the recent median "
                    f"{spike['median']:.4g}{why}",
                    "look at the step's batch; lower optim.lr or raise optim.warmup_steps",
                    spike,
                )
            )  # fmt: skip
        return out

    def finish(self) -> list[Finding]:
        if len(self.after_save) < 2:
            return []
        return [
            Finding(
                "warn", "checkpoint_spike", self.after_save[0],
                f"{len(self.after_save)} loss spikes came right after checkpoint saves "
                f"(steps {self.after_save[:10]})",
                "a save must not change training: check that RNG/loader state is not consumed "
                "or reset by the save (resume from a checkpoint and compare losses)",
                {"steps": self.after_save},
            )
        ]  # fmt: skip


class NonFinite:
    """A non-finite loss or gradient, with the first parameter (module order) that went bad."""

    name = "nonfinite"

    def __init__(self, cfg: Config) -> None:
        self.count = 0

    def observe(self, rec: StepRecord) -> list[Finding]:
        if rec.finite or rec.scaler_skip:  # a loss scaler's skip is fp16 working (ScalerSkips)
            return []
        self.count += 1
        if self.count > 5:
            return []
        p = rec.nonfinite or {}
        where = f"first non-finite {p['kind']}: {p['first']}" if p.get("first") else "loss"
        return [
            Finding(
                "error", "nonfinite", rec.step,
                f"non-finite loss/gradient ({where}; {p.get('count', 0)} parameters affected)",
                "lower optim.lr, enable optim.grad_clip, use run.precision=fp32 to compare, "
                "and inspect the module named here",
                dict(p),
            )
        ]  # fmt: skip

    def finish(self) -> list[Finding]:
        return []


class DegenerateLoss:
    """Loss exactly 0, a bit-identical loss over different batches, or a zero gradient: a
    label mask that masks everything, a loss that does not depend on the model."""

    name = "degenerate_loss"

    def __init__(self, cfg: Config) -> None:
        self.patience = cfg.doctor.constant_steps
        self.history: deque[tuple[float, float]] = deque(maxlen=self.patience)
        self.reported: set[str] = set()

    def observe(self, rec: StepRecord) -> list[Finding]:
        if not rec.finite:
            return []
        self.history.append((rec.loss, rec.grad_norm))
        if len(self.history) < self.patience:
            return []
        losses = [x for x, _ in self.history]
        grads = [g for _, g in self.history]
        kind, msg = "", ""
        if all(x == 0.0 for x in losses):
            kind, msg = "zero", f"loss is exactly 0 for {self.patience} steps"
        elif len(set(losses)) == 1:
            kind, msg = (
                "constant",
                f"loss is bit-identical ({losses[0]:.6g}) for {self.patience} steps",
            )
        elif all(g == 0.0 for g in grads):
            kind, msg = "no_grad", f"gradient norm is exactly 0 for {self.patience} steps"
        if not kind or kind in self.reported:
            return []
        self.reported.add(kind)
        onset = rec.step - self.patience + 1
        return [
            Finding(
                "error", "degenerate_loss", onset, msg,
                "check the label mask against the tokenisation (labels all -100?) and that the "
                "loss depends on the model's output",
                {"kind": kind, "losses": losses, "grad_norms": grads},
            )
        ]  # fmt: skip

    def finish(self) -> list[Finding]:
        return []


class Optimizer:
    """Parameters left out of the optimizer or frozen unasked, gradients not zeroed, a step
    that changed nothing, the LR applied vs the configured schedule, update/weight ratios."""

    name = "optimizer"

    def __init__(self, cfg: Config) -> None:
        self.max_ratio = cfg.doctor.max_update_ratio
        # Adam's first steps move small weights by ~lr each: judge ratios after warmup + history
        self.ratio_from = cfg.optim.warmup_steps + cfg.doctor.min_history
        self.no_grad_streak: dict[str, int] = {}
        self.reported: set[str] = set()

    def _once(self, key: str, finding: Finding) -> list[Finding]:
        if key in self.reported:
            return []
        self.reported.add(key)
        return [finding]

    def observe(self, rec: StepRecord) -> list[Finding]:
        out: list[Finding] = []
        s = rec.step
        if rec.stale_grads:
            out += self._once("stale", Finding(
                "error", "grads_not_zeroed", s,
                f"gradients from the previous step were still there at this step's first "
                f"backward (e.g. {rec.stale_grads[0]})",
                "call optimizer.zero_grad() after every optimizer step (a stage must not skip it)",
                {"params": rec.stale_grads},
            ))  # fmt: skip
        for i, (applied, scale) in enumerate(zip(rec.lr_applied, rec.lr_scales, strict=True)):
            want = rec.lr * scale
            if not math.isclose(applied, want, rel_tol=1e-5, abs_tol=1e-12):
                out += self._once(f"lr{i}", Finding(
                    "error", "lr_mismatch", s,
                    f"param group {i} stepped with lr {applied:.4g}, the schedule says {want:.4g}",
                    "something overwrote the optimizer's LR (a second scheduler?): let "
                    "optim.schedule drive it",
                    {"group": i, "applied": applied, "configured": want},
                ))  # fmt: skip
        if rec.stepped and rec.update_ratio and all(r == 0.0 for r in rec.update_ratio):
            out += self._once("frozen_step", Finding(
                "error", "step_changed_nothing", s,
                "the optimizer step changed no sampled weight in any group",
                "check the LR actually applied (lr_applied in doctor_steps.jsonl) and that "
                "gradients reach the parameters",
                {"lr_applied": rec.lr_applied},
            ))  # fmt: skip
        for i, r in enumerate(rec.update_ratio if rec.step >= self.ratio_from else []):
            if r > self.max_ratio:
                out += self._once(f"ratio{i}", Finding(
                    "warn", "update_ratio", s,
                    f"param group {i}: update/weight ratio {r:.3g} > {self.max_ratio}",
                    "lower optim.lr (or this group's optim.lr_scale)",
                    {"group": i, "ratio": r},
                ))  # fmt: skip
        if rec.stepped:
            names = set(rec.no_grad)
            self.no_grad_streak = {n: self.no_grad_streak.get(n, 0) + 1 for n in names}
            dead = sorted(n for n, k in self.no_grad_streak.items() if k >= 2)
            if dead:
                out += self._once("no_grad", Finding(
                    "warn", "no_gradient", s - 1,
                    f"{len(dead)} trainable parameter(s) in the optimizer got no gradient for 2 "
                    f"steps, e.g. {dead[:3]}",
                    "the loss does not reach them (a detach, an unused branch): freeze them "
                    "(model.freeze) or fix the forward",
                    {"params": dead[:50]},
                ))  # fmt: skip
        return out

    def structure(
        self,
        not_in_opt: list[str],
        frozen_unasked: list[str],
        frozen_trainable: list[str],
        unasked_parts: list[str] | None = None,
    ) -> list[Finding]:
        """Findings about which parameters train, known before the first step; `unasked_parts`
        are the parts (as model.freeze names them) of `frozen_unasked`."""
        out = []
        if not_in_opt:
            out.append(Finding(
                "error", "not_in_optimizer", 0,
                f"{len(not_in_opt)} parameter(s) require grad but are in no optimizer group, "
                f"e.g. {not_in_opt[:3]}",
                "build the optimizer after the model is complete (loss parameters included)",
                {"params": not_in_opt[:50]},
            ))  # fmt: skip
        if frozen_unasked:
            tops = unasked_parts or sorted({n.split(".")[0] for n in frozen_unasked})
            out.append(Finding(
                "error", "frozen_unasked", 0,
                f"{len(frozen_unasked)} parameter(s) are frozen (requires_grad=False) though "
                f"model.freeze does not name them: {tops}, e.g. {frozen_unasked[:3]}",
                "add the part to model.freeze if intended, else stop freezing it",
                {"params": frozen_unasked[:50]},
            ))  # fmt: skip
        if frozen_trainable:
            out.append(Finding(
                "error", "frozen_gets_grad", 0,
                f"{len(frozen_trainable)} parameter(s) of a part named in model.freeze still "
                f"require grad, e.g. {frozen_trainable[:3]}",
                "freeze the part before the optimizer is built",
                {"params": frozen_trainable[:50]},
            ))  # fmt: skip
        return out

    def finish(self) -> list[Finding]:
        return []


class GatesAndTemperature:
    """Gated cross-attention gates stuck at exactly 0 or saturated at +-1; a learnable
    contrastive temperature pinned at its clamp."""

    name = "gates_temperature"

    def __init__(self, cfg: Config) -> None:
        self.patience = cfg.doctor.constant_steps - 1
        self.stepped = 0
        self.pinned = 0
        self.reported: set[str] = set()

    def observe(self, rec: StepRecord) -> list[Finding]:
        out = []
        self.stepped += int(rec.stepped)
        dead = [n for n, v in rec.gates.items() if v == 0.0]
        sat = [n for n, v in rec.gates.items() if v > 0.999]
        if dead and self.stepped >= self.patience and "dead" not in self.reported:
            self.reported.add("dead")
            out.append(Finding(
                "warn", "dead_gate", rec.step - self.patience + 1,
                f"{len(dead)} cross-attention gate(s) still exactly 0 after {self.stepped} "
                f"optimizer steps, e.g. {dead[:2]}",
                "the gate gets no gradient: check that the connector is not frozen and that "
                "media reach the cross-attention",
                {"gates": dead},
            ))  # fmt: skip
        if sat and "sat" not in self.reported:
            self.reported.add("sat")
            out.append(Finding(
                "warn", "saturated_gate", rec.step,
                f"{len(sat)} gate(s) saturated at |tanh| > 0.999, e.g. {sat[:2]}",
                "lower the connector's LR (optim.lr_scale) so the gate keeps a gradient",
                {"gates": sat},
            ))  # fmt: skip
        at_clamp = [n for n, gap in rec.temperature.items() if gap >= -1e-6]
        self.pinned = self.pinned + 1 if at_clamp else 0
        if self.pinned >= self.patience and "temp" not in self.reported:
            self.reported.add("temp")
            out.append(Finding(
                "warn", "temperature_clamped", rec.step - self.pinned + 1,
                f"the contrastive logit scale sits at its clamp ({at_clamp[0]})",
                "raise objective.max_logit_scale or lower the LR of the loss parameters; a "
                "pinned temperature no longer learns",
                {"modules": at_clamp},
            ))  # fmt: skip
        return out

    def finish(self) -> list[Finding]:
        return []


class RankConsistency:
    """DDP replicas must hold the same weights; rank shards must be disjoint."""

    name = "ranks"

    def __init__(self, cfg: Config) -> None:
        self.reported: set[str] = set()

    def observe(self, rec: StepRecord) -> list[Finding]:
        out = []
        w = rec.rank_weights
        if len(w) > 1 and "desync" not in self.reported:
            spread = max(w) - min(w)
            if spread > 1e-5 * max(1.0, max(abs(x) for x in w)):
                self.reported.add("desync")
                out.append(Finding(
                    "error", "ddp_divergence", rec.step,
                    f"ranks hold different weights (fingerprints {[round(x, 6) for x in w]})",
                    "every rank must apply the same averaged gradient: check that gradients are "
                    "synchronised (model.reduce_gradients) and no rank-local update runs",
                    {"fingerprints": w},
                ))  # fmt: skip
        ids = rec.rank_ids
        if len(ids) > 1 and "shards" not in self.reported:
            # (epoch, id): with accumulation across an epoch boundary one step holds two
            # epochs, and a sample of the old epoch may come again, on any rank, in the new
            eps = rec.rank_epochs or [[]] * len(ids)
            keys = [set(_keyed(r, e, rec.epoch)) for r, e in zip(ids, eps, strict=True)]
            shared = {i for _, i in keys[0].intersection(*keys[1:])}
            if shared:
                self.reported.add("shards")
                out.append(Finding(
                    "error", "rank_overlap", rec.step,
                    f"{len(shared)} sample(s) went to more than one rank in the same step",
                    "shard the sampler by rank (ShardedBatchSampler(rank=, world_size=))",
                    {"shared": sorted(shared)[:20]},
                ))  # fmt: skip
        return out

    def finish(self) -> list[Finding]:
        return []


def _keyed(ids: list[int], epochs: list[int], epoch: int) -> list[tuple[int, int]]:
    """(epoch, id) per sample; `epochs` empty: every sample is of `epoch`."""
    return list(zip(epochs or [epoch] * len(ids), ids, strict=True))


class ScalerSkips:
    """fp16: the loss scaler skipping step after step. A few skips while the scale settles are
    normal; from the default scale 2^16, 16 halvings in a row bring it below 1, so a longer run
    of skips means gradients that overflow fp16 unscaled, and the run no longer trains."""

    name = "scaler_skips"
    run_limit = 16

    def __init__(self, cfg: Config) -> None:
        self.run, self.total, self.reported = 0, 0, False

    def observe(self, rec: StepRecord) -> list[Finding]:
        self.run = self.run + 1 if rec.scaler_skip else 0
        self.total += rec.scaler_skip
        if self.run <= self.run_limit or self.reported:
            return []
        self.reported = True
        return [
            Finding(
                "error", "scaler_skips", rec.step - self.run + 1,
                f"the fp16 loss scaler skipped {self.run} steps in a row (gradient overflow at "
                "every scale): the model does not train",
                "use run.precision=bf16 or fp32, lower optim.lr, or find the module whose "
                "activations exceed fp16's range (65504)",
                {"consecutive": self.run, "total": self.total},
            )
        ]  # fmt: skip

    def finish(self) -> list[Finding]:
        return []


CHECKS: dict[str, Any] = {
    c.name: c
    for c in (
        Spikes, NonFinite, DegenerateLoss, Optimizer, GatesAndTemperature, RankConsistency,
        ScalerSkips,
    )
}  # fmt: skip
