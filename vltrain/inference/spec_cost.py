"""Does a drafter pay on this machine? A measured cost model for `vltrain generate --spec auto`.

A round of speculative decoding (`speculative_generate`) costs the drafter call and its
proposal, one target verify of the fed tokens (the root and the drafted nodes: the block size for
a chain, 1 + N for a DDTree of N nodes), the acceptance walk (with a draft-vocabulary drafter the
LM head on the nodes it visits) and the compaction of the cache to the accepted paths, and
yields tau tokens per row; plain greedy decoding yields one token per row per decode step. So
the predicted speed-up over greedy decoding on the same forward is

    tau * step / round

with tau the drafter's measured acceptance (its ``tau_decode`` / ``tau_decode_tree`` from the
run's evaluation) and ``step`` and ``round`` measured here at the batch the command decodes:
the round by timing real rounds of each way (`measure_costs`: a short speculative decoding of
the first batch of prompts, every part of a round included), once per machine, target, forward,
drafter, batch and tree budget, cached in a small JSON file in the user's cache dir
(`cache_path`). Left out: the prefill (the same for every way) and a batch's unequal rows (a
batch decodes until its slowest row ends, so a batch whose rows accept unequally gains less
than its mean tau says).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from vltrain.inference.speculative import PHASES, _cache_len, speculative_generate

SPECS = ("auto", "chain", "tree", "none")
MIN_GAIN = 1.05
"""A drafter is chosen only where it is predicted at least this much faster than greedy
decoding: the measured costs move by about this much between runs on a shared machine, and
the model leaves out a batch's unequal rows."""
CACHE_FILE = "spec_costs.json"
CACHE_VERSION = 2
"""Entries of another version (version 1 priced verifies alone) are measured again."""


@dataclass
class SpecCosts:
    """Seconds of one greedy decode step and of one round of each way to decode (``chain``,
    ``tree``), with the round's parts (`PHASES`), at ``batch`` rows."""

    step: float
    rounds: dict[str, dict[str, float]] = field(default_factory=dict)
    batch: int = 1

    def round(self, way: str) -> float:
        """Seconds of one round of ``way`` (the sum of its parts)."""
        return sum(self.rounds[way].get(p, 0.0) for p in PHASES)


def predict(costs: SpecCosts, taus: dict[str, float]) -> dict[str, float]:
    """Predicted speed-up over greedy decoding of each way to decode (``none`` is 1.0); a way
    whose tau is unknown (0) or whose round was not measured is left out."""
    out = {"none": 1.0}
    for way, tau in taus.items():
        if tau > 0 and way in costs.rounds:
            out[way] = tau * costs.step / costs.round(way)
    return out


def choose(predicted: dict[str, float], min_gain: float = MIN_GAIN) -> str:
    """The fastest predicted way; ``none`` unless a drafter gains at least ``min_gain``."""
    best = max(predicted, key=lambda k: predicted[k])
    return best if predicted[best] >= min_gain else "none"


def explain(choice: str, predicted: dict[str, float], costs: SpecCosts, taus: dict) -> str:
    """One line: what was picked and why (each way's round in decode steps, by part)."""
    step = costs.step
    parts = []
    for way in ("chain", "tree"):
        if way in predicted:
            r = {p: costs.rounds[way].get(p, 0.0) / step for p in PHASES}
            parts.append(
                f"{way} {predicted[way]:.2f}x (tau {taus[way]:.2f}; a round of "
                f"{taus[f'{way}_fed']} fed tokens {costs.round(way) / step:.2f} decode steps: "
                f"verify {r['verify']:.2f}, drafter {r['draft']:.2f}, walk and compaction "
                f"{r['walk'] + r['compact']:.2f})"
            )
    why = f"predicted over greedy decoding at batch {costs.batch}: {'; '.join(parts)}"
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


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


@torch.no_grad()
def measure_costs(
    target: Any, drafter: Any, inputs: dict[str, Any], tree_budget: int = 0, reps: int = 5
) -> SpecCosts:
    """Time a greedy decode step of the batch ``inputs`` (the fastest of ``reps``, each undone
    by cropping the cache back) and real rounds of chain decoding (and of a ``tree_budget``-node
    tree when given) of the same batch: a warm-up decoding, then one of 4 blocks' worth of new
    tokens (at least 4 rounds), each part the median over its rounds."""
    logits, cache, _ = target.prefill(**inputs)
    root = logits.argmax(-1)  # (B,)
    n0 = _cache_len(cache)
    held = [cache]

    def step() -> None:
        _, c = target.step(root, held[0])
        held[0] = target.crop(c, n0)

    costs = SpecCosts(step=_seconds(step, reps), batch=int(root.shape[0]))
    block = drafter.cfg.block_size
    for way, budget in (("chain", 0), ("tree", tree_budget)):
        if way == "tree" and budget <= 0:
            continue
        phases: list[dict[str, float]] = []
        for n, keep in ((block, False), (4 * block, True)):  # warm-up, then timed
            _, st = speculative_generate(
                target, drafter, inputs, max_new_tokens=n, tree_budget=budget, timed=True
            )
            phases += st.phases if keep else []
        if phases:  # none when every row's first token ends it
            costs.rounds[way] = {p: _median([r[p] for r in phases]) for p in PHASES}
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
        if hit.get("version") != CACHE_VERSION:
            raise KeyError(key)
        return SpecCosts(hit["step"], hit["rounds"], hit["batch"]), False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    costs = measure()
    table = table if isinstance(table, dict) else {}
    table[key] = {"version": CACHE_VERSION, **asdict(costs)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
    return costs, True
