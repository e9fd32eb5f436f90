"""Captioner multi-token verification (`CaptionerTarget`): chains, trees, cache crop/select,
gated fusion at init.

Both connectors (a visual prefix in the cache; cross-attention as a layer hook), gates opened so
the images matter. Tolerance 1e-5 (fp32; the computations differ only in batching).
"""

from __future__ import annotations

import pytest
import torch

from vltrain.inference.captioner_target import CaptionerTarget
from vltrain.models.captioner import Captioner
from vltrain.models.connectors import ConnectorDims, build_connector
from vltrain.models.text import CausalDecoder, TextTowerConfig
from vltrain.models.vit import VisionTower, VisionTowerConfig

VOCAB, BOS, EOS, PAD = 53, 1, 2, 0
KINDS = ["projector", "gated_xattn"]
ATOL = 1e-5
# A tree of 7 draft nodes after the prompt: node 0 is the root, 6 is a leaf at depth 3.
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model(kind: str, gate: float | None = 0.7) -> Captioner:
    torch.manual_seed(0)
    v_cfg = VisionTowerConfig(image_size=32, patch_size=8, width=48, layers=1, heads=4)
    dims = ConnectorDims(48, 1 + v_cfg.num_patches, 64, 2, 4)
    opts = {"gated_xattn": {"n_latents": 8, "resampler_layers": 1}}.get(kind, {})
    conn = build_connector(kind, dims, **opts)
    cfg = TextTowerConfig(VOCAB, conn.num_prefix_tokens() + 20, width=64, layers=2, heads=4)
    model = Captioner(VisionTower(v_cfg), conn, CausalDecoder(cfg), BOS, EOS, PAD).eval()
    if gate is not None:
        with torch.no_grad():
            for name, p in model.connector.named_parameters():
                if "gate" in name:
                    p.fill_(gate)
    return model


def _images(n: int) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _tokens(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(4, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts: [BOS, 7, 9, 11] and [PAD, PAD, BOS, 5]."""
    ids = torch.tensor([[BOS, 7, 9, 11], [PAD, PAD, BOS, 5]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    return ids, mask


def _fresh(
    target: CaptionerTarget, images: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, more
):
    """(logits, cache) of a prefill of the prompt followed by the tokens ``more`` (B, n)."""
    full_ids = torch.cat([ids, more], 1)
    logits, cache, _ = target.prefill(images, full_ids, torch.cat([mask, torch.ones_like(more)], 1))
    return logits, cache


def _chain(b: int, n: int) -> torch.Tensor:
    """Parents (B, N) of a chain: each node's parent is the node before it."""
    return torch.arange(-1, n - 1).expand(b, -1)


def _tree(b: int) -> torch.Tensor:
    return torch.tensor(PARENTS).expand(b, -1)


@pytest.mark.parametrize("kind", KINDS)
def test_verify_equals_step_by_step(kind: str) -> None:
    target = CaptionerTarget(_model(kind))
    images, (ids, mask) = _images(2), _prompts()
    draft = _tokens((2, 4), 1)
    _, cache, _ = target.prefill(images, ids, mask)
    got, vcache, _ = target.verify(draft, _chain(2, 4), cache)
    assert got.shape == (2, 4, VOCAB) and got.dtype == torch.float32
    steps, scache = [], cache
    for j in range(4):
        logits, scache = target.step(draft[:, j], scache)
        steps.append(logits)
    torch.testing.assert_close(got, torch.stack(steps, 1), atol=ATOL, rtol=0)
    nxt = _tokens((2,), 2)  # the verified cache continues like the stepped one
    torch.testing.assert_close(
        target.step(nxt, vcache)[0], target.step(nxt, scache)[0], atol=ATOL, rtol=0
    )
    # Negative control: every node a root (it sees the cache, not the draft before it).
    roots, _, _ = target.verify(draft, torch.full((2, 4), -1), cache)
    assert (roots[:, 1:] - got[:, 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_cropped_cache_continues_like_a_fresh_prefill(kind: str) -> None:
    target = CaptionerTarget(_model(kind))
    images, (ids, mask) = _images(2), _prompts()
    draft = _tokens((2, 4), 3)
    _, cache, _ = target.prefill(images, ids, mask)
    _, cache, _ = target.verify(draft, _chain(2, 4), cache)
    kept = target.crop(cache, cache.kv.length - 2)  # accept 2 of the 4 draft tokens
    nxt = _tokens((2,), 4)
    got, _ = target.step(nxt, kept)
    _, fresh = _fresh(target, images, ids, mask, draft[:, :2])
    ref, _ = target.step(nxt, fresh)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    stale, _ = target.step(nxt, target.crop(cache, cache.kv.length - 1))
    assert (stale - ref).abs().max() > 1e-3  # negative control: a rejected token left in


def _path(node: int) -> list[int]:
    out = [node]
    while PARENTS[out[-1]] >= 0:
        out.append(PARENTS[out[-1]])
    return out[::-1]


@pytest.mark.parametrize("kind", KINDS)
def test_tree_verify_gives_every_node_its_chain_logits(kind: str) -> None:
    target = CaptionerTarget(_model(kind))
    images, (ids, mask) = _images(2), _prompts()
    nodes = _tokens((2, len(PARENTS)), 5)  # (B, N) a different tree per row
    _, cache, _ = target.prefill(images, ids, mask)
    got, _, _ = target.verify(nodes, _tree(2), cache)  # (B, N, V)
    # negative control: a chain over the nodes
    chain, _, _ = target.verify(nodes, _chain(2, len(PARENTS)), cache)
    off_chain = 0.0
    for i in range(len(PARENTS)):
        ref, _ = _fresh(target, images, ids, mask, nodes[:, _path(i)])  # (B, V)
        torch.testing.assert_close(got[:, i], ref, atol=ATOL, rtol=0)
        off_chain = max(off_chain, float((chain[:, i] - ref).abs().max()))
    assert off_chain > 1e-3, "a chain must not reproduce the tree's logits"


@pytest.mark.parametrize("kind", KINDS)
def test_select_tree_path_equals_fresh_prefill_of_the_path(kind: str) -> None:
    target = CaptionerTarget(_model(kind))
    images, (ids, mask) = _images(2), _prompts()
    nodes = _tokens((2, len(PARENTS)), 6)
    _, cache, _ = target.prefill(images, ids, mask)
    past = cache.kv.length
    _, tree_cache, _ = target.verify(nodes, _tree(2), cache)
    # Row 0 accepts the path to node 6 (0, 1, 3, 6); row 1 the path to node 5 (0, 2, 5).
    paths = [_path(6), _path(5)]
    width = max(map(len, paths))
    index = torch.arange(past).repeat(2, 1)
    tail = torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths]) + past
    valid = torch.tensor([[True] * len(p) + [False] * (width - len(p)) for p in paths])
    kept = target.select(
        tree_cache, torch.cat([index, tail], 1), torch.cat([torch.ones(2, past).bool(), valid], 1)
    )
    nxt = _tokens((2,), 7)
    got, _ = target.step(nxt, kept)
    for row, p in enumerate(paths):
        more = nodes[row : row + 1, p]
        _, fresh = _fresh(
            target, images[row : row + 1], ids[row : row + 1], mask[row : row + 1], more
        )
        ref, _ = target.step(nxt[row : row + 1], fresh)
        torch.testing.assert_close(got[row : row + 1], ref, atol=ATOL, rtol=0)
    whole, _ = target.step(nxt, tree_cache)  # negative control: the unselected tree cache
    assert (whole[0] - got[0]).abs().max() > 1e-3


def test_gated_connector_at_init_equals_plain_decoder_through_the_loop() -> None:
    model = _model("gated_xattn", gate=None)  # gates at their init value, 0
    ids = _tokens((2, 9), 8)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    visual = model.encode_images(_images(2))
    fused = model.connector.run(model.decoder, visual, ids, mask, taps=(0, 1))
    plain = model.decoder.run(ids, mask, taps=(0, 1))
    assert torch.equal(fused.hidden, plain.hidden)
    assert all(torch.equal(fused.taps[i], plain.taps[i]) for i in (0, 1))
    assert torch.equal(model.decoder.norm(fused.taps[1]), fused.hidden)  # last tap = final, pre-LN
    with torch.no_grad():
        model.connector.xattn["1"].attn_gate.scale.fill_(0.5)
    opened = model.connector.run(model.decoder, visual, ids, mask, taps=(0, 1))
    assert torch.equal(opened.taps[0], plain.taps[0])  # block 0 runs before the xattn at 1
    assert (opened.hidden - plain.hidden).abs().max() > 1e-3  # negative control: an open gate
