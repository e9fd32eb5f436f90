"""Speculative decoding with a block drafter: lossless greedy (chain and DDTree) on the
built-in captioner (batched, both connectors) and tiny random HF Llama / Qwen2; tree walk vs a
reference walk on random trees; the sampling rule against the target's own distribution."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import tiny_causal_lm
from tests.inference import spec_helpers
from vltrain.inference import speculative
from vltrain.inference.captioner_target import CaptionerTarget
from vltrain.inference.hf_target import HFTarget
from vltrain.models.captioner import Captioner

transformers = pytest.importorskip("transformers")

V, PAD, BOS, EOS = spec_helpers.V, spec_helpers.PAD, spec_helpers.BOS, spec_helpers.EOS
BUDGETS = (0, 4, 12)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def hf_model(arch: str, tmp_path, scale: float = 1.0):
    torch.manual_seed(0)
    cfg, cls = tiny_causal_lm(arch)
    cls(cfg).save_pretrained(tmp_path)
    model = cls.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    if scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    return model


def prompts(b: int = 3) -> dict:
    return spec_helpers.left_padded_prompts(b)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_target(request, tmp_path_factory):
    model = hf_model(request.param, tmp_path_factory.mktemp(request.param))
    return HFTarget(model, [0, 1])


@pytest.mark.parametrize(
    ("budget", "shape"), [(b, "chain-first") for b in BUDGETS] + [(5, "best-first")]
)
def test_hf_greedy_is_lossless(hf_target, budget, shape, monkeypatch) -> None:
    inputs = prompts()
    ref = spec_helpers.greedy_reference(HFTarget(hf_target.model), inputs, 24)
    drafter = spec_helpers.random_drafter(hf_target)
    kw = {"tree_budget": budget, "tree_shape": shape}
    out, _ = speculative.speculative_generate(hf_target, drafter, inputs, 24, **kw)
    assert out == ref
    first = inputs["attention_mask"].sum(1).tolist()  # position of the first new token
    monkeypatch.setattr(speculative, "_draft", spec_helpers.oracle_draft(ref, first, V, 0.7))
    out, stats = speculative.speculative_generate(hf_target, drafter, inputs, 24, **kw)
    assert out == ref and stats.tau > 1.5  # long accepted paths exercise the compaction
    # tokens_per_round: what the rounds added to the output (the first token is the prefill's);
    # tau also counts tokens accepted past EOS / the limit, so it is never below it
    assert sum(map(sum, stats.kept)) == sum(len(o) - 1 for o in out)
    assert stats.tokens_per_round <= stats.tau


def test_an_unknown_tree_shape_is_refused(hf_target) -> None:
    drafter = spec_helpers.random_drafter(hf_target)
    with pytest.raises(ValueError, match="tree_shape"):
        speculative.speculative_generate(hf_target, drafter, prompts(), 4, 8, tree_shape="widest")


@pytest.mark.parametrize("budget", BUDGETS)
def test_a_reduced_draft_vocabulary_is_lossless_and_drafts_only_its_tokens(
    hf_target,
    budget,
    monkeypatch,
) -> None:
    inputs = prompts()
    ref = spec_helpers.greedy_reference(HFTarget(hf_target.model), inputs, 24)
    vocab = list(range(1, V, 3))  # a third of the tokens
    drafter = spec_helpers.random_drafter(hf_target, vocab=vocab)
    fed, verify = [], hf_target.verify

    def spy(tokens, parents, cache, **kw):
        fed.append(tokens[:, 1:].clone())  # the drafted nodes (column 0 is the root)
        return verify(tokens, parents, cache, **kw)

    monkeypatch.setattr(hf_target, "verify", spy)
    out, _ = speculative.speculative_generate(hf_target, drafter, inputs, 24, tree_budget=budget)
    assert out == ref
    drafted = set(torch.cat([f.flatten() for f in fed]).tolist())
    assert drafted <= set(vocab) and len(drafted) > 2


def _captioner(connector: str) -> Captioner:
    torch.manual_seed(0)
    opts = {"pool": 2} if connector == "projector" else {"n_latents": 4}
    m = Captioner.from_config(
        vocab_size=V, connector=connector, connector_options=opts, max_text_len=40
    )
    return m.eval()


@pytest.mark.parametrize("connector", ["projector", "gated_xattn"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_captioner_batched_greedy_is_lossless(connector, budget, monkeypatch) -> None:
    model = _captioner(connector)
    target = CaptionerTarget(model, [0, 1])
    images = torch.rand(4, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[PAD, BOS], [BOS, 5], [PAD, BOS], [BOS, 7]])
    inputs = {"images": images, "input_ids": ids, "attention_mask": (ids != PAD).long()}
    ref = spec_helpers.greedy_reference(target, inputs, 20)
    drafter = spec_helpers.random_drafter(target)
    assert (
        speculative.speculative_generate(target, drafter, inputs, 20, tree_budget=budget)[0] == ref
    )
    half = spec_helpers.random_drafter(target, vocab=list(range(0, V, 2)))  # the walk's lazy head
    assert speculative.speculative_generate(target, half, inputs, 20, tree_budget=budget)[0] == ref
    prefix = model.connector.num_prefix_tokens() if model.connector.uses_prefix else 0
    first = (prefix + inputs["attention_mask"].sum(1)).tolist()
    monkeypatch.setattr(speculative, "_draft", spec_helpers.oracle_draft(ref, first, V, 0.7))
    out, stats = speculative.speculative_generate(target, drafter, inputs, 20, tree_budget=budget)
    assert out == ref and stats.tau > 1.5


@pytest.mark.parametrize("budget", [0, 12])
def test_a_finished_row_leaves_the_batch_while_others_decode(budget, monkeypatch) -> None:
    """A row that ends (EOS) leaves the batch, as in greedy ``generate``: later rounds verify,
    draft and compact the rows still decoding only (its cache, drafter context and projected
    context go), and its statistics stop. Before, it stayed to the end (its cache at first
    taking each round's path too: a short caption beside a long one ran its positions past the
    decoder's context length in the drafter stage's eval)."""
    model = _captioner("projector")
    target = CaptionerTarget(model, [0, 1])
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[BOS], [BOS], [BOS]])
    inputs = {"images": images, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    free = spec_helpers.greedy_reference(target, inputs, 24)
    stop = free[0][1]  # row 0 ends after two tokens; the others run on (their text avoids it)
    assert all(stop not in r[:24] for r in free[1:]), "pick another row-0 token"
    target.eos_token_id = stop
    ref = spec_helpers.greedy_reference(target, inputs, 24)
    assert len(ref[0]) == 2 and min(len(r) for r in ref[1:]) > 10
    seen: list[list[int]] = []
    real_verify, real_draft = target.verify, speculative._draft
    first = (model.connector.num_prefix_tokens() + inputs["attention_mask"].sum(1)).tolist()
    oracle = spec_helpers.oracle_draft(ref, first, V, 0.7)
    drafted: list[tuple[int, int, int]] = []  # rows of the context, projected cache, root

    def verify(tokens, parents, cache, **kw):
        seen.append(target.next_positions(cache).tolist())
        return real_verify(tokens, parents, cache, **kw)

    def draft(drafter, ctx, root, anchor, cache):
        drafted.append((len(ctx.features), len(cache.kv[0][0]) if cache.kv else -1, len(root)))
        real_draft(drafter, ctx, root, anchor, cache)  # the drafter's own cache keeps up
        return oracle(drafter, ctx, root, anchor, cache)

    monkeypatch.setattr(target, "verify", verify)
    monkeypatch.setattr(speculative, "_draft", draft)
    out, stats = speculative.speculative_generate(
        target, spec_helpers.random_drafter(target), inputs, 24, budget
    )
    assert out == ref
    rows = [len(pos) for pos in seen]  # rows 1 and 2 end in later rounds, one of them first
    assert rows[:3] == [3, 2, 2] and rows == sorted(rows, reverse=True) and rows[-1] >= 1
    assert drafted[0] == (3, -1, 3) and [d[0] for d in drafted] == rows
    assert all(d == (n, n, n) for d, n in zip(drafted[1:], rows[1:], strict=True))
    assert len(stats.accepted[0]) == 1 and len(stats.anchors[0]) == 1
    assert len(stats.accepted[1]) == len(stats.anchors[1]) > 1
    for i in (1, 2):  # each row's anchors are its own: its first new token's position onward
        assert stats.anchors[i][0] == first[i] and stats.anchors[i] == sorted(stats.anchors[i])


@pytest.mark.parametrize("budget", [0, 12])
def test_a_row_ended_by_its_first_token_never_enters_a_round(hf_target, budget) -> None:
    """A row whose first token (the prefill's) is a stop id leaves before the first round;
    the others decode as greedy does; one new token ends every row without a round."""
    inputs = prompts(4)
    free = spec_helpers.greedy_reference(HFTarget(hf_target.model), inputs, 12)
    row = next(
        (i for i in range(4) if all(free[i][0] not in r for j, r in enumerate(free) if j != i)),
        None,
    )
    assert row is not None, "no row's first token is absent from the others: change the prompts"
    target = HFTarget(hf_target.model, [0, 1])
    target.eos_token_id = free[row][0]
    ref = spec_helpers.greedy_reference(target, inputs, 12)
    assert ref[row] == free[row][:1] and all(len(r) == 12 for j, r in enumerate(ref) if j != row)
    drafter = spec_helpers.random_drafter(target)
    rows: list[int] = []
    real = target.verify

    def verify(tokens, parents, cache, **kw):
        rows.append(len(tokens))
        return real(tokens, parents, cache, **kw)

    target.verify = verify  # this test's own target
    out, stats = speculative.speculative_generate(target, drafter, inputs, 12, budget)
    assert rows and rows[0] == 3  # no round holds it
    assert (
        out == ref
        and stats.accepted[row] == []
        and all(stats.accepted[j] for j in range(4) if j != row)
    )
    out, stats = speculative.speculative_generate(target, drafter, inputs, 1, budget)
    assert out == [r[:1] for r in ref] and stats.rounds == 0 and stats.target_calls == 1


@pytest.mark.parametrize("budget", [0, 12])
def test_a_row_finished_near_the_context_end_is_not_fed_past_it(budget, monkeypatch) -> None:
    """Block 8 in a 16-token caption context, max_new_tokens at the room the CLI leaves: row 0
    accepts whole blocks and ends a block from the end while the others still decode. Its nodes
    used to be fed at its end + depth (up to 7 past the context: "position_ids must lie in
    [0, context_length)", the drafter stage's eval crash at block 16)."""
    torch.manual_seed(0)
    model = Captioner.from_config(
        vocab_size=V, connector="projector", connector_options={"pool": 2}, max_text_len=16
    ).eval()
    target = CaptionerTarget(model, [0, 1])
    images = torch.rand(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[BOS], [BOS], [BOS]])
    inputs = {"images": images, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
    room = model.max_text_len - 1 - 8
    ref = spec_helpers.greedy_reference(target, inputs, room)
    first = (model.connector.num_prefix_tokens() + 1,) * 3
    wrong = [[(t + 1) % V for t in r] for r in ref[1:]]  # rows 1, 2 accept about one a round
    monkeypatch.setattr(
        speculative, "_draft", spec_helpers.oracle_draft([ref[0], *wrong], list(first), V, 1.0)
    )
    out, stats = speculative.speculative_generate(
        target, spec_helpers.random_drafter(target, block_size=8), inputs, room, budget
    )
    assert out == ref and stats.accepted[0][0] >= 7 and len(stats.accepted[1]) > 2


def test_tree_accepts_at_least_the_chain_on_every_prompt(hf_target, monkeypatch) -> None:
    inputs = prompts(4)
    ref = spec_helpers.greedy_reference(HFTarget(hf_target.model), inputs, 40)
    first = inputs["attention_mask"].sum(1).tolist()
    drafter = spec_helpers.random_drafter(hf_target, block_size=6)
    taus = {}
    for budget in (0, 16):
        oracle = spec_helpers.oracle_draft(ref, first, V, 0.6, seed=1)
        monkeypatch.setattr(speculative, "_draft", oracle)
        out, stats = speculative.speculative_generate(
            hf_target, drafter, inputs, 40, tree_budget=budget
        )
        assert out == ref
        taus[budget] = stats.row_tau()
    assert all(t >= c for t, c in zip(taus[16], taus[0], strict=True)), taus
    assert sum(taus[16]) >= 1.2 * sum(taus[0]), taus


def _reference_walk(tokens, parents, choose):
    """The parent-based oracle: scan all nodes for a child of the current node with the
    target's token (first in node order), as a brute-force reference."""
    path, node = [], -1
    while True:
        want = choose(node)
        kids = [i for i in range(len(tokens)) if parents[i] == node and tokens[i] == want]
        if not kids:
            return path, want
        path.append(kids[0])
        node = kids[0]


def test_tree_walk_matches_a_reference_walk_on_random_trees() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = []
    for _ in range(200):
        n = int(torch.randint(1, 24, (), generator=g))
        parents = [int(torch.randint(-1, i, (), generator=g)) if i else -1 for i in range(n)]
        tokens = torch.randint(0, 4, (n,), generator=g).tolist()
        choice = torch.randint(0, 4, (n + 1,), generator=g).tolist()
        got = speculative.accept_walk(
            torch.tensor(tokens), torch.tensor(parents), lambda x, c=choice: c[x + 1]
        )
        assert got == _reference_walk(tokens, parents, lambda x, c=choice: c[x + 1])
        lengths.append(len(got[0]))
    assert max(lengths) >= 3  # the walks went deep, not only root misses


class _SubHead:
    """A drafter's side of the lazy greedy walk: its vocabulary ``ids`` (of the head's rows);
    ``scored`` holds the states each completion scored over the rest of the head."""

    def __init__(self, head: torch.Tensor, ids: torch.Tensor) -> None:
        self.head, self.ids, self.scored = head, ids, []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.head[self.ids].T

    def to_token(self, idx: torch.Tensor) -> torch.Tensor:
        return self.ids[idx]

    def complete_logits(self, hidden: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        self.scored.append(hidden)
        full = hidden @ self.head.T
        assert torch.allclose(full[:, self.ids], sub, atol=1e-5)
        return full


def test_greedy_walks_score_the_visited_nodes_and_equal_full_vocabulary_walks() -> None:
    """``_greedy_walks`` (the whole head on visited nodes only) returns exactly the walk over
    every node's full-vocabulary argmax, on random trees whose children often carry the
    target's choice and whose choices often lie outside the draft vocabulary (a walk cut
    short on the draft vocabulary's argmax is walked again)."""
    g = torch.Generator().manual_seed(0)
    vocab, width = 40, 16
    head = torch.randn(vocab, width, generator=g)
    passes_over_one = deep = scored = nodes = 0
    for _ in range(150):
        b, n = 3, int(torch.randint(2, 20, (), generator=g))
        hidden = torch.randn(b, 1 + n, width, generator=g)
        choice = (hidden @ head.T).argmax(-1)  # (B, 1 + N): the target's full-vocabulary argmax
        par = torch.full((b, 1 + n), -1)
        for k in range(1, 1 + n):  # fed index k hangs off an earlier fed index (0 = the root)
            par[:, k] = torch.randint(0, k, (b,), generator=g)
        toks = torch.randint(0, vocab, (b, 1 + n), generator=g)
        carry = torch.rand(b, 1 + n, generator=g) < 0.7  # a child carries its parent's choice
        for i, k in carry[:, 1:].nonzero().tolist():
            toks[i, k + 1] = choice[i, int(par[i, k + 1])]
        drafter = _SubHead(head, torch.randperm(vocab, generator=g)[: vocab // 2])
        got = speculative._greedy_walks(drafter, toks, par, hidden)
        passes_over_one += len(drafter.scored) > 1
        rows = torch.cat(drafter.scored)  # which (row, fed index) each scored state is
        which = [
            tuple(divmod(int((hidden.flatten(0, 1) == r).all(-1).nonzero()), 1 + n)) for r in rows
        ]
        assert len(set(which)) == len(which)  # no node scored twice
        scored, nodes = scored + len(which), nodes + b * (1 + n)
        for i in range(b):
            assert {(i, k) for k in got[i][0]} <= set(which)  # each visited node: full head
            c = choice[i].tolist()
            path, bonus = _reference_walk(
                toks[i, 1:].tolist(), (par[i, 1:] - 1).tolist(), lambda x, c=c: c[x + 1]
            )
            assert got[i] == ([0] + [p + 1 for p in path], bonus)
            deep += len(path) >= 3
    assert passes_over_one > 10 and deep > 20  # re-walks and deep walks were exercised
    assert scored < nodes / 2  # the whole head on a minority of the nodes


def test_a_best_first_ddtree_holds_the_best_scored_paths() -> None:
    """Without the chain placed first, the tree is the ``budget`` paths of highest score: every
    node outside it scores at most the tree's lowest (DDTree's own construction)."""
    g = torch.Generator().manual_seed(3)
    logq = torch.log_softmax(3 * torch.randn(6, 25, generator=g), -1)
    tokens, parents = speculative.ddtree(logq, 20, chain_first=False)
    assert all(p < i for i, p in enumerate(parents.tolist()))
    score: list[float] = []
    depth: list[int] = []
    for t, p in zip(tokens.tolist(), parents.tolist(), strict=True):
        depth.append(0 if p < 0 else depth[p] + 1)
        score.append((score[p] if p >= 0 else 0.0) + float(logq[depth[-1], t]))
    lowest = min(score)
    for k in range(-1, 20):  # every child left out of the tree scores no more than the lowest
        d = depth[k] + 1 if k >= 0 else 0
        if d < 6:
            kids = {t for t, p in zip(tokens.tolist(), parents.tolist(), strict=True) if p == k}
            best_out = max(float(logq[d, v]) for v in range(25) if v not in kids)
            assert (score[k] if k >= 0 else 0.0) + best_out <= lowest + 1e-6
    chain, _ = speculative.chain_tree(logq)
    assert (
        speculative.ddtree(logq, 20)[0][:6].tolist() == chain.tolist()
    )  # the default places it first


def test_ddtree_is_prefix_closed_and_holds_the_chain() -> None:
    logq = torch.log_softmax(torch.randn(5, 30, generator=torch.Generator().manual_seed(0)), -1)
    tokens, parents = speculative.ddtree(logq, 16)
    assert len(tokens) == 16 and all(p < i for i, p in enumerate(parents.tolist()))
    chain, _ = speculative.chain_tree(logq)
    assert tokens[:5].tolist() == chain.tolist() and parents[:5].tolist() == [-1, 0, 1, 2, 3]
    seen = {(int(p), int(t)) for p, t in zip(parents, tokens, strict=True)}
    assert len(seen) == 16  # no duplicate child


def test_every_prefix_of_a_ddtree_is_the_ddtree_of_that_size() -> None:
    """bench_tree_budget.py reads each smaller budget's acceptance off one large-budget round."""
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        logq = torch.log_softmax(3 * torch.randn(7, 40, generator=g), -1)
        big_t, big_p = speculative.ddtree(logq, 64)
        for n in (7, 8, 11, 16, 24, 32, 48):
            t, p = speculative.ddtree(logq, n)
            assert big_t[:n].tolist() == t.tolist() and big_p[:n].tolist() == p.tolist(), n


def _spec_sample_counts(target, drafter, n: int, accept_all: bool, monkeypatch) -> torch.Tensor:
    if accept_all:  # the bug: drafts kept whatever the target thinks
        monkeypatch.setattr(speculative, "rejection_step", lambda p, q, x, g: x)
    ids = torch.tensor([[BOS, 5, 9]]).expand(n, -1)
    gen = torch.Generator().manual_seed(0)
    out, _ = speculative.speculative_generate(
        target, drafter, {"input_ids": ids}, 3, sample=True, generator=gen
    )
    pairs = torch.tensor([r[1] for r in out])  # the second token: a drafted one
    return torch.bincount(pairs, minlength=V).double()


@pytest.mark.slow
def test_sampling_follows_the_target_distribution(tmp_path, monkeypatch) -> None:
    model = hf_model("llama", tmp_path, scale=25.0)  # a peaked target, far from the drafter
    target = HFTarget(model, [0, 1])
    ids = torch.tensor([[BOS, 5, 9]])
    with torch.no_grad():
        p1 = torch.softmax(model(ids).logits[0, -1].float(), -1)  # (V,)
        nxt = torch.cat([ids.expand(V, -1), torch.arange(V)[:, None]], 1)
        p2 = torch.softmax(model(nxt).logits[:, -1].float(), -1)  # (V, V)
    exact = p1 @ p2  # the target's distribution of its second token
    n = 3000
    # the full vocabulary, and a reduced draft vocabulary (half the tokens: q = 0 elsewhere)
    for vocab in (None, list(range(0, V, 2))):
        drafter = spec_helpers.random_drafter(target, block_size=3, vocab=vocab)
        tv = {}
        for bug in (False, True):
            counts = _spec_sample_counts(target, drafter, n, bug, monkeypatch)
            tv[bug] = 0.5 * float((counts / n - exact).abs().sum())
            monkeypatch.undo()
        # 3000 draws over ~a dozen likely tokens: sampling noise in TV is ~0.03
        assert tv[False] < 0.06, (vocab, tv)
        assert tv[True] > 3 * tv[False] and tv[True] > 0.1, (vocab, tv)
