"""A plain PyTorch training script with one planted fault, for TrainCheck (bench_traincheck.py).

TrainCheck instruments a script's torch calls (`traincheck-collect --pyscript`), so the faults
are planted here in plain torch, mirroring bench_doctor.py's: the same kinds of fault on a
small model (an MLP classifier with a tanh-gated side branch, the shape of a gated
cross-attention block) trained on a fixed synthetic set. Two epochs of 8 batches; mid-run
faults start at ONSET.

    python bench/traincheck_target.py --fault none --seed 0 [--times FILE]

Run directly it is the uninstrumented baseline (traincheck is imported for its step counter
and stage annotations, which are plain Python calls); under `traincheck-collect` it is traced.
``--times`` writes one step time per line. TrainCheck's source rewriter needs the traincheck
imports at module level (inside a function it fails with an IndentationError) and no
`from __future__` import (it prepends its own code).
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from traincheck import annotate_stage
from traincheck.instrumentor import META_VARS

STEPS_PER_EPOCH, EPOCHS, BATCH = 8, 2, 16
ONSET = 10  # in the second epoch, after the reference behaviour is established
FAULTS = (
    "none", "no_zero_grad", "lr0", "frozen_layer", "not_in_optimizer", "nan", "loss_spike",
    "grad_spike", "replayed_order", "zero_loss", "label_mask", "dead_gate", "eval_on_train",
)  # fmt: skip


class GatedNet(nn.Module):
    """x -> trunk -> head, plus a side branch added through tanh(gate) (gate starts at 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.side = nn.Linear(64, 64)
        self.gate = nn.Parameter(torch.zeros(1))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)  # (B, 64)
        return self.head(h + torch.tanh(self.gate) * self.side(h))  # (B, 10)


def make_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A learnable synthetic task: labels from a fixed random linear map (train, val)."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(32, 10, generator=g)
    n = STEPS_PER_EPOCH * BATCH
    x = torch.randn(n + 64, 32, generator=g)
    y = (x @ w).argmax(1)
    return x[:n], y[:n], x[n:], y[n:]


def epoch_order(seed: int, epoch: int, n: int, fault: str) -> torch.Tensor:
    """The sampler's permutation; the replayed-order fault forgets the epoch (no set_epoch)."""
    g = torch.Generator().manual_seed(seed * 1000 + (0 if fault == "replayed_order" else epoch))
    return torch.randperm(n, generator=g)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fault", default="none", choices=FAULTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--times", default="", help="write per-step seconds here")
    args = p.parse_args()
    META_VARS["step"] = -1
    torch.manual_seed(args.seed)
    fault = args.fault
    model = GatedNet()
    if fault == "frozen_layer":  # the frozen tower nobody asked for
        model.trunk[0].requires_grad_(False)
    if fault == "dead_gate":  # the gate never gets a gradient
        model.gate.register_hook(lambda grad: grad * 0)
    params = list(model.parameters())
    if fault == "not_in_optimizer":
        skip = {id(q) for q in model.trunk[0].parameters()}
        params = [q for q in params if id(q) not in skip]
    optimizer = torch.optim.AdamW(params, lr=3e-3)
    x, y, vx, vy = make_data(args.seed)
    times = []
    for epoch in range(EPOCHS):
        annotate_stage("training")
        model.train()
        order = epoch_order(args.seed, epoch, len(x), fault)
        for b in range(STEPS_PER_EPOCH):
            t0 = time.perf_counter()
            step = epoch * STEPS_PER_EPOCH + b
            META_VARS["step"] = step
            idx = order[b * BATCH : (b + 1) * BATCH]
            xb, yb = x[idx], y[idx]
            if fault == "nan" and step == ONSET:
                xb = xb * float("inf")
            if fault == "label_mask" and step >= ONSET:  # nothing labelled
                yb = torch.full_like(yb, -100)
            if fault == "lr0" and step >= ONSET:
                for group in optimizer.param_groups:
                    group["lr"] = 0.0
            if not (fault == "no_zero_grad" and step >= ONSET):
                optimizer.zero_grad()
            logits = model(xb)
            ce = F.cross_entropy(logits, yb, ignore_index=-100, reduction="sum")
            loss = ce / (yb != -100).sum().clamp(min=1)  # a masked batch gives 0, not NaN
            if fault == "loss_spike" and step == ONSET:
                loss = loss * 6.0  # a hard-coded loss weight for one step
            if fault == "zero_loss" and step >= ONSET:
                loss = loss * 0.0
            loss.backward()
            if fault == "grad_spike" and step == ONSET:
                for q in model.parameters():
                    if q.grad is not None:
                        q.grad.mul_(50.0)
            optimizer.step()
            times.append(time.perf_counter() - t0)
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        annotate_stage("testing")
        model.eval()
        ex, ey = (x, y) if fault == "eval_on_train" else (vx, vy)
        with torch.no_grad():
            acc = (model(ex).argmax(1) == ey).float().mean().item()
        print(f"epoch {epoch} eval acc {acc:.3f}", flush=True)
    if args.times:
        with open(args.times, "w") as f:
            f.write("".join(f"{t}\n" for t in times))


if __name__ == "__main__":
    main()
