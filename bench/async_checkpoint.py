"""Training stall of a checkpoint save: synchronous vs train.async_save, side by side with
torch.distributed.checkpoint's own async_save (one process, no_dist) on the same state.

The state is a model of a few hundred MB (fp32 Linear layers) and its AdamW state (two
moments: 3x the weights in all), trained with real steps (forward, backward, AdamW). The
training stall of a save is the time the training thread is blocked by it: the save call,
plus the time the next step's optimizer step waits for the save's copy of the weights (ours
copies them in the writer thread while that step's forward and backward run). Timed directly,
not as a difference of step times: on a shared machine step times vary by seconds. The
writer thread's competition for the CPU is not in the number. "write to complete" is the
time from the save call to the complete checkpoint. Saves alternate (sync, async, dcp, sync,
...) and medians are reported.

    PYTHONPATH=. python bench/async_checkpoint.py --mb 300 --runs 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from vltrain.core import checkpoint
from vltrain.core.async_checkpoint import AsyncWriter, write_checkpoint_async


def build(mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear 1024x1024 layers adding up to `mb` MB of fp32 weights, one AdamW step taken."""
    layers = max(1, mb * 2**20 // (4 * 1024 * 1025))
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    return model, opt


def step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, writer: AsyncWriter | None = None
) -> float:
    """One training step; the seconds its optimizer step waited for a save's copy."""
    model(x).square().mean().backward()
    t = time.perf_counter()
    if writer is not None:
        writer.wait_copied()  # what the optimizer's pre-step hook does, timed here
    waited = time.perf_counter() - t
    opt.step()
    opt.zero_grad(set_to_none=False)
    return waited


def measure(
    name: str, root: Path, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
    writer: AsyncWriter,
) -> tuple[float, float]:  # fmt: skip
    """(training stall, seconds to the complete checkpoint) of one save after a step: the
    save call, plus what the next step's optimizer step waited for the copy."""
    state = {"optimizer": opt.state_dict()}
    done: list[float] = []
    t = time.perf_counter()
    if name == "sync":
        checkpoint.write_checkpoint(root, 1, model, state)
        done.append(time.perf_counter())
    elif name == "async (ours)":
        write_checkpoint_async(
            writer, root, 1, model, state, {}, lambda module, folder: None,
            lambda path: done.append(time.perf_counter()), opt,
        )  # fmt: skip
    else:
        import torch.distributed.checkpoint as dcp

        full = {"model": model.state_dict(), "optim": opt.state_dict()}
        future = dcp.async_save(full, checkpoint_id=str(root / "dcp"), no_dist=True)
    call = time.perf_counter() - t
    waited = step(model, opt, x, writer if name == "async (ours)" else None)
    if name == "async (ours)":
        writer.wait()
    elif name == "dcp async_save":
        future.result()
        done.append(time.perf_counter())
    return call + waited, done[0] - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=300, help="weights in MB (fp32)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model, opt = build(args.mb)
    x = torch.randn(args.batch, 1024)
    n = sum(p.numel() for p in model.parameters())
    print(f"model: {n:,} parameters ({4 * n / 2**20:.0f} MiB fp32; with AdamW state x3)")
    base = Path(tempfile.mkdtemp(dir=args.dir, prefix="vltrain_async_bench_"))
    writer = AsyncWriter(opt)  # as the trainer builds it: gating the optimizer's step
    modes = ("sync", "async (ours)", "dcp async_save")
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    try:
        for _ in range(2):
            step(model, opt, x)  # warm up
        for _ in range(args.runs):
            for name in modes:
                step(model, opt, x)
                times[name].append(measure(name, base / "run", model, opt, x, writer))
                shutil.rmtree(base / "run", ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sync = statistics.median(s for s, _ in times["sync"])
    print("| save | training stall (median) | stall / sync save | write to complete (median) |")
    print("|---|---|---|---|")
    for name, rows in times.items():
        stall = statistics.median(s for s, _ in rows)
        total = statistics.median(c for _, c in rows)
        print(f"| {name} | {stall:.3f} s | {stall / sync:.1%} | {total:.3f} s |")


if __name__ == "__main__":
    main()
