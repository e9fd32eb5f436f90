"""Guards for the silent failures drafter trainers hit, each run against a buggy fixture too.

Each check is a function of the implementation under test; the clean implementation passes and
a fixture carrying the bug must fail the same check (so no check is vacuous).
"""

from __future__ import annotations

import pytest
import torch

from vltrain.data.chat import IGNORE_INDEX
from vltrain.models.drafter import (
    Drafter,
    DrafterConfig,
    SharedParts,
    draft_attention_mask,
    target_layer_ids,
)
from vltrain.objectives.drafter import block_labels, default_gamma, position_weights

W, V, K = 16, 40, 4


def _drafter(seed: int = 0) -> Drafter:
    torch.manual_seed(seed)
    emb = torch.nn.Embedding(V, W)
    head = torch.nn.Linear(W, V, bias=False)
    cfg = DrafterConfig(
        width=W, vocab_size=V, target_layer_ids=[0, 1], heads=2, block_size=K, mask_token_id=7
    )
    return Drafter(cfg).share(SharedParts(emb, head)).eval()


def _inputs(s: int = 12):
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(1, s, 2 * W, generator=g)
    pos = torch.arange(s)[None]
    return feats, pos, torch.ones(1, s, dtype=torch.bool)


def _leak_mask(anchor_pos, ctx_pos, ctx_valid, k):
    """The bug: the context visible up to and including the anchor."""
    b, j = anchor_pos.shape
    m = draft_attention_mask(anchor_pos, ctx_pos, ctx_valid, k).clone()
    ctx = ctx_valid[:, None, :] & (ctx_pos[:, None, :] <= anchor_pos[:, :, None])
    m[:, 0, :, : ctx_pos.shape[1]] = ctx.repeat_interleave(k, 1)
    return m


def _block_id_mask(anchor_pos, ctx_pos, ctx_valid, k):
    """The SpecForge #470 bug: blocks see each other by block id (earlier blocks' slots)."""
    m = draft_attention_mask(anchor_pos, ctx_pos, ctx_valid, k).clone()
    n = anchor_pos.shape[1] * k
    blk = torch.arange(n) // k
    m[:, 0, :, ctx_pos.shape[1] :] = blk[None, :] <= blk[:, None]
    return m


def _causal_mask(anchor_pos, ctx_pos, ctx_valid, k):
    """The SpecForge #427 bug: a causal block."""
    m = draft_attention_mask(anchor_pos, ctx_pos, ctx_valid, k).clone()
    n = anchor_pos.shape[1] * k
    i = torch.arange(n)
    m[:, 0, :, ctx_pos.shape[1] :] &= i[None, :] <= i[:, None]
    return m


def check_no_context_leak(mask_fn) -> None:
    """Block j's outputs ignore the context at and after its anchor, and the other blocks."""
    d = _drafter()
    feats, pos, valid = _inputs()
    a_ids, a_pos = torch.tensor([[3, 9, 11]]), torch.tensor([[4, 5, 8]])  # overlapping blocks
    out = d(feats, pos, valid, a_ids, a_pos, mask_fn=mask_fn)
    poked = feats.clone()
    poked[:, 5:] += 3.0  # at/after block 1's anchor (position 5)
    alone = d(poked[:, :5], pos[:, :5], valid[:, :5], a_ids[:, 1:2], a_pos[:, 1:2], mask_fn=mask_fn)
    torch.testing.assert_close(out[:, 1], alone[:, 0], atol=1e-5, rtol=0)


def check_bidirectional(mask_fn) -> None:
    """An early slot depends on a later slot of its block (the block is not causal)."""
    d = _drafter()
    feats, pos, valid = _inputs()
    a_ids, a_pos = torch.tensor([[3]]), torch.tensor([[6]])
    base = d(feats, pos, valid, a_ids, a_pos, mask_fn=mask_fn)
    orig = d.block_inputs

    def poked(ids):
        x = orig(ids)
        x[:, -1] += 1.0
        return x

    d.block_inputs = poked
    moved = d(feats, pos, valid, a_ids, a_pos, mask_fn=mask_fn)
    assert (moved[0, 0, 1] - base[0, 0, 1]).abs().max() > 1e-4


def test_no_cross_block_context_leak() -> None:
    check_no_context_leak(draft_attention_mask)
    for bug in (_leak_mask, _block_id_mask):
        with pytest.raises(AssertionError):
            check_no_context_leak(bug)


def test_block_is_bidirectional() -> None:
    check_bidirectional(draft_attention_mask)
    with pytest.raises(AssertionError):
        check_bidirectional(_causal_mask)


def check_labels(label_fn) -> None:
    """Slot k of anchor a is token a + k (tokens = their own positions here); slot 0 no loss."""
    t = 20
    labels = torch.arange(t)[None].clone()
    labels[0, :3] = IGNORE_INDEX  # a prompt
    anchors = torch.tensor([[3, 10, 17]])
    lab, ok = label_fn(labels, anchors, torch.ones_like(anchors, dtype=torch.bool), K)
    for j, a in enumerate(anchors[0].tolist()):
        for k in range(K):
            if k == 0 or a + k >= t:
                assert not ok[0, j, k]
            else:
                assert ok[0, j, k] and int(lab[0, j, k]) == a + k


def test_label_alignment() -> None:
    check_labels(block_labels)

    def shifted(labels, anchors, valid, k):
        return block_labels(labels, anchors + 1, valid, k)

    with pytest.raises(AssertionError):
        check_labels(shifted)


def check_mask_by_position(drafter: Drafter) -> None:
    """An anchor whose id equals mask_token_id keeps its token embedding."""
    ids = torch.tensor([[drafter.cfg.mask_token_id, 5]])
    x = drafter.block_inputs(ids).view(1, 2, K, W)
    emb = drafter.shared.embed(ids)
    torch.testing.assert_close(x[:, :, 0], emb)
    assert torch.equal(x[0, 0, 1], drafter.mask_embed.detach())


def test_mask_token_collision_in_inputs() -> None:
    d = _drafter()
    with torch.no_grad():
        d.mask_embed.add_(1.0)  # distinct from the id's embedding, as after training
    check_mask_by_position(d)

    def by_value(ids):
        full = torch.full((ids.shape[0], ids.shape[1], K), d.cfg.mask_token_id)
        full[:, :, 0] = ids
        e = d.shared.embed(full)
        return torch.where((full == d.cfg.mask_token_id)[..., None], d.mask_embed, e).flatten(1, 2)

    d.block_inputs = by_value
    with pytest.raises(AssertionError):
        check_mask_by_position(d)


def test_layer_rule_and_gamma_rule() -> None:
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B in DFlash / SpecForge
    assert target_layer_ids(30, 1) == [15]
    assert target_layer_ids(2, 2) == [0, 1]
    assert default_gamma(8) == 4.0 and default_gamma(16) == 7.0
    w = position_weights(16, default_gamma(16))
    assert (
        w[0] == 0 and w[1] == 1 and abs(float(w[8]) - torch.exp(torch.tensor(-1.0)).item()) < 1e-6
    )


def test_context_cache_equals_the_full_context() -> None:
    """Decoding's DraftContextCache: the context grows (prompt, then accepted rows, some
    padding on batch rows); projecting only the new rows gives the drafter's full-context
    outputs. Negative control: new keys not rotated by their own positions differ."""
    from vltrain.models.drafter import DraftContextCache

    d = _drafter()
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 14, 2 * W, generator=g)
    pos = torch.arange(14).expand(2, -1).clone()
    valid = torch.ones(2, 14, dtype=torch.bool)
    valid[1, 9:11] = False  # a row that accepted fewer tokens in a round: padded slots
    cache = DraftContextCache()
    for s in (5, 9, 11, 14):  # rounds
        a_ids, a_pos = torch.tensor([[3], [8]]), torch.tensor([[s], [s]])
        args = (feats[:, :s], pos[:, :s], valid[:, :s], a_ids, a_pos)
        torch.testing.assert_close(d(*args, cache=cache), d(*args), atol=1e-5, rtol=0)
        assert cache.n == s
    with pytest.raises(ValueError, match="shrank"):
        d(feats[:, :5], pos[:, :5], valid[:, :5], a_ids, a_pos, cache=cache)

    bad, layer = DraftContextCache(), d.layers[0]
    orig = layer.context_kv
    layer.context_kv = lambda c, p: orig(c, torch.zeros_like(p))  # the bug: positions lost
    d(feats[:, :5], pos[:, :5], valid[:, :5], a_ids, torch.tensor([[5], [5]]), cache=bad)
    layer.context_kv = orig
    args = (feats[:, :9], pos[:, :9], valid[:, :9], a_ids, torch.tensor([[9], [9]]))
    assert not torch.allclose(d(*args, cache=bad), d(*args), atol=1e-4)
