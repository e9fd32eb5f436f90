"""Activation checkpointing and torch.compile per block: memory saved, compile and step time.

    PYTHONPATH=. python bench/bench_blocks.py [--preset small] [--batch 32] [--steps 5]

One dual encoder (vision + text towers of a preset), one InfoNCE training step, three ways:
eager, `train.activation_checkpointing` (engine/sharding.apply_activation_checkpointing) and
`train.compile` (engine/sharding.compile_blocks). Activation memory is the bytes autograd saves
for backward during the forward (counted exactly with saved_tensors_hooks, so the number does
not depend on the allocator); times are medians after the first (compiling) step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from vltrain.engine import sharding
from vltrain.models.dual_encoder import DualEncoder
from vltrain.models.presets import text_config, vision_config


def build(preset: str) -> DualEncoder:
    torch.manual_seed(0)
    vision = vision_config(preset)
    return DualEncoder(vision, text_config(preset, vocab_size=1000), 128)


def step_fn(model: DualEncoder, batch: int, image_size: int) -> Callable[[], float]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image_size, image_size, generator=g)
    ids = torch.randint(1, 1000, (batch, 32), generator=g)
    saved = {"bytes": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved["bytes"] += t.numel() * t.element_size()
        return t

    def step() -> float:
        saved["bytes"] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            img = model.encode_image(images)
            txt = model.encode_text(ids, torch.ones_like(ids))
            loss = torch.nn.functional.cross_entropy(img @ txt.T * 10, torch.arange(batch))
        loss.backward()
        model.zero_grad(set_to_none=True)
        return saved["bytes"] / 2**20

    return step


def measure(name: str, model: DualEncoder, args: argparse.Namespace) -> dict:
    step = step_fn(model, args.batch, vision_config(args.preset).image_size)
    t = time.perf_counter()
    mib = step()
    first = time.perf_counter() - t
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"mode": name, "saved_mib": mib, "first_s": first, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=("tiny", "small", "base"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure("eager", build(args.preset), args)]
    ac = build(args.preset)
    sharding.apply_activation_checkpointing(ac)
    rows.append(measure("activation_checkpointing", ac, args))
    if not args.no_compile:
        compiled = build(args.preset)
        sharding.compile_blocks(compiled)
        rows.append(measure("compile", compiled, args))
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, ", end="")
    print(f"{args.threads} threads, preset {args.preset}, batch {args.batch}")
    print("| mode | saved activations (MiB) | first step (s) | median step (s) |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['saved_mib']:.1f} | {r['first_s']:.2f} | {r['step_s']:.3f} |")


if __name__ == "__main__":
    main()
