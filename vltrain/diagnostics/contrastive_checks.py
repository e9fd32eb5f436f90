"""Contrastive runs that do not learn: the loss sits at chance while the gradient vanishes.

"Chance" is the loss's value when its logits carry no information, computed by the loss itself
for the global batch it saw (``StepRecord.chance_loss``): InfoNCE's mean over the two
directions of ln(candidates), with the cross-rank gather and hard negatives counted; SigLIP's
best input-independent loss (``vltrain.objectives.chance.siglip_chance``). A run can start
there and learn (every CLIP run starts near ln N); a run whose embeddings collapsed stays there
while its gradient norm falls by orders of magnitude: that pair, past warmup, is the finding.
"""

from __future__ import annotations

import math
from collections import deque

from vltrain.config.schema import Config
from vltrain.diagnostics.record import Finding, StepRecord
from vltrain.objectives.chance import infonce_chance, siglip_chance

#: a collapsed run on its way out shows its grad norm climbing back from the trough (seen on a
#: batch-32 run that sat at chance for 7 steps, then learned): no finding while it climbs
CLIMB = 3.0


class ChanceLoss:
    """Contrastive loss within `chance_tolerance` of chance for `chance_steps` steps past
    warmup, with every grad norm of those steps `chance_grad_drop` x below the early peak
    (the largest grad norm of the run's first `chance_steps` steps) and the last one not
    climbing back (< CLIMB x the window's smallest)."""

    name = "contrastive_chance"

    def __init__(self, cfg: Config) -> None:
        d = cfg.doctor
        self.steps, self.tol, self.drop = d.chance_steps, d.chance_tolerance, d.chance_grad_drop
        self.judge_from = cfg.optim.warmup_steps
        self.early: list[float] = []  # grad norms of the first `steps` finite steps
        self.window: deque[tuple[int, float, float, float]] = deque(maxlen=self.steps)
        self.reported = False

    def observe(self, rec: StepRecord) -> list[Finding]:
        chance = rec.chance_loss
        if self.reported or chance is None or not rec.finite or not math.isfinite(rec.grad_norm):
            return []
        if len(self.early) < self.steps:
            self.early.append(rec.grad_norm)
        at_chance = abs(rec.loss - chance) <= self.tol * chance
        if rec.step < self.judge_from or not at_chance:
            self.window.clear()
            return []
        self.window.append((rec.step, rec.loss, rec.grad_norm, chance))
        if len(self.window) < self.steps or len(self.early) < self.steps:
            return []
        peak = max(self.early)
        grads = [g for _, _, g, _ in self.window]
        worst = max(grads)  # every step of the window is collapsed
        if not 0 < worst * self.drop <= peak or grads[-1] > CLIMB * min(grads):
            return []
        self.reported = True
        return [self._finding(peak, worst)]

    def _finding(self, peak: float, worst: float) -> Finding:
        steps = [s for s, _, _, _ in self.window]
        losses = [x for _, x, _, _ in self.window]
        grads = [g for _, _, g, _ in self.window]
        chance = self.window[-1][3]
        return Finding(
            "warn", self.name, steps[0],
            f"contrastive loss sits at chance ({chance:.4g}, the loss of uninformative logits "
            f"for this batch) for {len(steps)} steps past warmup (losses "
            f"{min(losses):.4g}-{max(losses):.4g}) while the grad norm fell "
            f"{peak / worst:.0f}x from its early peak ({peak:.3g} -> {worst:.3g}): the "
            "embeddings carry no pairing information (collapsed), and with the gradient gone "
            "the run will not leave",
            "lower optim.lr or lengthen optim.warmup_steps (a collapse at the LR peak), check "
            "that each image's text is its own (shuffled pairs, blank images) and that the "
            "towers train (train_acc_i2t near 1/batch confirms the collapse)",
            {"chance": chance, "steps": steps, "losses": losses, "grad_norms": grads,
             "early_peak_grad_norm": peak, "drop": peak / worst, "tolerance": self.tol},
        )  # fmt: skip

    def finish(self) -> list[Finding]:
        return []


def config_chance(cfg: Config, world_size: int) -> float | None:
    """Chance from the config, for runs whose records predate ``chance_loss``: exact only for a
    contrastive stage without hard negatives (their number per record varies); else None."""
    o = cfg.objective
    if cfg.stage != "contrastive" or o.hard_negatives:
        return None
    n = cfg.data.batch_size * (world_size if o.gather else 1)
    if o.loss == "infonce":
        return infonce_chance(n, 0, o.symmetric)
    return siglip_chance(n, 0) if o.loss == "siglip" else None
