"""Would a per-round tree budget beat a fixed one? A calibration study of a trained drafter.

DDTree (arXiv 2604.12989) verifies a fixed number of nodes every round. EAGLE-2's dynamic tree
instead sizes each round's tree from the drafter's own confidence: if the drafter's
probabilities are calibrated, a node's chance of being accepted is exp(its path score), so the
expected acceptance of the best-first tree's first N nodes is 1 + the sum of their exp(score),
and a round can pick the N that buys the most expected tokens per millisecond.

Every prefix of a best-first DDTree is itself the DDTree of that size, so one decoding at the
largest budget gives, for every round, the acceptance each smaller budget would have had (the
target's greedy choice is known at every node). This script decodes the 64 held-out prompts of
``bench_drafter_heldout.py`` at ``--max-budget`` nodes (batch ``--batch-size``, vltrain's native
forward), records per round and candidate N the predicted (1 + sum exp score) and the actual
acceptance, measures the target's batch-1 verify cost at each 1 + N and the drafter's cost, and
prints: the calibration (predicted / actual per N), the rate of each fixed budget, of a dynamic
rule that picks argmax_N (predicted(N) - lambda * cost(N)) per round, and of the oracle that
knows each round's actual acceptance. The same rounds also give the acceptance of the pure
best-first tree (``--tree-shape best-first``: DDTree without the argmax chain placed first) of
every N up to the big tree's size less its chain: its nodes are the big tree's N of highest
path score. ``--prompt-set tune`` runs the 64 tuning prompts instead of the held-out ones (to
choose settings on prompts that do not report the result).

Rounds are those of the largest-budget decoding, so the rates are a per-round estimate, not a
wall-clock run:

    python bench/bench_tree_budget.py --run bench/out/drafter/RUN
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_drafter import gguf_path, machine
from bench_drafter_heldout import prompt_set

from vltrain.data.draft_data import chat_prompt_ids
from vltrain.inference import speculative
from vltrain.inference.captioning import left_pad
from vltrain.inference.hf_target import load_hf_causal_lm
from vltrain.inference.native_llama import causal_lm_target
from vltrain.models.drafter_checkpoint import load_drafter
from vltrain.tools.speculate import attach


def path_scores(logq: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> list[float]:
    """Sum of log q along each node's path (nodes topologically ordered, -1 = root)."""
    lq = logq.float()
    score: list[float] = []
    depth: list[int] = []
    for t, p in zip(tokens.tolist(), parents.tolist(), strict=True):
        d = 0 if p < 0 else depth[p] + 1
        depth.append(d)
        score.append((0.0 if p < 0 else score[p]) + float(lq[d, t]))
    return score


def best_first_ranks(scores: list[float], parents: list[int]) -> list[int]:
    """Each node's place in the pure best-first order (DDTree without the chain placed first):
    path score descending, a parent before its children on ties. The best-first tree of N
    nodes is the N nodes of rank < N, as long as N <= the chain-first tree's size - its chain
    (those nodes are all in it: the chain-first tree is the chain plus the best-first pops)."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    order = sorted(range(len(scores)), key=lambda k: (-scores[k], depth[k], k))
    rank = [0] * len(scores)
    for r, k in enumerate(order):
        rank[k] = r
    return rank


class Recorder:
    """Wraps ``_proposals`` and ``_walk_row`` to log, per live row and round, the predicted and
    actual acceptance of every candidate prefix size."""

    def __init__(self, sizes: list[int], best_first: list[int] = ()) -> None:  # type: ignore[assignment]
        self.sizes = sizes
        self.best_first = list(best_first)  # sizes whose best-first tree lies in the big one
        self.scores: list[list[float]] = []
        self.ranks: list[list[int]] = []
        self.rounds: list[dict] = []

    def proposals(self, orig):
        def run(logq, budget, sample, gen, *rest):
            toks, parents = orig(logq, budget, sample, gen, *rest)
            rows = zip(logq, toks, parents, strict=True)
            self.scores = [path_scores(q, t, p) for q, t, p in rows]
            self.ranks = [
                best_first_ranks(s, p.tolist()) for s, p in zip(self.scores, parents, strict=True)
            ]
            return toks, parents

        return run

    def walk(self, orig):
        def run(i, fed, fed_par, tlogits, logq, sample, temperature, gen):
            out = orig(i, fed, fed_par, tlogits, logq, sample, temperature, gen)
            if bool((fed_par[i, 2:] == 0).all()):  # a finished row: every node hangs off the root
                return out
            # the accepted path (fed indices, root 0 first): a (parent, token) child is unique,
            # so the walk in the first n nodes follows it while its nodes are among them
            path = out[0]
            ex = [math.exp(s) for s in self.scores[i]]
            pred = {n: 1 + sum(ex[:n]) for n in self.sizes}
            act = {n: next((k for k, x in enumerate(path) if x > n), len(path)) for n in self.sizes}
            rank = self.ranks[i]  # fed index x is tree node x - 1
            best = {
                n: next((k for k, x in enumerate(path) if k and rank[x - 1] >= n), len(path))
                for n in self.best_first
            }
            self.rounds.append({"pred": pred, "act": act, "best_first": best})
            return out

        return run


@torch.no_grad()
def costs_ms(target, drafter, tok, sizes: list[int], reps: int = 5) -> tuple[dict, float]:
    """Batch-1 verify ms at 1 + N tokens after a ~200-token prompt, and the draft ms."""
    q = " ".join(["Tell me about the history of lighthouses and the people who kept them."] * 8)
    ids = torch.tensor([chat_prompt_ids(tok, q)[:200]])
    mask = torch.ones_like(ids)
    out = {}
    for n in sizes:
        times = []
        for r in range(reps + 1):
            _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
            fed = torch.randint(100, 1000, (1, 1 + n))
            par = torch.arange(-1, n)[None]  # a chain: the cost depends on the row count only
            t = time.perf_counter()
            target.verify(fed, par, cache)
            if r:  # the first call packs this row count's weights
                times.append(time.perf_counter() - t)
        out[n] = 1000 * statistics.median(times)
    logits, cache, ctx = target.prefill(input_ids=ids, attention_mask=mask)
    root = logits.argmax(-1)
    anchor = target.next_positions(cache)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        speculative._draft(drafter, ctx, root, anchor, speculative.DraftContextCache())
        times.append(time.perf_counter() - t)
    return out, 1000 * statistics.median(times)


def rate(rounds: list[dict], pick, cost: dict, draft: float) -> tuple[float, float, float]:
    """(tokens per ms, tau, mean N) when each round verifies ``pick(round)`` nodes."""
    ns = [pick(r) for r in rounds]
    tok = sum(r["act"][n] for r, n in zip(rounds, ns, strict=True))
    ms = sum(draft + cost[n] for n in ns)
    return tok / ms, tok / len(rounds), sum(ns) / len(ns)


def best_lambda(rounds, score, cost, draft, sizes):
    """The rule argmax_N (score(N) - lambda * cost(N)) at its best lambda over a grid; the
    fixed point of lambda = the rule's own rate is where the grid's best lies."""
    best = None
    for lam in [x / 1000 for x in range(5, 80)]:

        def pick(r, lam=lam):
            return max(sizes, key=lambda n: r[score][n] - lam * (draft + cost[n]))

        res = (*rate(rounds, pick, cost, draft), lam)
        if best is None or res[0] > best[0]:
            best = res
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="drafter run or checkpoint folder")
    p.add_argument("--max-budget", type=int, default=64)
    p.add_argument("--sizes", default="7,11,16,24,32,48,64", help="candidate budgets (7: chain)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--prompt-set", default="held", choices=("held", "tune"))
    p.add_argument("--out", default="bench/out/tree_budget.json")
    args = p.parse_args()
    sizes = sorted(int(x) for x in args.sizes.split(","))
    if sizes[-1] != args.max_budget:
        raise SystemExit("the largest candidate must be --max-budget")
    model, tok = load_hf_causal_lm(gguf_path())
    drafter, _ = load_drafter(args.run)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    target = causal_lm_target(model, drafter.cfg.target_layer_ids, "native", pad)
    attach(drafter, target)
    if drafter.cfg.block_size - 1 != sizes[0]:
        print(f"note: the chain has {drafter.cfg.block_size - 1} nodes, not {sizes[0]}")
    cost, draft = costs_ms(target, drafter, tok, sizes)
    print(f"verify ms at 1+N: {json.dumps({n: round(c, 1) for n, c in cost.items()})}")
    print(f"draft ms: {draft:.1f}")
    depth = drafter.cfg.block_size - 1
    rec = Recorder(sizes, [n for n in sizes if n <= args.max_budget - depth])
    orig_p, orig_w = speculative._proposals, speculative._walk_row
    speculative._proposals, speculative._walk_row = rec.proposals(orig_p), rec.walk(orig_w)
    qs = prompt_set(args.prompt_set)[: args.prompts]
    t = time.perf_counter()
    try:
        for lo in range(0, len(qs), args.batch_size):
            batch = [chat_prompt_ids(tok, q) for q in qs[lo : lo + args.batch_size]]
            ids, mask = left_pad(batch, pad)
            inputs = {"input_ids": ids, "attention_mask": mask}
            speculative.speculative_generate(target, drafter, inputs, args.max_new, args.max_budget)
    finally:
        speculative._proposals, speculative._walk_row = orig_p, orig_w
    rounds = rec.rounds
    print(
        f"{len(rounds)} rounds of {len(qs)} prompts at {args.max_budget} nodes in "
        f"{time.perf_counter() - t:.0f} s"
    )
    table = []
    print("N | predicted tau | actual tau | tokens/ms | best-first tau")
    for n in sizes:
        pr = statistics.mean(r["pred"][n] for r in rounds)
        tps, tau, _ = rate(rounds, lambda r, n=n: n, cost, draft)
        bf = statistics.mean(r["best_first"][n] for r in rounds) if n in rec.best_first else None
        row = {"n": n, "predicted_tau": pr, "tau": tau, "tokens_per_ms": tps, "best_first_tau": bf}
        table.append(row)
        print(f"{n} | {pr:.3f} | {tau:.3f} | {tps:.4f} | " + ("-" if bf is None else f"{bf:.3f}"))
    fixed = max(table, key=lambda x: x["tokens_per_ms"])
    dyn = best_lambda(rounds, "pred", cost, draft, sizes)
    ora = best_lambda(rounds, "act", cost, draft, sizes)
    for name, (tps, tau, mean_n, lam) in (("dynamic (predicted)", dyn), ("oracle", ora)):
        print(
            f"{name}: {tps:.4f} tokens/ms ({tps / fixed['tokens_per_ms']:.3f}x the best fixed "
            f"budget, {fixed['n']}), tau {tau:.3f}, mean N {mean_n:.1f}, lambda {lam}"
        )
    res = {
        "run": args.run,
        "prompt_set": args.prompt_set,
        "machine": machine(),
        "rounds": len(rounds),
        "verify_ms": cost,
        "draft_ms": draft,
        "fixed": table,
        "dynamic": dict(zip(("tokens_per_ms", "tau", "mean_n", "lambda"), dyn, strict=True)),
        "oracle": dict(zip(("tokens_per_ms", "tau", "mean_n", "lambda"), ora, strict=True)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
