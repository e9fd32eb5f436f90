"""tau of trained SmolLM2 drafters on 64 held-out prompts, through `vltrain generate` as a user
runs it (bench/RESULTS.md "Drafter, round 9").

The 8-prompt eval of bench_drafter.py is too small to rank two drafters (one standard error
is ~0.15 tau). This writes 64 prompts on 16 topics that no training prompt names (the 8 of
HELD_OUT's topics and 8 more), 4 per topic over all 20 training templates, decodes them with
the target alone and with each drafter at each tree budget, checks every output equals the
target's greedy one, and prints tau with the paired per-prompt difference between runs:

    python bench/bench_drafter_heldout.py --runs bench/out/drafter/RUN_A,bench/out/drafter/RUN_B

``--tree-shape best-first`` decodes the trees without the argmax chain placed first;
``--prompt-set tune`` decodes 64 other prompts (16 more unseen topics), for choosing decoding
settings on prompts that do not report the result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_drafter import (
    FIFTH_TEMPLATES,
    MORE_TEMPLATES,
    PROMPTS,
    TEMPLATES,
    gguf_path,
)

TOPICS = [
    *("tides", "lanterns", "penguins", "puzzles", "thunder", "harbors", "octopuses", "picnics"),
    *("windchimes", "sundials", "quilts", "marionettes", "tugboats", "observatories"),
    *("beekeeping", "snorkeling"),
]
#: a second disjoint set, for choosing decoding settings (tree shape, budget) without looking at
#: the held-out prompts that report the result
TUNING_TOPICS = [
    *("glassblowing", "falconry", "zeppelins", "abacuses", "hovercraft", "kaleidoscopes"),
    *("yodeling", "stalactites", "sextants", "monocles", "metronomes", "catapults"),
    *("dirigibles", "accordions", "sauerkraut", "crossbows"),
]


def held_out_prompts(topics: list[str] = TOPICS) -> list[str]:
    """64 prompts: topic i // 4 with template i mod 20; none is a training prompt."""
    tpl = TEMPLATES + MORE_TEMPLATES + FIFTH_TEMPLATES
    qs = [tpl[i % len(tpl)].format(topics[i // 4]) for i in range(64)]
    text = " ".join(PROMPTS).lower()
    seen = [t for t in topics if t in text]
    if seen or len(set(qs)) != 64:
        raise SystemExit(f"held-out topics appear in the training prompts: {seen}")
    return qs


def tuning_prompts() -> list[str]:
    """64 prompts on TUNING_TOPICS: neither training nor held-out prompts."""
    if set(TUNING_TOPICS) & set(TOPICS):
        raise SystemExit("the tuning topics overlap the held-out ones")
    return held_out_prompts(TUNING_TOPICS)


def prompt_set(name: str) -> list[str]:
    """``held`` (the 64 reported prompts) or ``tune`` (the 64 for choosing settings)."""
    return {"held": held_out_prompts, "tune": tuning_prompts}[name]()


def generate(out: Path, name: str, prompts: Path, args: argparse.Namespace, *extra: str) -> float:
    cmd = [sys.executable, "-m", "vltrain", "generate", "--model", args.model or str(gguf_path())]
    cmd += ["--prompts", str(prompts), "--max-new-tokens", str(args.max_new)]
    cmd += ["--batch-size", str(args.batch_size), "--out", str(out / f"{name}.jsonl"), *extra]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", required=True, help="drafter run folders (comma list)")
    p.add_argument("--model", default="", help="the runs' target (default: the GGUF)")
    p.add_argument("--budgets", default="0,16", help="tree budgets (0: chain)")
    p.add_argument("--out", default="bench/out/held64")
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-set", default="held", choices=("held", "tune"))
    p.add_argument("--tree-shape", default="chain-first", choices=("chain-first", "best-first"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = out / "prompts.jsonl"
    qs = prompt_set(args.prompt_set)
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in qs))
    secs = generate(out, "greedy", prompts, args)
    print(f"target greedy: {secs:.1f} s (batch {args.batch_size})")
    greedy = (out / "greedy.jsonl").read_text()
    rows: dict[tuple[str, int], list[float]] = {}
    for run in args.runs.split(","):
        for b in map(int, args.budgets.split(",")):
            shape = "_best" if b and args.tree_shape == "best-first" else ""
            name = f"{Path(run).name}_b{b}{shape}"
            stats = out / f"{name}.json"
            draft = ["--draft", run, "--tree-budget", str(b), "--stats", str(stats)]
            draft += ["--spec", "tree" if b else "chain"]  # measured as asked, not auto
            draft += ["--tree-shape", args.tree_shape]
            secs = generate(out, name, prompts, args, *draft)
            st = json.loads(stats.read_text())
            same = (out / f"{name}.jsonl").read_text() == greedy
            rows[(run, b)] = st["row_tau"]
            print(
                f"{name}: tau {st['tau']:.3f} over {st['rounds']} rounds, {st['new_tokens']} "
                f"tokens, {secs:.1f} s, identical to greedy: {same}"
            )
            if b and (run, 0) in rows:
                ok = sum(t >= c for t, c in zip(st["row_tau"], rows[(run, 0)], strict=True))
                print(f"  tree >= chain on {ok} / {len(st['row_tau'])} prompts")
    runs = args.runs.split(",")
    for b in map(int, args.budgets.split(",")):
        for a, c in zip(runs, runs[1:], strict=False):
            d = [y - x for x, y in zip(rows[(a, b)], rows[(c, b)], strict=True)]
            se = statistics.stdev(d) / len(d) ** 0.5
            up, down = sum(x > 0 for x in d), sum(x < 0 for x in d)
            print(
                f"budget {b}: {Path(c).name} - {Path(a).name} = {statistics.mean(d):+.3f} "
                f"+- {se:.3f} per prompt ({up} up, {down} down)"
            )


if __name__ == "__main__":
    main()
