"""Does a drafter pay on this machine? A measured cost model for `vltrain generate --spec auto`.

A round of speculative decoding costs one drafter call plus one target verify of the fed
tokens (the root and the drafted nodes: the block size for a chain, 1 + N for a DDTree of N
nodes) and yields tau tokens; plain greedy decoding yields one token per decode step. So the
predicted speed-up over greedy decoding on the same forward is

    tau * step / (draft + verify(fed))

with tau the drafter's measured acceptance (its ``tau_decode`` / ``tau_decode_tree`` from the
run's evaluation) and the costs measured here, once per machine, target, forward and drafter
(`measure_costs`, a few dozen calls on one prompt), cached in a small JSON file in the user's
cache dir (`cache_path`). The walk, the cache compaction and the batch are left out: a guide
to which of none, chain or tree to run, not a benchmark.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vltrain.inference.speculative import DraftContextCache, _cache_len, _draft

SPECS = ("auto", "chain", "tree", "none")
VERIFY_SIZES = (1, 8, 16, 32)
"""Tokens per verify measured; other sizes are interpolated (extrapolated past 32)."""
MIN_GAIN = 1.05
"""A drafter is chosen only where it is predicted at least this much faster than greedy
decoding: below, the model's own error (it leaves out the walk and the compaction) is as large
as the gain."""
CACHE_FILE = "spec_costs.json"


@dataclass
class SpecCosts:
    """Seconds of one decode step, one drafter call and one verify of n fed tokens."""

    step: float
    draft: float
    verify: dict[int, float]

    def verify_at(self, n: int) -> float:
        """Verify cost of n fed tokens, linear between (and past) the measured sizes."""
        pts = sorted(self.verify.items())
        if n in self.verify:
            return self.verify[n]
        lo, hi = pts[0], pts[1]
        for a, b in zip(pts, pts[1:], strict=False):
            lo, hi = a, b
            if n <= b[0]:
                break
        (x0, y0), (x1, y1) = lo, hi
        return max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), 0.0)


def predict(
    costs: SpecCosts, block_size: int, tau_chain: float, tau_tree: float, tree_budget: int
) -> dict[str, float]:
    """Predicted speed-up over greedy decoding of each way to decode (``none`` is 1.0); a way
    whose tau is unknown (0) is left out."""
    out = {"none": 1.0}
    if tau_chain > 0:
        out["chain"] = tau_chain * costs.step / (costs.draft + costs.verify_at(block_size))
    if tau_tree > 0 and tree_budget > 0:
        out["tree"] = tau_tree * costs.step / (costs.draft + costs.verify_at(tree_budget + 1))
    return out


def choose(predicted: dict[str, float], min_gain: float = MIN_GAIN) -> str:
    """The fastest predicted way; ``none`` unless a drafter gains at least ``min_gain``."""
    best = max(predicted, key=lambda k: predicted[k])
    return best if predicted[best] >= min_gain else "none"


def explain(choice: str, predicted: dict[str, float], costs: SpecCosts, taus: dict) -> str:
    """One line: what was picked and why."""
    step = costs.step
    parts = []
    for way in ("chain", "tree"):
        if way in predicted:
            fed = taus[f"{way}_fed"]
            parts.append(
                f"{way} {predicted[way]:.2f}x (tau {taus[way]:.2f}, verify of {fed} tokens "
                f"{costs.verify_at(fed) / step:.1f}x a decode step)"
            )
    why = f"predicted over greedy decoding: {'; '.join(parts)}; drafter {costs.draft / step:.2f}x"
    if choice == "none":
        return (
            f"--spec auto: decoding without the drafter, it does not pay on this machine ({why});"
            " --spec chain|tree forces it"
        )
    return f"--spec auto: {choice} ({why})"


def machine_key(*parts: Any) -> str:
    """Cache key of this machine (CPU model, threads, torch) and ``parts``."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = json.dumps([cpu, torch.get_num_threads(), torch.__version__, *parts], default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_path() -> Path:
    """``$VLTRAIN_SPEC_COSTS`` if set, else ``$XDG_CACHE_HOME/vltrain/spec_costs.json``
    (``~/.cache/vltrain/...`` without it)."""
    if os.environ.get("VLTRAIN_SPEC_COSTS"):
        return Path(os.environ["VLTRAIN_SPEC_COSTS"])
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "vltrain" / CACHE_FILE


def _seconds(fn: Callable[[], Any], reps: int) -> float:
    """The fastest of ``reps`` calls after a warm-up (packing, allocations): the least
    disturbed by other work on a shared machine, and alike for every cost compared."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.no_grad()
def measure_costs(target: Any, drafter: Any, inputs: dict[str, Any], reps: int = 5) -> SpecCosts:
    """Time a decode step, a drafter call and verifies of `VERIFY_SIZES` tokens after the
    prefill of ``inputs`` (one row), each undone by cropping the cache back."""
    logits, cache, ctx = target.prefill(**inputs)
    root = logits.argmax(-1)  # (B,)
    n0 = _cache_len(cache)
    lazy = drafter.cfg.draft_vocab > 0  # as decoding verifies
    anchor = target.next_positions(cache).to(root.device)
    held = [cache]

    def step() -> None:
        _, c = target.step(root, held[0])
        held[0] = target.crop(c, n0)

    def verify(n: int) -> Callable[[], None]:
        fed = root[:, None].repeat(1, n)
        parents = torch.arange(-1, n - 1, device=root.device)[None].repeat(len(root), 1)

        def run() -> None:
            _, c, _ = target.verify(fed, parents, held[0], logits=not lazy)
            held[0] = target.crop(c, n0)

        return run

    dcache = DraftContextCache()
    costs = SpecCosts(
        step=_seconds(step, reps),
        draft=_seconds(lambda: _draft(drafter, ctx, root, anchor, dcache), reps),
        verify={n: _seconds(verify(n), reps) for n in VERIFY_SIZES},
    )
    return costs


def cached_costs(
    key: str, measure: Callable[[], SpecCosts], path: Path | None = None
) -> tuple[SpecCosts, bool]:
    """(costs, measured now) of ``key``: read from the cache file, else measured and added."""
    path = path or cache_path()
    table: dict[str, Any] = {}
    try:
        table = json.loads(path.read_text())
        hit = table[key]
        return SpecCosts(
            hit["step"], hit["draft"], {int(k): v for k, v in hit["verify"].items()}
        ), False
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = measure()
    table = table if isinstance(table, dict) else {}
    table[key] = asdict(costs)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
    return costs, True
