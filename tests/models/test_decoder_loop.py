"""The one decoder loop: hooks, taps, explicit positions / masks, mask builders, cache crop/select.

Tiny models on CPU, fixed seeds. Tolerance 1e-5 (fp32) where two computations differ only in
batching; exact equality where they run the same kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vltrain.models.layers import (
    KVCache,
    additive_mask,
    block_causal_mask,
    build_attention_mask,
    causal_mask,
    padding_mask,
    reorder_cache,
    tree_depths,
    tree_mask,
)
from vltrain.models.text import CausalDecoder, TextTowerConfig

VOCAB = 41
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _decoder(layers: int = 3, seed: int = 0) -> CausalDecoder:
    torch.manual_seed(seed)
    cfg = TextTowerConfig(VOCAB, context_length=40, width=32, layers=layers, heads=4)
    return CausalDecoder(cfg).eval()


def _tokens(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _padded_mask(b: int, t: int) -> torch.Tensor:
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, :3] = 0  # row 1 left-padded
    return mask


# --------------------------------------------------------------------------- mask builders


def _ancestors(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_tree_mask_and_depths_match_brute_force() -> None:
    parents = [-1, 0, 0, 1, 1, 2, 3, -1]  # two roots: a forest after the prefix
    past = 3
    got = tree_mask(torch.tensor(parents), past)  # (1, 1, N, S)
    n = len(parents)
    assert got.shape == (1, 1, n, past + n)
    for i in range(n):
        want = [True] * past + [j in _ancestors(parents, i) for j in range(n)]
        assert got[0, 0, i].tolist() == want, i
    assert tree_depths(torch.tensor(parents))[0].tolist() == [0, 1, 1, 2, 2, 2, 3, 0]
    # A chain tree is exactly the causal mask (the same builder family agrees with itself).
    chain = torch.arange(6) - 1
    assert torch.equal(tree_mask(chain, past), causal_mask(6, past))
    with pytest.raises(ValueError, match="parents"):
        tree_mask(torch.tensor([-1, 2, 0]))  # a parent after its child


def test_block_causal_mask_matches_brute_force() -> None:
    past, t, bs = 2, 7, 3
    got = block_causal_mask(t, bs, past)[0, 0]  # (T, S)
    for q in range(t):
        anchor = past + (q // bs) * bs
        block_end = min(anchor + bs, past + t)
        want = [k < anchor or anchor <= k < block_end for k in range(past + t)]
        assert got[q].tolist() == want, q
    assert torch.equal(block_causal_mask(t, 1, past), causal_mask(t, past))  # size 1 = causal


def test_causal_and_padding_masks_agree_with_build_attention_mask() -> None:
    key = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ref, _ = build_attention_mask(key, q_len=2, causal=True, past_len=4)
    assert torch.equal(causal_mask(2, 4, key), ref)
    assert torch.equal(causal_mask(2, 4, key[:, :4]), ref)  # key mask over the cache only
    assert padding_mask(key, 2).shape == (2, 1, 2, 6)
    assert torch.equal(padding_mask(key, 2)[:, 0, 0], key.bool())
    add = additive_mask(ref)
    assert add.dtype == torch.float32 and torch.equal(add == 0, ref)


# --------------------------------------------------------------------------- the loop


def test_taps_of_last_layer_equal_final_hidden_and_truncated_decoders() -> None:
    dec = _decoder()
    ids, mask = _tokens((2, 9), 1), _padded_mask(2, 9)
    out = dec.run(ids, mask, taps=(0, 1, 2, -1))
    assert torch.equal(dec.norm(out.taps[2]), out.hidden)
    assert torch.equal(out.taps[-1], out.taps[2])
    assert torch.equal(out.hidden, dec.hidden_states(ids, mask)[0])  # taps change nothing
    for i in (0, 1):  # tap i = the residual stream of a decoder cut after block i
        cut = copy.deepcopy(dec)
        cut.blocks = cut.blocks[: i + 1]
        assert torch.equal(cut.run(ids, mask, taps=(i,)).taps[i], out.taps[i])
    assert (out.taps[0] - out.taps[1]).abs().max() > 1e-3  # negative control: taps differ
    with pytest.raises(ValueError, match="taps"):
        dec.run(ids, mask, taps=(3,))


def test_layer_hook_runs_before_each_block() -> None:
    dec = _decoder()
    ids = _tokens((2, 6), 2)
    seen: list[int] = []
    taps = dec.run(ids, taps=(0, 1)).taps

    def record(i: int, x: torch.Tensor) -> torch.Tensor:
        seen.append(i)
        if i > 0:  # the input of block i is the output of block i - 1
            assert torch.equal(x, taps[i - 1])
        return x

    out = dec.run(ids, layer_hook=record)
    assert seen == [0, 1, 2]
    assert torch.equal(out.hidden, dec.hidden_states(ids)[0])
    push = torch.randn(32, generator=torch.Generator().manual_seed(0))  # (W,), not LN-invariant
    shifted = dec.run(ids, layer_hook=lambda i, x: x + push if i == 1 else x).hidden
    assert (shifted - out.hidden).abs().max() > 1e-3  # negative control: the hook is applied


def test_explicit_positions_and_masks_reproduce_the_default() -> None:
    dec = _decoder()
    ids, mask = _tokens((2, 8), 3), _padded_mask(2, 8)
    ref = dec.run(ids, mask).hidden
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    assert torch.equal(dec.run(ids, mask, position_ids=pos).hidden, ref)
    explicit = causal_mask(8, 0, mask)
    torch.testing.assert_close(
        dec.run(ids, mask, attn_mask=explicit).hidden, ref, atol=1e-6, rtol=0
    )
    additive = additive_mask(explicit)
    torch.testing.assert_close(
        dec.run(ids, mask, attn_mask=additive).hidden, ref, atol=1e-6, rtol=0
    )
    moved = dec.run(ids, mask, position_ids=pos + 1).hidden
    assert (moved - ref).abs().max() > 1e-3  # negative control: positions are used
    full = dec.run(ids, mask, attn_mask=padding_mask(mask, 8)).hidden
    assert (full[0] - ref[0]).abs().max() > 1e-3  # negative control: the mask is used
    with pytest.raises(ValueError, match="attn_mask"):
        dec.run(ids, mask, attn_mask=explicit[..., :-1])
    with pytest.raises(ValueError, match="position_ids"):
        dec.run(ids, mask, position_ids=pos + 40)


# --------------------------------------------------------------------------- cache


def test_crop_equals_prefill_of_the_kept_positions() -> None:
    dec = _decoder()
    ids, mask = _tokens((2, 9), 4), _padded_mask(2, 9)
    _, cache = dec(ids, mask, use_cache=True)
    _, short = dec(ids[:, :6], mask[:, :6], use_cache=True)
    cropped = cache.crop(6)
    assert cropped.length == 6 and torch.equal(cropped.mask, short.mask)
    for (k, v), (k2, v2) in zip(cropped.layers, short.layers, strict=True):
        torch.testing.assert_close(k, k2, atol=ATOL, rtol=0)
        torch.testing.assert_close(v, v2, atol=ATOL, rtol=0)
    nxt = _tokens((2, 1), 5)
    got = dec(nxt, kv_cache=cropped)
    torch.testing.assert_close(got, dec(nxt, kv_cache=short), atol=ATOL, rtol=0)
    bad = dec(nxt, kv_cache=cache.crop(7))
    assert (bad - got).abs().max() > 1e-3  # negative control: one stale position changes logits
    with pytest.raises(ValueError, match="crop"):
        cache.crop(10)


def test_select_keeps_positions_per_row_and_reorder_still_works() -> None:
    dec = _decoder()
    ids = _tokens((2, 7), 6)
    _, cache = dec(ids, use_cache=True)
    same = cache.select(torch.arange(7))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(same.layers, cache.layers, strict=True))
    # Row 0 keeps positions 0..4, row 1 keeps 0..2 and pads (valid False) to the same width.
    index = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 2, 2]])
    valid = torch.tensor([[True] * 5, [True, True, True, False, False]])
    sel = cache.select(index, valid)
    assert sel.next_positions().tolist() == [5, 3]
    nxt = _tokens((2, 1), 7)
    got = dec(nxt, kv_cache=sel)  # (2, 1, V)
    for row, n in ((0, 5), (1, 3)):
        seq = torch.cat([ids[row, :n], nxt[row]])[None]
        torch.testing.assert_close(got[row, -1], dec(seq)[0, -1], atol=ATOL, rtol=0)
    beams = torch.tensor([1, 0, 1])
    assert torch.equal(cache.reorder(beams).layers[0][0], reorder_cache(cache, beams).layers[0][0])
    with pytest.raises(ValueError, match="select"):
        cache.select(torch.tensor([7]))


def test_kv_cache_is_unchanged_by_crop_and_select() -> None:
    dec = _decoder(layers=1)
    _, cache = dec(_tokens((1, 5), 8), use_cache=True)
    before = [k.clone() for k, _ in cache.layers]
    cache.crop(2)
    cache.select(torch.tensor([4, 0]))
    assert isinstance(cache, KVCache) and cache.length == 5
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, cache.layers, strict=True))
