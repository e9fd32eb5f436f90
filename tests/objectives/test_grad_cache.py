"""GradCache gives the gradients of the uncached computation (single process, dropout > 0)."""

from __future__ import annotations

import pytest
import torch

from vltrain.data.batches import length_sorted_chunks, split_rows
from vltrain.models.contrastive import ContrastiveModel
from vltrain.models.dual_encoder import DualEncoder
from vltrain.models.presets import text_config, vision_config
from vltrain.objectives.contrastive import build_loss
from vltrain.objectives.grad_cache import dual_encoder_grad_cache, grad_cache

B, M, T, VOCAB = 10, 4, 12, 60


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model(loss: str = "infonce", dropout: float = 0.2) -> ContrastiveModel:
    torch.manual_seed(0)
    enc = DualEncoder(
        vision_config("tiny", image_size=32, layers=1, dropout=dropout),
        text_config("tiny", vocab_size=VOCAB, context_length=T, layers=1, dropout=dropout),
        embed_dim=32,
    )
    kwargs = {"init_scale": 10.0} if loss == "siglip" else {"temperature": 0.1}
    return ContrastiveModel(enc, build_loss(loss, gather=False, **kwargs)).train()


def _batch(seed: int, n_neg: int = M) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B + n_neg,), generator=g)
    ids = torch.randint(3, VOCAB, (B + n_neg, T), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    batch = {
        "images": torch.rand(B, 3, 32, 32, generator=g),
        "input_ids": ids[:B] * mask[:B],
        "attention_mask": mask[:B],
    }
    if n_neg:
        batch["neg_ids"], batch["neg_mask"] = ids[B:] * mask[B:], mask[B:]
    return batch


def _chunked_reference(model: ContrastiveModel, batch: dict, chunk: int, scale: float) -> None:
    """The uncached computation with GradCache's chunking: every chunk encoded with a graph,
    in the same order (same dropout masks; texts grouped by length, the built-in tower ignores
    trailing padding), one loss over the whole batch, one backward."""
    enc = model.encoder
    img = torch.cat([enc.encode_image(c) for c in batch["images"].split(chunk)])

    def texts(ids: str, mask: str) -> torch.Tensor:
        chunks, order = length_sorted_chunks((batch[ids], batch[mask]), chunk)
        return torch.cat([enc.encode_text(*c) for c in chunks])[order.argsort()]

    txt = texts("input_ids", "attention_mask")
    neg = texts("neg_ids", "neg_mask") if "neg_ids" in batch else None
    loss, _ = model.loss(img, txt, neg)
    (loss * scale).backward()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_same(a: dict, b: dict, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("loss", ["infonce", "siglip"])
def test_grad_cache_equals_uncached_with_dropout(loss: str) -> None:
    model, batch, chunk = _model(loss), _batch(0), 3  # chunks 3,3,3,1 and 3,1 (negatives)
    torch.manual_seed(1)
    _chunked_reference(model, batch, chunk, 1.0)
    ref, rng_ref = _grads(model), torch.get_rng_state()
    torch.manual_seed(1)
    out_loss, metrics = dual_encoder_grad_cache(model, batch, chunk, 1.0)
    got = _grads(model)
    _assert_same(got, ref)
    assert "loss.logit_scale" in got and got["loss.logit_scale"].abs().item() > 0
    assert torch.equal(torch.get_rng_state(), rng_ref)  # same RNG stream afterwards
    assert torch.isfinite(out_loss) and "acc_i2t" in metrics
    # negative control: without RNG replay dropout differs between passes -> wrong gradients
    torch.manual_seed(1)
    enc = model.encoder
    grad_cache(
        [enc.encode_image, enc.encode_text, enc.encode_text],
        [
            split_rows(batch["images"], chunk),
            split_rows((batch["input_ids"], batch["attention_mask"]), chunk),
            split_rows((batch["neg_ids"], batch["neg_mask"]), chunk),
        ],
        lambda e: model.loss(*e),
        replay_rng=False,
    )
    assert _max_diff(_grads(model), ref) > 1e-4


def test_one_chunk_equals_the_plain_stage_step_exactly() -> None:
    """chunk >= batch: the same forward as the uncached step (even the dropout masks)."""
    model, batch = _model(), _batch(1)
    torch.manual_seed(3)
    loss_ref, _ = model(batch)
    loss_ref.backward()
    ref = _grads(model)
    torch.manual_seed(3)
    loss, _ = dual_encoder_grad_cache(model, batch, 64, 1.0)
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
    _assert_same(_grads(model), ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n_neg", [M, 0])
def test_second_captions_ride_along_in_chunks(n_neg: int) -> None:
    """objective.caption_contrast: `pair_ids` are a fourth chunked side; without dropout the
    cached gradients equal the plain forward's, and the caption term really contributes."""
    torch.manual_seed(0)
    enc = DualEncoder(
        vision_config("tiny", image_size=32, layers=1),
        text_config("tiny", vocab_size=VOCAB, context_length=T, layers=1),
        embed_dim=32,
    )
    loss = build_loss("infonce", gather=False, temperature=0.1, caption_contrast=0.7)
    model = ContrastiveModel(enc, loss).train()
    batch = _batch(4, n_neg)
    other = _batch(5, 0)
    batch["pair_ids"], batch["pair_mask"] = other["input_ids"], other["attention_mask"]
    plain_loss, metrics = model(batch)
    plain_loss.backward()
    ref = _grads(model)
    assert metrics["caption_loss"].item() > 0
    cached_loss, cached_metrics = dual_encoder_grad_cache(model, batch, 3, 1.0)
    assert cached_loss.item() == pytest.approx(plain_loss.item(), rel=1e-5)
    assert cached_metrics["caption_loss"].item() == pytest.approx(metrics["caption_loss"].item())
    _assert_same(_grads(model), ref, atol=1e-5)  # the plain step encodes its texts length-sorted
    # control: the same batch without second captions gives other gradients
    del batch["pair_ids"], batch["pair_mask"]
    dual_encoder_grad_cache(model, batch, 3, 1.0)
    assert _max_diff(_grads(model), ref) > 1e-4


def test_accumulation_and_no_negatives() -> None:
    """Two micro-batches (scale 1/2), one without hard negatives, accumulate like backward."""
    model, b1, b2 = _model(), _batch(2), _batch(3, n_neg=0)
    torch.manual_seed(5)
    _chunked_reference(model, b1, 4, 0.5)
    _chunked_reference(model, b2, 4, 0.5)
    ref = _grads(model)
    torch.manual_seed(5)
    dual_encoder_grad_cache(model, b1, 4, 0.5)
    dual_encoder_grad_cache(model, b2, 4, 0.5)
    _assert_same(_grads(model), ref)
    # control: a single micro-batch is not the same thing
    torch.manual_seed(5)
    dual_encoder_grad_cache(model, b1, 4, 0.5)
    assert _max_diff(_grads(model), ref) > 1e-4


def test_bf16_autocast_matches_reference() -> None:
    """Correctness under bf16 autocast (same chunks, same masks): bf16 tolerance."""
    model, batch = _model(dropout=0.1), _batch(4, n_neg=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(7)
        _chunked_reference(model, batch, 5, 1.0)
        ref = _grads(model)
        torch.manual_seed(7)
        loss, _ = dual_encoder_grad_cache(model, batch, 5, 1.0)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    got = _grads(model)
    # the reference sums all chunks' weight gradients in one bf16 buffer (autocast caches the
    # bf16 weight copy); GradCache sums per-chunk gradients in fp32: compare by relative norm
    rel = {k: ((got[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref}
    assert max(rel.values()) < 1e-2, max(rel.items(), key=lambda kv: kv[1])


def test_generic_encoders_and_errors() -> None:
    """A plain callable per side; a side the loss ignores is an error, not silence."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(5, 3)
    q, d = torch.randn(7, 5), torch.randn(7, 5)

    def loss_fn(e: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        return (e[0] @ e[1].t()).logsumexp(1).mean(), {}

    loss_ref, _ = loss_fn([lin(q), lin(d)])
    loss_ref.backward()
    ref = _grads(lin)
    loss, _ = grad_cache([lin, lin], [split_rows(q, 2), split_rows(d, 3)], loss_fn)
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
    _assert_same(_grads(lin), ref)
    with pytest.raises(ValueError, match="did not use side 1"):
        grad_cache([lin, lin], [split_rows(q, 2), split_rows(d, 2)], lambda e: (e[0].sum(), {}))
    with pytest.raises(ValueError, match="2 encoders but 1"):
        grad_cache([lin, lin], [split_rows(q, 2)], loss_fn)


def test_last_chunk_is_not_re_encoded_and_rng_ends_as_one_pass() -> None:
    """2 x chunks - 1 encoder calls (the last chunk backpropagates from its first graph), and
    the RNG stream afterwards is where one pass over all chunks leaves it."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Dropout(0.3))
    calls = []

    def enc(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return net(x)

    def loss_fn(e: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        return (e[0] @ e[1].t()).logsumexp(1).mean(), {}

    q, d = torch.randn(6, 5), torch.randn(6, 5)
    torch.manual_seed(1)
    grad_cache([enc, enc], [split_rows(q, 2), split_rows(d, 2)], loss_fn)
    after = torch.rand(3)
    assert len(calls) == 2 * 6 - 1
    torch.manual_seed(1)
    for x in (*split_rows(q, 2), *split_rows(d, 2)):
        net(x)
    assert torch.equal(after, torch.rand(3))


def test_length_sorted_chunks_group_rows_and_keep_the_gradients() -> None:
    """Rows grouped by length, each chunk cut to its longest row; with dropout off GradCache on
    sorted chunks gives the uncached loss and gradients; left padding is refused."""
    torch.manual_seed(0)
    lengths = torch.tensor([3, 9, 2, 7, 9, 1, 5])
    mask = (torch.arange(10) < lengths[:, None]).long()  # (7, 10) right-padded
    ids = torch.randint(1, 50, (7, 10)) * mask
    chunks, order = length_sorted_chunks({"input_ids": ids, "attention_mask": mask}, 3)
    assert order.tolist() == [1, 4, 3, 6, 0, 2, 5]
    assert [c["input_ids"].shape for c in chunks] == [(3, 9), (3, 5), (1, 1)]
    assert torch.equal(chunks[1]["input_ids"], ids[[6, 0, 2], :5])

    emb = torch.nn.Embedding(50, 4)

    def encode(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:  # masked mean: padding-free
        return (emb(x) * m[..., None]).sum(1) / m.sum(1, keepdim=True)

    def loss_fn(e: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        return ((e[0] @ e[1].t()) * torch.arange(7.0)).logsumexp(1).mean(), {}

    q = torch.randn(7, 4)
    loss_ref, _ = loss_fn([q, encode(ids, mask)])
    loss_ref.backward()
    ref = emb.weight.grad.clone()
    emb.zero_grad()
    side, order = length_sorted_chunks((ids, mask), 3)
    loss, _ = grad_cache([lambda x: x, encode], [[q], side], loss_fn, orders=[None, order])
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)
    torch.testing.assert_close(emb.weight.grad, ref)
    with pytest.raises(ValueError, match="right-padded"):
        length_sorted_chunks((ids, mask.flip(1)), 3)
