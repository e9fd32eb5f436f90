"""HF causal LMs through `HFTarget.verify`, `crop`, `select`.

Tiny random Llama / Qwen2 built from config objects, saved to a tmp dir and loaded back (no
downloads). Left-padded prompts. Tolerance 1e-5 (fp32; the computations differ in batching).
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import tiny_causal_lm

transformers = pytest.importorskip("transformers")
from vltrain.inference.hf_target import HFTarget  # noqa: E402

V, PAD, BOS, EOS = 96, 0, 1, 2
ATOL = 1e-5
PARENTS = [-1, 0, 0, 1, 1, 2, 3]  # 7 draft nodes; node 6 is a leaf at depth 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # as under `generate`
        yield


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg, cls = tiny_causal_lm(request.param, V, layers=2, max_positions=128)
    path = tmp_path_factory.mktemp(request.param)
    cls(cfg).save_pretrained(path)
    return cls, path


def _load(saved, attn: str = "sdpa") -> HFTarget:
    cls, path = saved
    return HFTarget(cls.from_pretrained(path, attn_implementation=attn).eval())


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.full((3, 1), BOS), torch.randint(3, V, (3, 5), generator=g)], 1)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = PAD, 0  # row 1 left-padded
    return ids, mask


def _tokens(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(3, V, shape, generator=torch.Generator().manual_seed(seed))


def _fresh(target: HFTarget, ids, mask, more):
    """(logits, cache) of a prefill of the prompt followed by the tokens ``more`` (B, n)."""
    full = torch.cat([ids, more], 1)
    logits, cache, _ = target.prefill(
        input_ids=full, attention_mask=torch.cat([mask, torch.ones_like(more)], 1)
    )
    return logits, cache


def _chain(b: int, n: int) -> torch.Tensor:
    """Parents (B, N) of a chain: each node's parent is the node before it."""
    return torch.arange(-1, n - 1).expand(b, -1)


def test_verify_equals_step_by_step(saved) -> None:
    target = _load(saved)
    ids, mask = _prompt()
    draft = _tokens((3, 4), 1)
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    got, vcache, _ = target.verify(draft, _chain(3, 4), cache)
    assert got.shape == (3, 4, V) and got.dtype == torch.float32
    _, scache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    steps = []
    for j in range(4):
        logits, scache = target.step(draft[:, j], scache)
        steps.append(logits)
    torch.testing.assert_close(got, torch.stack(steps, 1), atol=ATOL, rtol=0)
    nxt = _tokens((3,), 2)
    torch.testing.assert_close(
        target.step(nxt, vcache)[0], target.step(nxt, scache)[0], atol=ATOL, rtol=0
    )


def test_cropped_cache_continues_like_a_fresh_prefill(saved) -> None:
    target = _load(saved)
    ids, mask = _prompt()
    draft, nxt = _tokens((3, 4), 3), _tokens((3,), 4)
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    _, cache, _ = target.verify(draft, _chain(3, 4), cache)
    kept = target.crop(cache, ids.shape[1] + 2)  # accept 2 of the 4 draft tokens
    got, _ = target.step(nxt, kept)
    _, fresh = _fresh(target, ids, mask, draft[:, :2])
    ref, _ = target.step(nxt, fresh)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    _, cache, _ = target.verify(draft, _chain(3, 4), cache)
    stale, _ = target.step(nxt, target.crop(cache, ids.shape[1] + 3))
    assert (stale - ref).abs().max() > 1e-3  # negative control: a rejected token left in


def _path(node: int) -> list[int]:
    out = [node]
    while PARENTS[out[-1]] >= 0:
        out.append(PARENTS[out[-1]])
    return out[::-1]


def _tree(b: int) -> torch.Tensor:
    return torch.tensor(PARENTS).expand(b, -1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_verify_gives_every_node_its_chain_logits(saved, attn: str) -> None:
    target = _load(saved, attn)
    ids, mask = _prompt()
    nodes = _tokens((3, len(PARENTS)), 5)
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    got, _, _ = target.verify(nodes, _tree(3), cache)
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    # negative control: a chain over the nodes
    chain, _, _ = target.verify(nodes, _chain(3, len(PARENTS)), cache)
    off_chain = 0.0
    for i in range(len(PARENTS)):
        ref, _ = _fresh(target, ids, mask, nodes[:, _path(i)])
        torch.testing.assert_close(got[:, i], ref, atol=ATOL, rtol=0)
        off_chain = max(off_chain, float((chain[:, i] - ref).abs().max()))
    assert off_chain > 1e-3, "a chain must not reproduce the tree's logits"


def test_select_tree_path_equals_fresh_prefill_of_the_path(saved) -> None:
    target = _load(saved)
    ids, mask = _prompt()
    nodes, nxt = _tokens((3, len(PARENTS)), 6), _tokens((3,), 7)
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    _, cache, _ = target.verify(nodes, _tree(3), cache)
    path = _path(6)  # (0, 1, 3, 6), the same for every row
    index = torch.cat([torch.arange(ids.shape[1]), torch.tensor(path) + ids.shape[1]])
    got, _ = target.step(nxt, target.select(cache, index))
    _, fresh = _fresh(target, ids, mask, nodes[:, path])
    ref, _ = target.step(nxt, fresh)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    _, cache, _ = target.verify(nodes, _tree(3), cache)
    wrong = torch.cat([torch.arange(ids.shape[1]), torch.tensor([0, 2, 5]) + ids.shape[1]])
    bad, _ = target.step(nxt, target.select(cache, wrong))
    assert (bad - ref).abs().max() > 1e-3  # negative control: another path of the tree


@pytest.mark.parametrize(
    "tail",
    [
        [[0, 1, 2]],  # a chain's accepted prefix: nothing moves, the cache is cut
        [[0, 1, 3, 6]],  # a tree path: the tail moves into place
        [[0, 2, 5], [0, 1, 4], [6, 3, 1]],  # rows with different paths
        [[3, 1, 0]],  # out of order: read before written
        [[]],  # nothing accepted past the old cache
    ],
)
def test_select_equals_a_plain_gather(saved, tail) -> None:
    target = _load(saved)
    ids, mask = _prompt()
    nodes = _tokens((3, len(PARENTS)), 8)
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    _, cache, _ = target.verify(nodes, _tree(3), cache)
    old = ids.shape[1]
    rows = torch.tensor(tail, dtype=torch.long).reshape(len(tail), -1).expand(3, -1)
    index = torch.cat([torch.arange(old).expand(3, -1), old + rows], 1)
    want = [
        (
            layer.keys.gather(2, _ix(index, layer.keys)),
            layer.values.gather(2, _ix(index, layer.keys)),
        )
        for layer in cache.kv.layers
    ]
    kept = target.select(cache, index)
    for layer, (k, v) in zip(kept.kv.layers, want, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    assert kept.kv.get_seq_length() == index.shape[1]


def test_select_may_repeat_positions(saved) -> None:
    target = _load(saved)
    ids, mask = _prompt()
    _, cache, _ = target.prefill(input_ids=ids, attention_mask=mask)
    n = ids.shape[1]
    index = torch.cat([torch.arange(n), torch.arange(n)])[None].expand(3, -1)  # 2n > n cached
    want = [layer.keys.gather(2, _ix(index, layer.keys)) for layer in cache.kv.layers]
    kept = target.select(cache, index)
    for layer, k in zip(kept.kv.layers, want, strict=True):
        assert torch.equal(layer.keys, k)


def _ix(index: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return index[:, None, :, None].expand(-1, like.shape[1], -1, like.shape[3])
