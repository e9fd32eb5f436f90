"""REINFORCE objective: gradients against closed forms, KL/entropy against brute force, masking,
baselines, rewards against CiderD, the frozen reference, and a toy policy that learns."""

from __future__ import annotations

import io
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from vltrain.eval.caption_metrics import CiderD, sentence_bleu
from vltrain.eval.ptb_tokenize import ptb_tokenize, ptb_tokenize_caption
from vltrain.inference.captioner_target import CaptionerTarget
from vltrain.inference.decoding import generate
from vltrain.models.captioner import Captioner
from vltrain.models.connectors import ConnectorDims, build_connector
from vltrain.models.text import CausalDecoder, TextTowerConfig
from vltrain.models.vit import VisionTower, VisionTowerConfig
from vltrain.objectives.reference import check_frozen_reference, frozen_reference
from vltrain.objectives.reinforce import (
    BASELINES,
    CaptionReward,
    EMABaseline,
    GreedyBaseline,
    LeaveOneOutBaseline,
    advantages,
    build_baseline,
    ends_with_eos,
    policy_terms,
    reinforce_loss,
    sequence_logits,
    sequence_mask,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------ REINFORCE gradient


@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_pg_gradient_matches_closed_form(normalize: str) -> None:
    """d/dθ of -mean(A log pi) for pi_t = softmax(θ_t): -Σ_i A_i Σ_t m_it (onehot(x_it) - p_t)."""
    n, length, vocab = 5, 3, 4
    theta = torch.randn(length, vocab, generator=_gen(0), requires_grad=True)
    tokens = torch.randint(0, vocab, (n, length), generator=_gen(1))
    lengths = torch.tensor([3, 1, 2, 3, 2])
    mask = sequence_mask(lengths, length)
    adv = torch.randn(n, generator=_gen(2))
    logits = theta[None].expand(n, -1, -1)  # (N, L, V)
    terms = policy_terms(logits, None, tokens, mask)
    loss, _ = reinforce_loss(terms, adv, normalize=normalize)
    loss.backward()

    p = theta.detach().softmax(-1)  # (L, V)
    m = mask.float()
    expected = -(adv[:, None, None] * m[..., None] * (F.one_hot(tokens, vocab) - p[None])).sum(0)
    expected /= m.sum() if normalize == "token" else n
    torch.testing.assert_close(theta.grad, expected, rtol=1e-5, atol=1e-6)
    # negative control: the sign and the advantage weighting matter
    assert not torch.allclose(theta.grad, -expected, atol=1e-4)


def test_pg_term_is_unbiased_gradient_of_expected_reward() -> None:
    """Enumerating all sequences with weights p(seq)·R(seq): the REINFORCE gradient = -∇E[R]."""
    length, vocab = 2, 3
    theta = torch.randn(length, vocab, generator=_gen(3), requires_grad=True)
    seqs = torch.tensor(list(itertools.product(range(vocab), repeat=length)))  # (9, 2)
    reward = (seqs == 1).float().mean(1) + 0.5 * (seqs[:, 0] == seqs[:, 1]).float()  # (9,)
    logp = theta.log_softmax(-1)
    p_seq = logp.gather(1, seqs.T).sum(0).exp()  # (9,)
    expected_grad = torch.autograd.grad((p_seq * reward).sum(), theta)[0]

    n = seqs.shape[0]
    terms = policy_terms(theta[None].expand(n, -1, -1), None, seqs, torch.ones(n, length))
    adv = n * p_seq.detach() * reward  # sequence normalisation divides by n
    loss, _ = reinforce_loss(terms, adv, normalize="sequence")
    (grad,) = torch.autograd.grad(loss, theta)
    torch.testing.assert_close(grad, -expected_grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- KL and entropy


def _brute_kl_entropy(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    p = [math.exp(x) for x in logits.log_softmax(-1).tolist()]
    q = [math.exp(x) for x in ref.log_softmax(-1).tolist()]
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True))
    ent = -sum(pi * math.log(pi) for pi in p)
    return kl, ent


def test_kl_and_entropy_match_brute_force() -> None:
    n, length, vocab = 3, 4, 6
    logits = torch.randn(n, length, vocab, generator=_gen(4))
    ref = torch.randn(n, length, vocab, generator=_gen(5))
    tokens = torch.randint(0, vocab, (n, length), generator=_gen(6))
    mask = torch.ones(n, length)
    terms = policy_terms(logits, ref, tokens, mask)
    for i, t in itertools.product(range(n), range(length)):
        kl, ent = _brute_kl_entropy(logits[i, t].double(), ref[i, t].double())
        assert terms.kl[i, t].item() == pytest.approx(kl, rel=1e-5, abs=1e-6)
        assert terms.entropy[i, t].item() == pytest.approx(ent, rel=1e-5, abs=1e-6)
        lp = logits[i, t].double().log_softmax(-1)[tokens[i, t]].item()
        assert terms.logprobs[i, t].item() == pytest.approx(lp, rel=1e-5, abs=1e-6)
    assert bool((terms.kl > 0).all())
    # uniform policy: entropy log V exactly
    flat = policy_terms(torch.zeros(1, 1, vocab), None, tokens[:1, :1], mask[:1, :1])
    assert flat.entropy.item() == pytest.approx(math.log(vocab), rel=1e-6)


def test_kl_zero_iff_policy_equals_reference_and_has_gradient() -> None:
    logits = torch.randn(2, 3, 5, generator=_gen(7), requires_grad=True)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    mask = torch.ones(2, 3)
    same = policy_terms(logits, logits.detach().clone(), tokens, mask)
    torch.testing.assert_close(same.kl, torch.zeros(2, 3), atol=1e-6, rtol=0)
    # shifting all logits of a row by a constant leaves the distribution (and KL) unchanged
    shifted = policy_terms(logits, logits.detach() + 3.0, tokens, mask)
    torch.testing.assert_close(shifted.kl, torch.zeros(2, 3), atol=1e-5, rtol=0)
    other = policy_terms(logits, logits.detach() * 0.5, tokens, mask)
    assert bool((other.kl > 1e-4).all())
    loss, _ = reinforce_loss(other, torch.zeros(2), kl_coeff=1.0)
    loss.backward()
    assert logits.grad.abs().sum() > 0  # KL pulls the policy, the reference is detached


# ------------------------------------------------------------------------------------ masking


def test_mask_includes_eos_and_excludes_padding() -> None:
    """Tokens [w, w, EOS, pad, pad]: EOS's log-prob counts, the padding's does not."""
    eos, pad, vocab = 2, 0, 5
    seqs = torch.tensor([[3, 4, eos, pad, pad], [4, 3, 4, 3, 4]])
    lengths = torch.tensor([3, 5])
    mask = sequence_mask(lengths, 5)
    assert mask.tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert ends_with_eos(seqs, lengths, eos).tolist() == [True, False]
    logits = torch.randn(2, 5, vocab, generator=_gen(8), requires_grad=True)
    ref = torch.randn(2, 5, vocab, generator=_gen(9))
    terms = policy_terms(logits, ref, seqs, mask)
    loss, m = reinforce_loss(
        terms, torch.tensor([1.0, -0.5]), 0.1, 0.01, eos=ends_with_eos(seqs, lengths, eos)
    )
    loss.backward()
    g = logits.grad.abs().sum(-1)  # (N, L)
    assert g[0, 3:].sum() == 0  # padding after EOS: no gradient
    assert g[0, 2] > 0  # EOS itself: gradient (negative control)
    lp = logits.detach().log_softmax(-1).gather(2, seqs[..., None])[..., 0]
    torch.testing.assert_close(terms.logprobs[0].sum(), lp[0, :3].sum())
    assert m["length_mean"].item() == 4.0 and m["eos_frac"].item() == 0.5
    # token normalisation divides by the 8 real tokens, not the 10 positions
    expected_pg = -(1.0 * lp[0, :3].sum() - 0.5 * lp[1].sum()) / 8
    torch.testing.assert_close(m["pg_loss"], expected_pg)


# ----------------------------------------------------------------------------------- baselines


def test_ema_baseline_sequence_by_hand() -> None:
    ema = build_baseline("ema", decay=0.5)
    r1 = torch.tensor([1.0, 3.0])
    torch.testing.assert_close(advantages(r1, 2, ema), torch.tensor([-1.0, 1.0]))  # first: mean
    ema.update(r1.mean())  # b = 2
    r2 = torch.tensor([4.0, 6.0])
    torch.testing.assert_close(advantages(r2, 2, ema), torch.tensor([2.0, 4.0]))
    ema.update(5.0)  # b = 0.5 * 2 + 0.5 * 5 = 3.5
    assert ema.value == pytest.approx(3.5)
    ema.update(torch.tensor(1.5))  # b = 0.5 * 3.5 + 0.5 * 1.5 = 2.5
    assert ema.value == pytest.approx(2.5)
    torch.testing.assert_close(
        advantages(torch.tensor([2.5, 3.0]), 1, ema), torch.tensor([0.0, 0.5])
    )
    with pytest.raises(ValueError, match="decay"):
        EMABaseline(decay=1.0)
    with pytest.raises(ValueError, match="non-finite"):
        ema.update(float("nan"))


def test_ema_state_round_trips_through_weights_only_load() -> None:
    ema = EMABaseline(decay=0.9)
    ema.update(0.7)
    ema.update(1.2)
    buf = io.BytesIO()
    torch.save({"baseline": ema.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["baseline"]
    fresh = EMABaseline(decay=0.9)
    assert not fresh.initialized
    fresh.load_state_dict(state)
    assert fresh.initialized and fresh.value == ema.value
    r = torch.tensor([0.1, 0.4, 2.0, 0.3])
    torch.testing.assert_close(advantages(r, 2, fresh), advantages(r, 2, ema))
    # negative control: an uninitialised baseline would give different advantages
    assert not torch.allclose(advantages(r, 2, EMABaseline(0.9)), advantages(r, 2, ema))


def test_greedy_baseline_is_the_greedy_reward_of_the_same_image() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.5, 0.5, 0.5])  # B=2, K=3
    greedy = torch.tensor([1.5, 0.25])
    adv = advantages(rewards, 3, GreedyBaseline(), greedy)
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, 1.5, 0.25, 0.25, 0.25]))
    full = advantages(rewards, 3, GreedyBaseline(), greedy.repeat_interleave(3))
    torch.testing.assert_close(full, adv)
    with pytest.raises(ValueError, match="greedy_rewards"):
        advantages(rewards, 3, GreedyBaseline())
    with pytest.raises(ValueError, match="shape"):
        advantages(rewards, 3, GreedyBaseline(), torch.ones(4))


def test_loo_baseline_by_hand() -> None:
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 4.0])  # B=2, K=4
    expected_b = torch.tensor([11 / 3, 10 / 3, 3.0, 2.0, 4 / 3, 4 / 3, 4 / 3, 0.0])
    adv = advantages(rewards, 4, build_baseline("loo"))
    torch.testing.assert_close(adv, rewards - expected_b)
    # RLOO identity: adv = K/(K-1) (r - group mean), so advantages sum to 0 per image
    torch.testing.assert_close(adv.view(2, 4).sum(1), torch.zeros(2), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="k >= 2"):
        advantages(rewards, 1, LeaveOneOutBaseline())


def test_baseline_registry_and_errors() -> None:
    assert set(BASELINES) == {"ema", "greedy", "loo", "rloo", "grpo"}
    assert BASELINES["rloo"] is BASELINES["loo"]  # one formula, two names
    with pytest.raises(ValueError, match="Did you mean 'loo'"):
        build_baseline("lo")
    with pytest.raises(ValueError, match="samples per image"):
        advantages(torch.ones(5), 2, LeaveOneOutBaseline())
    with pytest.raises(ValueError, match="one per sequence"):
        terms = policy_terms(
            torch.zeros(2, 1, 3), None, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
        )
        reinforce_loss(terms, torch.zeros(3))


# ------------------------------------------------------------------------------------- rewards

CORPUS = {
    1: ["A man riding a horse on a beach.", "A person rides a brown horse along the sand."],
    2: ["Two dogs play with a red ball.", "A pair of dogs chasing a ball in the grass."],
    3: ["A plate of food with broccoli and rice.", "Rice, broccoli and chicken on a white plate."],
    4: ["A man riding a bike down the street.", "A cyclist on a city street."],
}


def test_cider_reward_single_image_matches_score_many() -> None:
    reward = CaptionReward(CORPUS, kind="cider")
    cand = ["A man is riding a horse on the beach!"]
    refs = [CORPUS[1]]
    r = reward(cand, refs)
    tok = [ptb_tokenize_caption(cand[0])]
    tok_refs = [[ptb_tokenize_caption(c) for c in refs[0]]]
    expected = CiderD(ptb_tokenize(CORPUS)).score_many(tok, tok_refs)
    assert r.shape == (1,) and r.dtype == torch.float32
    assert r.item() > 0.1  # one image alone is not 0 (df from the corpus, not from the batch)
    assert r.item() == pytest.approx(float(expected[0]), rel=1e-6)
    # negative control: df from the single image itself gives ~0, so the corpus df matters
    _, alone = CiderD().compute_score({0: tok_refs[0]}, {0: tok})
    assert float(alone[0]) < 1e-6
    # tokenization is applied to candidates: case and punctuation do not change the reward
    same = reward(["a MAN is riding a horse on the beach"], refs)
    assert same.item() == pytest.approx(r.item(), rel=1e-6)


def test_bleu4_and_mix_rewards() -> None:
    cands = ["a man riding a horse on a beach", "two cats sleeping"]
    refs = [CORPUS[1], CORPUS[2]]
    tok_refs = [ptb_tokenize({0: rs})[0] for rs in refs]
    bleu = CaptionReward(CORPUS, kind="bleu4")(cands, refs)
    torch.testing.assert_close(bleu, torch.from_numpy(sentence_bleu(cands, tok_refs, 4)).float())
    cider = CaptionReward(CORPUS)(cands, refs)
    mix = CaptionReward(CORPUS, kind="mix", weights={"cider": 0.5, "bleu4": 2.0})(cands, refs)
    torch.testing.assert_close(mix, 0.5 * cider + 2.0 * bleu)
    assert cider[0] > cider[1]
    with pytest.raises(ValueError, match="unknown"):
        CaptionReward(CORPUS, kind="meteor")
    with pytest.raises(ValueError, match="reference lists"):
        CaptionReward(CORPUS)(cands, refs[:1])


# ---------------------------------------------------------------------------- frozen reference


def test_frozen_reference_has_no_trainable_params_and_never_changes() -> None:
    torch.manual_seed(0)
    policy = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)
    )
    ref = frozen_reference(policy)
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(p.requires_grad for p in policy.parameters())  # the policy is untouched
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    check_frozen_reference(ref, policy, opt)
    x = torch.randn(6, 4, generator=_gen(10))
    loss = policy(x).pow(2).sum() + ref(x).pow(2).sum()  # ref output carries no graph
    assert not ref(x).requires_grad
    loss.backward()
    opt.step()
    assert all(torch.equal(before[k], v) for k, v in ref.state_dict().items())
    assert not torch.equal(policy[0].weight, ref[0].weight)  # negative control: policy moved
    ref.train()  # must stay in eval: dropout off, deterministic outputs
    assert not ref.training and not ref[1].training
    torch.testing.assert_close(ref(x), ref(x))


def test_check_frozen_reference_catches_wiring_mistakes() -> None:
    policy = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="trainable"):
        check_frozen_reference(torch.nn.Linear(3, 3), policy)
    shared = torch.nn.Linear(3, 3)
    shared.weight, shared.bias = policy.weight, policy.bias
    shared.requires_grad_(False)
    with pytest.raises(ValueError, match="shares parameters"):
        check_frozen_reference(shared, policy)
    ref = frozen_reference(policy)
    opt = torch.optim.SGD([*policy.parameters(), *ref.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="optimizer"):
        check_frozen_reference(ref, policy, opt)


# ------------------------------------------------------------------- teacher-forced alignment


def test_sequence_logits_match_sampled_logprobs_of_captioner() -> None:
    """policy_terms on sequence_logits reproduce generate's raw-policy token log-probs."""
    vocab, bos, eos, pad, k = 16, 1, 2, 0, 3
    torch.manual_seed(0)
    v_cfg = VisionTowerConfig(image_size=16, patch_size=8, width=32, layers=1, heads=2)
    dims = ConnectorDims(32, 1 + v_cfg.num_patches, 32, 1, 2)
    conn = build_connector("projector", dims)
    dec = CausalDecoder(
        TextTowerConfig(vocab, conn.num_prefix_tokens() + 12, width=32, layers=1, heads=2)
    )
    model = Captioner(VisionTower(v_cfg), conn, dec, bos, eos, pad).eval()
    images = torch.rand(2, 3, 16, 16, generator=_gen(11))
    prompt = torch.tensor([[pad, bos], [bos, 5]])  # left-padded prompts of different lengths
    pmask = (prompt != pad).long()
    inputs = {"images": images, "input_ids": prompt, "attention_mask": pmask}
    out = generate(
        CaptionerTarget(model),
        inputs,
        "sample",
        max_new_tokens=8,
        top_p=0.9,
        generator=_gen(12),
        num_return_sequences=k,
    )
    rep = lambda x: x.repeat_interleave(k, 0)  # noqa: E731
    mask = sequence_mask(out.lengths, out.sequences.shape[1])
    with torch.no_grad():
        logits = sequence_logits(
            model, rep(images), rep(prompt), rep(pmask), out.sequences, out.lengths
        )
    terms = policy_terms(logits, logits, out.sequences, mask)
    torch.testing.assert_close(terms.logprobs, out.token_logprobs * mask, atol=1e-4, rtol=0)
    torch.testing.assert_close(terms.kl, torch.zeros_like(terms.kl), atol=1e-5, rtol=0)
    # negative control: off by one position the log-probs disagree
    shifted = policy_terms(logits.roll(1, dims=1), None, out.sequences, mask)
    assert not torch.allclose(shifted.logprobs, out.token_logprobs * mask, atol=1e-2)


# ----------------------------------------------------------------------- end to end (toy policy)


def _train_toy(kl_coeff: float, steps: int = 200) -> tuple[float, float, float, torch.Tensor]:
    """A position-wise categorical "captioner" over 5 words, 3 tokens per caption, learns to say
    the target word (reward = fraction of target tokens) with REINFORCE + an EMA baseline.

    Returns (first-step mean reward, last-20-steps mean reward, final per-token KL to the ref,
    final logits (L, V)).
    """
    vocab, length, b, k, target = 5, 3, 8, 4, 3
    torch.manual_seed(0)
    init = torch.randn(length, vocab) * 0.1
    init[:, target] -= 1.0  # the reference rarely says the target word
    theta = torch.nn.Parameter(init.clone())
    ref_logits = init[None].expand(b * k, -1, -1)  # frozen reference = the starting policy
    opt = torch.optim.Adam([theta], lr=0.05)
    ema, g, rewards_seen = EMABaseline(decay=0.9), _gen(13), []
    for _ in range(steps):
        logits = theta[None].expand(b * k, -1, -1)  # (N, L, V)
        probs = logits.detach().softmax(-1).reshape(-1, vocab)
        tokens = torch.multinomial(probs, 1, generator=g).view(b * k, length)
        reward = (tokens == target).float().mean(1)  # (N,)
        adv = advantages(reward, k, ema)
        ema.update(reward.mean())  # single process: the local mean is the global mean
        terms = policy_terms(logits, ref_logits, tokens, torch.ones(b * k, length))
        loss, metrics = reinforce_loss(terms, adv, kl_coeff=kl_coeff, rewards=reward)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rewards_seen.append(metrics["reward_mean"].item())
    final_kl = policy_terms(theta[None].detach(), init[None], tokens[:1], torch.ones(1, length)).kl
    return rewards_seen[0], sum(rewards_seen[-20:]) / 20, final_kl.mean().item(), theta.detach()


def test_toy_policy_learns_and_kl_holds_it_near_reference() -> None:
    start, end_free, kl_free, _ = _train_toy(kl_coeff=0.0)
    _, end_tied, kl_tied, theta = _train_toy(kl_coeff=0.5)
    assert start < 0.25
    assert end_free > 0.85  # reward rises from ~0.07 to ~1
    assert end_tied < 0.3 and kl_tied < 0.05
    assert kl_free > 10 * kl_tied
    # token-normalised objective per position: p(target) / L - kl_coeff * KL(pi || ref), whose
    # optimum is pi* ∝ ref * exp(onehot(target) / (L * kl_coeff)); the trained policy is there
    torch.manual_seed(0)
    init = torch.randn(3, 5) * 0.1
    init[:, 3] -= 1.0
    optimum = (init + F.one_hot(torch.tensor(3), 5) / (3 * 0.5)).softmax(-1)
    torch.testing.assert_close(theta.softmax(-1), optimum, atol=0.04, rtol=0)  # SGD noise ~0.02
    # negative control: the reference itself is not within that tolerance of the optimum
    assert not torch.allclose(init.softmax(-1), optimum, atol=0.06)
