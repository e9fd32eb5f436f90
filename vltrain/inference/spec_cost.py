"""Does a drafter pay on this machine? A measured cost model for `vltrain generate --spec auto`.

A round of speculative decoding (`speculative_generate`) costs the drafter call and its
proposal, one target verify of the fed tokens (the root and the drafted nodes: the block size for
a chain, 1 + N for a DDTree of N nodes), the acceptance walk (with a draft-vocabulary drafter the
LM head on the nodes it visits) and the compaction of the cache to the accepted paths, and
yields tau tokens per row; plain greedy decoding yields one token per row per decode step. So
the predicted speed-up over greedy decoding on the same forward is

    tau * step / round

with tau the drafter's measured tokens per round (its ``kept_decode`` / ``kept_decode_tree``
from the run's evaluation, else ``tau_decode`` / ``tau_decode_tree``) and ``step`` and
``round`` measured here at the batch the command decodes, by real greedy decoding and real
rounds of each way of the first batch of prompts, interleaved
(`measure_costs`; every part of a round included), once per machine, target, forward,
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
from statistics import median
from typing import Any

import torch

from vltrain.inference.speculative import PHASES, speculative_generate

SPECS = ("auto", "chain", "tree", "none")
MIN_GAIN = 1.10
"""A drafter is chosen only where it is predicted at least this much faster than greedy
decoding: on SmolLM2-135M (bench/RESULTS.md "`--spec auto`: predicted and measured") the
predictions ran 7-13% above the measured speed-ups, half of it the drafter's tau on its own
eval prompts (which picked its checkpoint) above its tau on other prompts."""
CACHE_FILE = "spec_costs.json"
CACHE_VERSION = 3
"""Entries of another version are measured again (1 priced verifies alone; 2 timed rounds that
still carried the batch's finished rows)."""


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


def explain(
    choice: str,
    predicted: dict[str, float],
    costs: SpecCosts,
    taus: dict[str, float],
    fed: dict[str, int],
) -> str:
    """One line: what was picked and why (each way's round of ``fed[way]`` tokens in decode
    steps, by part)."""
    step = costs.step
    parts = []
    for way in ("chain", "tree"):
        if way in predicted:
            r = {p: costs.rounds[way].get(p, 0.0) / step for p in PHASES}
            parts.append(
                f"{way} {predicted[way]:.2f}x (tau {taus[way]:.2f}; a round of "
                f"{fed[way]} fed tokens {costs.round(way) / step:.2f} decode steps: "
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


def _greedy_step(target: Any, inputs: dict[str, Any], n: int) -> float:
    """Seconds per step of ``n`` greedy decode steps of the batch ``inputs`` after its prefill
    (each step feeds the previous argmax, the cache growing as in decoding)."""
    logits, cache, _ = target.prefill(**inputs)
    tok = logits.argmax(-1)
    t0 = time.perf_counter()
    for _ in range(n):
        logits, cache = target.step(tok, cache)
        tok = logits.argmax(-1)
    return (time.perf_counter() - t0) / n


@torch.no_grad()
def measure_costs(
    target: Any,
    drafter: Any,
    inputs: dict[str, Any],
    tree_budget: int = 0,
    reps: int = 2,
    max_new_tokens: int = 0,
) -> SpecCosts:
    """Time greedy decode steps and real rounds of chain decoding (and of a ``tree_budget``-node
    tree when given) of the batch ``inputs``, interleaved: a short warm-up of each, then
    ``reps`` passes of greedy decoding, the chain and the tree in turn, each over 4 blocks'
    worth of new tokens (at least 4 rounds; ``max_new_tokens``, the command's limit, if fewer).
    The step is the median over passes, each part of a round the median over every timed round:
    a shared machine's speed drifts by tens of percent over minutes, and interleaving lets the
    drift fall on the step and the rounds alike."""
    block = drafter.cfg.block_size
    most = min(4 * block, max_new_tokens or 4 * block)
    ways = {"chain": 0, **({"tree": tree_budget} if tree_budget > 0 else {})}
    steps: list[float] = []
    phases: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    for rep in range(reps + 1):  # pass 0: the warm-up (packing, allocations)
        n = most if rep else min(block, most)
        step = _greedy_step(target, inputs, n)  # pass 0 warms it up too (it ran cold: 316 ms
        steps += [step] if rep else []  # against ~150 warm, a reviewer's "chain 5.5x")
        for way, budget in ways.items():
            _, st = speculative_generate(
                target, drafter, inputs, max_new_tokens=n, tree_budget=budget, timed=True
            )
            phases[way] += st.phases if rep else []
    costs = SpecCosts(step=median(steps), batch=len(inputs["input_ids"]))
    for way, rounds in phases.items():
        if rounds:  # none when every row's first token ends it
            costs.rounds[way] = {p: median(r[p] for r in rounds) for p in PHASES}
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
