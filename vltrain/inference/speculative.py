"""Speculative decoding with a block drafter: chain and DDTree tree verification, batched.

One round per row: the drafter reads the target's features of every accepted position and
proposes a block after the last accepted token (the root, already emitted but not yet fed to the
target); the proposal is a chain (the drafter's argmax per slot) or a DDTree (arXiv 2604.12989:
best-first over the per-slot log-probabilities under a node budget; by default seeded with the
argmax chain so it never holds less than the chain, ``tree_shape="best-first"`` for the paper's
unseeded tree). The target (a ``DecodeTarget``, ``vltrain.inference.target``) scores root +
nodes in ONE forward
under the ancestor-only mask with positions by depth; the walk follows the target's own choice
from the root while it matches a child; the cache and the drafter context are compacted to the
accepted path. Emitted tokens are the accepted nodes plus the target's next token, cut at EOS
and ``max_new_tokens``: never filtered by value.
A row that ends leaves the batch (its cache, drafter context and projected context), as in
greedy ``generate``: a round costs the rows still decoding.

Greedy output equals the target's own greedy decoding token for token (lossless). Sampling
(chain only) uses the standard rejection rule: accept draft x with probability
``min(1, p(x) / q(x))``, else sample from ``norm(max(p - q, 0))``; the output is distributed as
the target's own samples.

tau (``SpecStats.tau``) = mean over rounds of accepted draft tokens + 1, the convention of DFlash
and DDTree (a round that accepts past an EOS or the length limit counts those tokens too);
``SpecStats.tokens_per_round`` counts what was emitted, after those cuts: what the speed-up
follows (on short outputs, such as captions, the two differ by a third and can rank a chain
above a tree that emits more).
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from vltrain.inference.target import Context, DecodeTarget, stop_ids
from vltrain.models.drafter import DraftContextCache, Drafter

TREE_SHAPES = ("chain-first", "best-first")
PHASES = ("draft", "verify", "walk", "compact")
"""A round's parts as ``timed`` decoding records them: the drafter call and its proposal (chain
or tree, mapped to token ids); the target's verify forward; the acceptance walk (the LM head on
the visited nodes of a draft-vocabulary drafter) and the emission; the cache and drafter-context
compaction to the accepted paths."""


class _Laps:
    """Seconds since the previous lap, into the current round's dict of ``stats.phases``; each
    lap synchronizes an accelerator first (so timing slows GPU decoding: measuring only)."""

    def __init__(self, stats: SpecStats, device: torch.device, on: bool) -> None:
        self.stats, self.on, self.t = stats, on, 0.0
        self.cuda = on and device.type == "cuda"

    def start(self) -> None:
        if self.on:
            self.stats.phases.append({})
            self.t = self._now()

    def lap(self, phase: str) -> None:
        if self.on:
            now = self._now()
            self.stats.phases[-1][phase] = now - self.t
            self.t = now

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class SpecStats:
    """Acceptance statistics of one speculative run, per row."""

    accepted: list[list[int]] = field(default_factory=list)
    """Per row, per round: accepted draft tokens + 1."""
    kept: list[list[int]] = field(default_factory=list)
    """Per row, per round: the tokens the round added to the output (cut at EOS / the limit)."""
    anchors: list[list[int]] = field(default_factory=list)
    """Per row, per round: position of the round's root (the block anchor)."""
    target_calls: int = 0
    """Target forwards (prefill + verifications)."""
    phases: list[dict[str, float]] = field(default_factory=list)
    """Per round, with ``speculative_generate(timed=True)``: seconds of each of `PHASES`."""

    @property
    def rounds(self) -> int:
        return sum(len(a) for a in self.accepted)

    @property
    def tau(self) -> float:
        """Mean acceptance length over all rounds of all rows."""
        return sum(map(sum, self.accepted)) / max(self.rounds, 1)

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens a round added to the output, after EOS / length cuts."""
        return sum(map(sum, self.kept)) / max(self.rounds, 1)

    def row_tau(self) -> list[float]:
        return [sum(a) / max(len(a), 1) for a in self.accepted]

    def to_dict(self) -> dict[str, Any]:
        return {
            "tau": self.tau,
            "tokens_per_round": self.tokens_per_round,
            "rounds": self.rounds,
            "target_calls": self.target_calls,
            "row_tau": self.row_tau(),
        }


def chain_tree(logq: Tensor) -> tuple[Tensor, Tensor]:
    """The argmax chain of per-slot log-probs (D, V): tokens (D,), parents [-1, 0, 1, ...]."""
    d = logq.shape[0]
    return logq.argmax(-1), torch.arange(-1, d - 1, device=logq.device)


def ddtree(logq: Tensor, budget: int, chain_first: bool = True) -> tuple[Tensor, Tensor]:
    """Best-first tree of ``budget`` nodes over per-slot log-probs (D, V).

    A node's score is the sum of log q over its path (slots are independent given the context,
    as in a DFlash block). Each pop adds a node and pushes its next sibling and first child, so
    the tree is prefix-closed and topologically ordered. With ``chain_first`` the argmax chain
    (min(D, budget) nodes) is placed first. Returns tokens (N,) and parents (N,) (-1 = root).
    """
    depth = logq.shape[0]
    width = min(budget, logq.shape[1])
    vals, idx = logq.float().topk(width, dim=-1)  # (D, width)
    vals, idx = vals.tolist(), idx.tolist()
    tokens: list[int] = []
    parents: list[int] = []
    # children[(parent, rank)] -> node, to skip ranks the chain already placed
    placed: dict[tuple[int, int], int] = {}
    if chain_first:
        for d in range(min(depth, budget)):
            placed[(d - 1, 0)] = d
            tokens.append(idx[d][0])
            parents.append(d - 1)
    heap: list[tuple[float, int, int, int, float]] = [(-vals[0][0], 0, 0, -1, 0.0)]
    # entries: (-score, depth, rank, parent node, parent score)
    while heap and len(tokens) < budget:
        neg, d, r, parent, pscore = heapq.heappop(heap)
        node = placed.get((parent, r))
        if node is None:
            node = len(tokens)
            tokens.append(idx[d][r])
            parents.append(parent)
        if r + 1 < width:
            heapq.heappush(heap, (-(pscore + vals[d][r + 1]), d, r + 1, parent, pscore))
        if d + 1 < depth:
            heapq.heappush(heap, (-(-neg + vals[d + 1][0]), d + 1, 0, node, -neg))
        placed[(parent, r)] = node
    # chain nodes have (parent, rank 0) keys keyed by depth-1 parent: children of chain nodes
    return torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)


def accept_walk(tokens: Tensor, parents: Tensor, choose) -> tuple[list[int], int]:
    """Follow the target from the root: ``choose(node)`` -> its token after node (-1 = root).

    Returns the accepted node indices (root excluded) and the target's token after the last.
    """
    children: dict[tuple[int, int], int] = {}
    for i, (t, p) in enumerate(zip(tokens.tolist(), parents.tolist(), strict=True)):
        children.setdefault((p, t), i)
    path, node = [], -1
    while True:
        nxt = choose(node)
        child = children.get((node, nxt))
        if child is None:
            return path, nxt
        path.append(child)
        node = child


def rejection_step(p: Tensor, q: Tensor, x: int, gen: torch.Generator | None) -> int | None:
    """Standard speculative sampling: keep draft x ~ q with prob min(1, p(x)/q(x)); else None."""
    u = torch.rand((), generator=gen, device=p.device)
    if float(u) * float(q[x]) <= float(p[x]):
        return x
    return None


def residual_sample(p: Tensor, q: Tensor, gen: torch.Generator | None) -> int:
    """A sample from norm(max(p - q, 0)) (p itself if the residual vanishes)."""
    r = (p - q).clamp(min=0)
    r = p if float(r.sum()) <= 0 else r
    return int(torch.multinomial(r / r.sum(), 1, generator=gen))


@dataclass
class _Rows:
    """Per-row decoding state."""

    out: list[list[int]]
    done: list[bool]


def _draft(
    drafter: Drafter, ctx: Context, root: Tensor, anchor_pos: Tensor, cache: DraftContextCache
) -> Tensor:
    """Per-slot draft log-probs (B, K - 1, V') of the block after each row's root; V' is the
    draft vocabulary (``drafter.to_token`` maps its indices to token ids)."""
    h = drafter(
        ctx.features, ctx.positions, ctx.valid, root[:, None], anchor_pos[:, None], cache=cache
    )
    logits = drafter.logits(h[:, 0, 1:]).float()  # (B, K - 1, V')
    return torch.log_softmax(logits, dim=-1)


def _proposals(
    logq: Tensor,
    budget: int,
    sample: bool,
    gen,
    chain_first: bool = True,
) -> tuple[Tensor, Tensor]:
    """Tokens and parents (B, N) of every row's proposal (chain or tree)."""
    rows = []
    for lq in logq:
        if sample:
            toks = torch.multinomial(lq.exp(), 1, generator=gen)[:, 0]
            rows.append((toks, torch.arange(-1, len(toks) - 1)))
        elif budget > 0:
            rows.append(ddtree(lq, budget, chain_first))
        else:
            rows.append(chain_tree(lq))
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


@torch.no_grad()
def speculative_generate(
    target: DecodeTarget,
    drafter: Drafter,
    inputs: dict[str, Any],
    max_new_tokens: int = 32,
    tree_budget: int = 0,
    sample: bool = False,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    tree_shape: str = "chain-first",
    timed: bool = False,
) -> tuple[list[list[int]], SpecStats]:
    """Decode every row of ``inputs`` (as ``target.prefill`` takes them) with the drafter.

    ``tree_budget`` 0 verifies the chain of the block's K - 1 slots; N > 0 a DDTree of N
    nodes, ``tree_shape`` "chain-first" (the argmax chain placed first: a round never accepts
    fewer tokens than the chain would) or "best-first" (DDTree's own: the N nodes of highest
    path score; more tokens per round on average, no per-round guarantee). Returns the new
    tokens per row (EOS included) and the acceptance statistics; ``timed`` also records each
    round's `PHASES` in ``stats.phases`` (what ``vltrain generate --spec auto`` prices).
    """
    if tree_shape not in TREE_SHAPES:
        raise ValueError(f"tree_shape must be one of {TREE_SHAPES}, not {tree_shape!r}")
    if sample and tree_budget:
        raise ValueError("sampling verifies a chain; use tree_budget=0 with sample=True")
    stops = set(stop_ids(target))
    logits, cache, ctx = target.prefill(**inputs)
    stats = SpecStats(target_calls=1)
    b = logits.shape[0]
    stats.accepted, stats.anchors = [[] for _ in range(b)], [[] for _ in range(b)]
    stats.kept = [[] for _ in range(b)]
    root = _pick(logits, sample, temperature, generator)  # (B,)
    dcache = DraftContextCache()  # the drafter projects each context row once
    lazy = not sample and drafter.cfg.draft_vocab > 0  # the head on walked nodes only
    rows = _Rows([[int(t)] for t in root], [int(t) in stops or max_new_tokens <= 1 for t in root])
    live = list(range(b))  # the rows the batch holds, in its order (original indices)
    laps = _Laps(stats, root.device, timed)
    root, cache, ctx, live = _drop_finished(target, rows, root, cache, ctx, dcache, live)
    while live:
        laps.start()
        anchor = target.next_positions(cache).to(root.device)  # (B',)
        logq = _draft(drafter, ctx, root, anchor, dcache)
        if sample:  # the rejection rule compares p and q token by token: q over the whole vocab
            logq = drafter.full_vocab(logq)
        toks, parents = _proposals(
            logq, tree_budget, sample, generator, tree_shape == "chain-first"
        )
        if not sample:
            toks = drafter.to_token(toks.to(root.device))
        laps.lap("draft")
        fed = torch.cat([root[:, None], toks.to(root.device)], 1)  # (B', 1 + N)
        fed_par = torch.cat([torch.full_like(parents[:, :1], -1), parents + 1], 1)
        fed_par[:, 1:] = fed_par[:, 1:].masked_fill(parents < 0, 0)
        n_old = _cache_len(cache)
        scores, cache, new_ctx = target.verify(fed, fed_par.to(root.device), cache, logits=not lazy)
        stats.target_calls += 1
        laps.lap("verify")
        walks = _greedy_walks(drafter, fed, fed_par, scores) if lazy else None
        paths, nxt = [], []
        for j, i in enumerate(live):  # j: the row in the batch, i: the prompt it decodes
            if walks is not None:
                path, bonus = walks[j]
            else:
                path, bonus = _walk_row(
                    j, fed, fed_par, scores, logq, sample, temperature, generator
                )
            paths.append(path)
            nxt.append(bonus)
            stats.accepted[i].append(len(path))
            stats.anchors[i].append(int(anchor[j]))
            n_out = len(rows.out[i])
            _emit(rows, i, [int(fed[j, n]) for n in path[1:]] + [bonus], stops, max_new_tokens)
            stats.kept[i].append(len(rows.out[i]) - n_out)
        laps.lap("walk")
        cache, ctx = _compact(target, cache, n_old, ctx, new_ctx, paths)
        root = torch.tensor(nxt, dtype=torch.long, device=root.device)
        root, cache, ctx, live = _drop_finished(target, rows, root, cache, ctx, dcache, live)
        laps.lap("compact")
    return rows.out, stats


def _pick(logits: Tensor, sample: bool, temperature: float, gen) -> Tensor:
    if not sample:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]


def _walk_row(i, fed, fed_par, tlogits, logq, sample, temperature, gen):
    """Accepted fed indices of row i (root first) and the target's token after them."""
    if not sample:
        choice = tlogits[i].max(-1).indices.tolist()  # (1 + N,): argmax, first of ties
        path, bonus = accept_walk(fed[i, 1:], fed_par[i, 1:] - 1, lambda n: choice[n + 1])
        return [0] + [n + 1 for n in path], bonus
    path = [0]
    for k in range(1, fed.shape[1]):  # a chain: node k is slot k - 1
        p = torch.softmax(tlogits[i, k - 1] / temperature, -1)
        q = logq[i, k - 1].exp()
        if rejection_step(p, q, int(fed[i, k]), gen) is None:
            return path, residual_sample(p, q, gen)
        path.append(k)
    p = torch.softmax(tlogits[i, path[-1]] / temperature, -1)
    return path, int(torch.multinomial(p, 1, generator=gen))


def _greedy_walks(drafter, fed, fed_par, hidden):
    """Every row's greedy walk (accepted fed indices, root first; the target's token after
    them) from the verify's final hidden states (B, 1 + N, W), with the LM head over the whole
    vocabulary on the nodes the walk visits only.

    A walk reads the target's argmax at the nodes it visits only (about tau of them), while
    logits from the verify put all 1 + N nodes through the full head. Here every node is
    first scored over the drafter's vocabulary (its
    rows of the same head: a third of it at 16,384 tokens) and the walk follows those
    argmaxes; then the visited nodes are scored over the head's other rows and the walk is
    repeated until every node it visits carries its full-vocabulary argmax. The result is
    exactly the walk over full-vocabulary argmaxes, whatever the draft vocabulary: a choice
    outside it either ends the walk (no drafted child carries it) or, when a child does,
    sends the next pass down that child. One pass in the common case, two when a visited
    node's argmax lies outside the draft vocabulary. The head's weight is still read once a
    round, so this pays where its product is the cost (batched rounds: ~1.15x a round at batch
    16 on SmolLM2-135M, 32 nodes) rather than its read (batch 1 on a CPU: no change).
    """
    sub = drafter.logits(hidden)  # (B, 1 + N, draft_vocab)
    approx = drafter.to_token(sub.argmax(-1)).tolist()  # (B, 1 + N) token ids
    exact: dict[tuple[int, int], int] = {}
    while True:
        walks, need = [], []
        for i in range(fed.shape[0]):
            seen: list[int] = []  # fed indices whose choice the walk read

            def choose(node: int, i: int = i, seen: list[int] = seen) -> int:  # -1: the root
                seen.append(node + 1)
                return exact.get((i, node + 1), approx[i][node + 1])

            path, bonus = accept_walk(fed[i, 1:], fed_par[i, 1:] - 1, choose)
            walks.append(([0] + [n + 1 for n in path], bonus))
            need += [(i, k) for k in seen if (i, k) not in exact]
        if not need:
            return walks
        at = ([i for i, _ in need], [k for _, k in need])
        full = drafter.complete_logits(hidden[at], sub[at]).argmax(-1).tolist()  # first of ties
        exact.update(zip(need, full, strict=True))


def _emit(rows: _Rows, i: int, new: list[int], stops: set[int], max_new: int) -> None:
    """Append accepted tokens to row i, stopping at any stop id or the length limit."""
    for t in new:
        if rows.done[i]:
            return
        rows.out[i].append(t)
        rows.done[i] = t in stops or len(rows.out[i]) >= max_new


def _drop_finished(target, rows: _Rows, root, cache, ctx: Context, dcache, live: list[int]):
    """The batch without its finished rows (greedy ``generate`` drops them the same way): a
    finished row's cache, drafter context and projected context leave the batch, so a round
    costs the rows still decoding, not the batch it started with."""
    keep = [j for j, i in enumerate(live) if not rows.done[i]]
    if len(keep) == len(live):
        return root, cache, ctx, live
    live = [live[j] for j in keep]
    if not live:
        return root, cache, ctx, live
    idx = torch.tensor(keep, dtype=torch.long, device=root.device)
    cache = target.reorder(cache, idx)
    at = idx.to(ctx.features.device)
    ctx = Context(ctx.features[at], ctx.positions[at], ctx.valid[at])
    dcache.kv = [(k[at.to(k.device)], v[at.to(v.device)]) for k, v in dcache.kv]
    return root[idx], cache, ctx, live


def _compact(target: DecodeTarget, cache, n_old: int, ctx: Context, new_ctx: Context, paths):
    """Keep the ``n_old`` cached positions and each row's accepted path; extend the context."""
    width = max(len(p) for p in paths)
    dev = new_ctx.features.device
    idx = torch.zeros(len(paths), width, dtype=torch.long, device=dev)
    valid = torch.zeros(len(paths), width, dtype=torch.bool, device=dev)
    for i, p in enumerate(paths):
        idx[i, : len(p)] = torch.tensor(p, device=dev)
        valid[i, : len(p)] = True
    keep_idx = torch.cat([torch.arange(n_old, device=dev).expand(len(paths), -1), n_old + idx], 1)
    keep_valid = torch.cat([torch.ones(len(paths), n_old, dtype=torch.bool, device=dev), valid], 1)
    cache = target.select(cache, keep_idx, keep_valid)
    g = idx[:, :, None].expand(-1, -1, new_ctx.features.shape[-1])
    add = Context(new_ctx.features.gather(1, g), new_ctx.positions.gather(1, idx), valid)
    return cache, ctx.extend(add)


def _cache_len(cache) -> int:
    kv = getattr(cache, "kv", cache)
    if hasattr(kv, "length"):
        return int(kv.length)
    return int(kv.get_seq_length())
