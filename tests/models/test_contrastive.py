"""The contrastive model's embedding forward: the grouped text pass of `encode_text_sets`."""

from __future__ import annotations

import pytest
import torch

from tests.objectives.test_grad_cache import VOCAB, B, M, T, _model
from vltrain.models.contrastive import encode_text_sets


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_encode_text_sets_equals_one_call_per_set() -> None:
    """Captions, second captions and negatives in one length-sorted pass: the per-set
    embeddings and gradients up to rounding; an encoder that reads trailing padding gets one
    call per set, untouched."""
    model = _model(dropout=0.0)
    enc = model.encoder
    sets = []
    for seed, rows, width in ((1, B, T), (2, M, T - 4), (3, B, T - 2)):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, width + 1, (rows,), generator=g)
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        sets.append((torch.randint(3, VOCAB, (rows, width), generator=g) * mask, mask))
    grouped = encode_text_sets(enc, sets)
    sum((e * torch.arange(e.numel()).view_as(e)).sum() for e in grouped).backward()
    got = {n: p.grad.clone() for n, p in enc.text.named_parameters() if p.grad is not None}
    enc.zero_grad()
    ref = [enc.encode_text(i, m) for i, m in sets]
    sum((e * torch.arange(e.numel()).view_as(e)).sum() for e in ref).backward()
    for a, b in zip(grouped, ref, strict=True):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    for n, p in enc.text.named_parameters():
        # rounding is relative to the gradient's scale (1e3-1e4 here: the loss weights rows by
        # their index), not to each element: a fixed atol of 1e-4 failed one element of 49,152
        # on an AMD EPYC (difference 1.2e-4 where the largest gradient is ~3e3)
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(got[n], p.grad, atol=1e-5 * scale, rtol=1e-3)

    calls = []

    class Fixed(torch.nn.Module):  # pools a fixed position: trailing padding matters
        def encode_text(self, ids, mask):
            calls.append(tuple(ids.shape))
            return ids.float()[:, :2]

    out = encode_text_sets(Fixed(), sets)
    assert calls == [(B, T), (M, T - 4), (B, T - 2)]
    assert all(torch.equal(o, i.float()[:, :2]) for o, (i, _) in zip(out, sets, strict=True))
