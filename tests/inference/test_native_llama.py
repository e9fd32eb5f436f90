"""The native Llama-family forward (`NativeTarget`) against HF's own modules.

Tiny random Llama (with and without attention biases) / Qwen2 (q/k/v bias) / Qwen3 (q/k norm,
explicit head_dim) built from config objects, saved to a tmp dir and loaded back (no
downloads). The reference is a second, untouched load of the same checkpoint (the native
forward re-homes q/k/v and gate/up into fused tensors).
Tolerance 1e-5 (fp32); on SmolLM2-135M the two agree bit for bit (bench/RESULTS.md).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.fixtures import tiny_causal_lm
from tests.inference.spec_helpers import (
    EOS,
    PAD,
    V,
    greedy_reference,
    left_padded_prompts,
    random_drafter,
)
from vltrain.inference.decoding import generate
from vltrain.inference.speculative import speculative_generate
from vltrain.models.packed import PackedLinears, can_pack

transformers = pytest.importorskip("transformers")
from vltrain.inference.hf_target import HFTarget  # noqa: E402
from vltrain.inference.native_llama import NativeLlama, NativeTarget, causal_lm_target  # noqa: E402

ATOL = 1e-5
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
LAYERS = [0, 2]  # the last of 3 blocks too: HF's last hidden state is normed, not a tap


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module", params=["llama", "llama_bias", "qwen2", "qwen3"])
def saved(request, tmp_path_factory):
    torch.manual_seed(0)
    cfg, cls = tiny_causal_lm(request.param)
    model = cls(cfg)
    with torch.no_grad():  # random norms and biases, so that a skipped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return cls, path


def _load(saved):
    cls, path = saved
    return cls.from_pretrained(path, attn_implementation="sdpa").eval()


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    p = left_padded_prompts()
    return p["input_ids"], p["attention_mask"]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() <= ATOL


def test_prefill_verify_select_step_equal_hf(saved):
    """Logits, drafter features and positions of every call equal HF's (HFTarget)."""
    hf, nat = HFTarget(_load(saved), LAYERS), NativeTarget(_load(saved), LAYERS)
    ids, mask = _prompt()
    lh, ch, xh = hf.prefill(ids, mask)
    ln, cn, xn = nat.prefill(ids, mask)
    _close(lh, ln)
    real = mask.bool()
    _close(xh.features[real], xn.features[real])  # padded positions hold anything
    assert torch.equal(xh.positions[real], xn.positions[real])
    parents = torch.tensor(PARENTS).expand(3, -1)
    toks = torch.randint(3, V, (3, len(PARENTS)), generator=torch.Generator().manual_seed(5))
    vh, ch, fh = hf.verify(toks, parents, ch)
    vn, cn, fn = nat.verify(toks, parents, cn)
    _close(vh, vn)
    _close(fh.features, fn.features)
    assert torch.equal(fh.positions, fn.positions)
    n = ids.shape[1]
    keep = torch.tensor([[*range(n), n + 0, n + 1, n + 3], [*range(n), n + 0, n + 2, n + 5]] * 2)
    keep, valid = keep[:3], torch.ones(3, n + 3, dtype=torch.bool)
    valid[2, -1] = False  # row 2 keeps a shorter path
    ch, cn = hf.select(ch, keep, valid), nat.select(cn, keep, valid)
    assert torch.equal(hf.next_positions(ch), nat.next_positions(cn))
    nxt = torch.tensor([7, 8, 9])
    sh, _ = hf.step(nxt, ch)
    sn, _ = nat.step(nxt, cn)
    _close(sh, sn)


def test_crop_after_a_chain_verify_continues_like_hf(saved):
    """``crop`` keeps the first n positions: the accepted prefix of a verified chain."""
    hf, nat = HFTarget(_load(saved)), NativeTarget(_load(saved))
    ids, mask = _prompt()
    chain = torch.arange(-1, 3).expand(3, -1)
    toks = torch.randint(3, V, (3, 4), generator=torch.Generator().manual_seed(6))
    _, ch, _ = hf.prefill(ids, mask)
    _, cn, _ = nat.prefill(ids, mask)
    _, ch, _ = hf.verify(toks, chain, ch)
    _, cn, _ = nat.verify(toks, chain, cn)
    n = ids.shape[1] + 2  # the prompt and 2 of the 4 chain tokens
    ch, cn = hf.crop(ch, n), nat.crop(cn, n)
    assert torch.equal(hf.next_positions(ch), nat.next_positions(cn))
    nxt = torch.tensor([7, 8, 9])
    sn, _ = nat.step(nxt, cn)
    _close(hf.step(nxt, ch)[0], sn)
    more = toks[:, :2]  # a fresh prefill of the prompt and the accepted tokens
    fresh = nat.prefill(torch.cat([ids, more], 1), torch.cat([mask, torch.ones_like(more)], 1))[1]
    _close(nat.step(nxt, fresh)[0], sn)
    _, cn, _ = nat.prefill(ids, mask)
    _, cn, _ = nat.verify(toks, chain, cn)
    stale, _ = nat.step(nxt, nat.crop(cn, n + 1))
    assert (stale - sn).abs().max() > 10 * ATOL  # negative control: a rejected token left in


def test_greedy_equals_hf_generate_on_padded_batch(saved):
    """`generate` through the native decoder == HF's own `generate`, token for token."""
    ids, mask = _prompt()
    ref = _load(saved).generate(
        ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=PAD
    )[:, ids.shape[1] :]
    ours = greedy_reference(
        NativeTarget(_load(saved)), {"input_ids": ids, "attention_mask": mask}, 12
    )
    for row, want in zip(ours, ref.tolist(), strict=True):
        assert row == want[: len(row)]
        assert len(row) == 12 or row[-1] == EOS


def test_beam_search_reorders_the_native_cache_like_hf(saved):
    ids, mask = _prompt()
    inputs = {"input_ids": ids, "attention_mask": mask}
    ref = generate(HFTarget(_load(saved)), inputs, "beam", max_new_tokens=6, num_beams=3)
    ours = generate(NativeTarget(_load(saved)), inputs, "beam", 6, num_beams=3)
    assert torch.equal(ref.sequences, ours.sequences)


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [None, list(range(0, V, 2))], ids=["full", "half-vocab"])
@pytest.mark.parametrize("budget", [0, 6])
def test_speculative_decoding_through_the_native_forward_is_lossless(saved, budget, vocab):
    """Chain and DDTree verification on the native forward: HF greedy tokens, HF's acceptance;
    with a reduced draft vocabulary the walk scores its visited nodes over the whole head."""
    ids, mask = _prompt()
    inputs = {"input_ids": ids, "attention_mask": mask}
    want = greedy_reference(HFTarget(_load(saved)), inputs, 20)
    hf = HFTarget(_load(saved), LAYERS)
    nat = NativeTarget(_load(saved), LAYERS)
    got_hf, st_hf = speculative_generate(hf, random_drafter(hf, 4, vocab=vocab), inputs, 20, budget)
    got, st = speculative_generate(nat, random_drafter(nat, 4, vocab=vocab), inputs, 20, budget)
    assert got == want
    assert got_hf == want
    assert st.accepted == st_hf.accepted  # same logits, same walk


@pytest.mark.slow
def test_the_native_cache_grows_past_its_first_capacity(saved):
    """Decoding far past the prefill's spare room: the buffers double and keep their keys."""
    ids, mask = _prompt()
    inputs = {"input_ids": ids, "attention_mask": mask}
    want = greedy_reference(HFTarget(_load(saved)), inputs, 150)
    nat = NativeTarget(_load(saved))
    assert greedy_reference(nat, inputs, 150) == want
    _, cache, _ = nat.prefill(ids, mask)
    assert cache.keys[0].shape[2] == ids.shape[1] + 128  # so 150 tokens did grow it


def test_fusion_leaves_the_hf_model_unchanged(saved):
    """q/k/v and gate/up become views of fused tensors: HF's forward gives the same logits."""
    model = _load(saved)
    ids, mask = _prompt()
    before = model(input_ids=ids, attention_mask=mask).logits
    native = NativeLlama(model)
    attn = model.model.layers[0].self_attn
    fused = native.layers[0].qkv
    assert attn.k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    assert torch.equal(attn.q_proj.weight, fused[: attn.q_proj.weight.shape[0]])
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


def test_unsupported_models_are_refused_with_the_reason():
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2)
    with pytest.raises(ValueError, match="gpt2"):
        NativeLlama(transformers.GPT2LMHeadModel(cfg))
    cfg, cls = tiny_causal_lm("qwen2")
    cfg.use_sliding_window, cfg.sliding_window = True, 16
    cfg.layer_types = ["sliding_attention"] * cfg.num_hidden_layers
    with pytest.raises(ValueError, match="full attention"):
        NativeLlama(cls(cfg))


def test_packed_linear_matches_f_linear():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    packs = PackedLinears(keep=2)
    for rows in (1, 3, 8, 16, 17, 33):
        x = torch.randn(1, rows, 64, generator=g)
        want = F.linear(x, w, b)
        got = packs.linear(x, w, b)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-4
        if rows >= 16 and can_pack(w):
            assert torch.equal(got, want)  # MKL packs the same way itself from 16 rows on
    assert len(packs._packs) == 2  # only the latest two row counts stay packed
    w2 = torch.randn(300, 64, generator=g)  # another weight, maybe at a recycled id
    x = torch.randn(17, 64, generator=g)
    assert (packs.linear(x, w2) - F.linear(x, w2)).abs().max().item() <= 1e-4


def test_packed_linear_is_plain_under_autograd():
    w = torch.randn(40, 8, requires_grad=True)
    x = torch.randn(20, 8)
    with torch.enable_grad():
        assert not can_pack(w)
        PackedLinears().linear(x, w).sum().backward()
    assert torch.allclose(w.grad, x.sum(0).expand(40, -1))


def test_auto_falls_back_to_hf_where_the_native_forward_cannot_go():
    from vltrain.config.core import ConfigError

    dims = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    dims |= dict(num_attention_heads=4, num_key_value_heads=2)
    windowed = transformers.MistralForCausalLM(
        transformers.MistralConfig(sliding_window=16, **dims)
    )
    assert isinstance(causal_lm_target(windowed, [], "auto", PAD), HFTarget)
    with pytest.raises(ConfigError, match="sliding_window=16"):
        causal_lm_target(windowed, [], "native", PAD)
    full = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **dims))
    assert isinstance(causal_lm_target(full, [], "auto", PAD), NativeTarget)
    gpt2_cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2)
    gpt2 = transformers.GPT2LMHeadModel(gpt2_cfg)
    assert isinstance(causal_lm_target(gpt2, [], "auto", PAD), HFTarget)
    with pytest.raises(ConfigError, match="gpt2"):
        causal_lm_target(gpt2, [], "native", PAD)


def test_a_changed_hf_model_is_refused_and_a_second_target_shares_the_fusion(saved):
    model = _load(saved)
    first = NativeTarget(model)
    second = NativeTarget(model)  # reuses the fused tensors: the first stays valid
    assert first.native.layers[0].qkv is second.native.layers[0].qkv
    ids, mask = _prompt()
    first.prefill(ids, mask)
    other = _load(saved)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)
    model.load_state_dict(other.state_dict())  # in place: packed copies would be stale
    with pytest.raises(RuntimeError, match="build a new NativeTarget"):
        first.prefill(ids, mask)
    fresh = NativeTarget(model)
    _close(fresh.prefill(ids, mask)[0], HFTarget(other, []).prefill(ids, mask)[0])


def test_packed_linear_repacks_a_weight_updated_in_place():
    packs = PackedLinears()
    w, x = torch.randn(16, 8), torch.randn(4, 8)
    packs.linear(x, w)
    w.add_(1.0)
    assert (packs.linear(x, w) - F.linear(x, w)).abs().max().item() <= 1e-5


def test_greedy_drops_finished_rows_from_the_native_cache(saved):
    """Rows leave the batch once they emit EOS (``reorder`` on the native buffers) and
    the others still decode HF's tokens. EOS is a token some row really emits before the others
    end, so rows finish at different steps whatever the random weights."""
    ids, mask = _prompt()
    inputs = {"input_ids": ids, "attention_mask": mask}
    dec = NativeTarget(_load(saved))
    free = generate(dec, inputs, "greedy", max_new_tokens=12)
    eos = _early_stop_token(free.sequences, free.lengths)
    ref = _load(saved).generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=PAD,
        eos_token_id=eos,
    )[:, ids.shape[1] :]
    dec.eos_token_id = eos
    fed: list[int] = []
    step = dec.step

    def spy(tokens, cache):
        fed.append(len(tokens))
        return step(tokens, cache)

    dec.step = spy
    out = generate(dec, inputs, "greedy", max_new_tokens=12)
    for row, n, want in zip(
        out.sequences.tolist(), out.lengths.tolist(), ref.tolist(), strict=True
    ):
        assert row[:n] == want[:n]
    assert fed == [int((out.lengths > t).sum()) for t in range(1, out.sequences.shape[1])]
    assert min(fed) < ids.shape[0]


def _early_stop_token(seqs: torch.Tensor, lengths: torch.Tensor) -> int:
    """A token that, as EOS, ends some rows of this greedy output at different steps."""
    rows = [row[:n] for row, n in zip(seqs.tolist(), lengths.tolist(), strict=True)]
    for tok in dict.fromkeys(t for row in rows for t in row):
        first = [row.index(tok) if tok in row else len(row) for row in rows]
        if min(first) < max(first):
            return tok
    pytest.skip(f"this random model writes the same tokens in every row: {rows}")
