"""REINFORCE for captioning: sequence rewards, baselines, per-token policy terms and the loss.

Per image the stage samples K captions (nucleus sampling), scores them with :class:`CaptionReward`
(CIDEr-D, BLEU-4 or a weighted mix against the ground-truth captions), turns rewards into
advantages with a baseline from :data:`BASELINES` (``ema``, ``greedy`` = self-critical, ``loo`` /
``rloo`` = leave-one-out, ``grpo`` = group-normalised), and minimises

    loss = -mean(A * log pi(sampled tokens)) + kl_coeff * KL(pi || pi_ref) - entropy_coeff * H(pi)

with ``pi_ref`` the starting model (``vltrain.objectives.reference``: a frozen copy, or for a
policy with peft (LoRA) adapters the policy itself with its adapters disabled). The math, the
normalisation choices and the wiring rules are written up in ``docs/rl.md``.

Conventions: rows are grouped per image, image b owns rows ``[b*K, (b+1)*K)`` (what
``vltrain.inference.decoding.generate(..., num_return_sequences=K)`` returns). ``logits[:, t]``
is the distribution the model used to draw ``tokens[:, t]`` (see :func:`sequence_logits`); the
mask covers the sampled tokens up to and including EOS and excludes the padding after it.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.eval.caption_metrics import CiderD, sentence_bleu
from vltrain.eval.ptb_tokenize import ptb_tokenize, ptb_tokenize_caption

__all__ = [
    "BASELINES",
    "CaptionReward",
    "EMABaseline",
    "GreedyBaseline",
    "GroupNormBaseline",
    "LeaveOneOutBaseline",
    "PolicyTerms",
    "advantages",
    "build_baseline",
    "ends_with_eos",
    "policy_terms",
    "reinforce_loss",
    "sequence_logits",
    "sequence_mask",
]

REWARD_KINDS = ("cider", "bleu4", "mix")
Normalize = Literal["token", "sequence"]


# ------------------------------------------------------------------------------------- rewards


class CaptionReward:
    """Per-caption reward: CIDEr-D, BLEU-4, or ``sum_m weights[m] * metric_m`` (``kind="mix"``).

    CIDEr-D document frequencies come once from ``refs_corpus`` (``{image_id: [captions]}``, the
    training references), so one image scored alone gets a meaningful reward (with df from that
    image only, CIDEr-D of a single image is ~0). Every caption, corpus, reference and candidate,
    is PTB-tokenized the same way (lower-cased, punctuation dropped) before scoring.
    """

    def __init__(
        self,
        refs_corpus: Mapping[Any, Sequence[str]],
        kind: str = "cider",
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if kind not in REWARD_KINDS:
            raise ValueError(f"reward kind {kind!r} is unknown; choose one of {REWARD_KINDS}")
        if weights is None:
            weights = {"cider": 1.0, "bleu4": 1.0} if kind == "mix" else {kind: 1.0}
        elif kind != "mix":
            raise ValueError(f"weights={dict(weights)} only apply to kind='mix', got {kind!r}")
        unknown = sorted(set(weights) - {"cider", "bleu4"})
        if unknown:
            raise ValueError(f"reward weights {unknown} are unknown; use keys 'cider', 'bleu4'")
        self.kind = kind
        self.weights = {m: float(w) for m, w in weights.items()}
        self._cider = CiderD(ptb_tokenize(refs_corpus)) if "cider" in self.weights else None

    def __call__(self, candidates: Sequence[str], refs: Sequence[Sequence[str]]) -> Tensor:
        """Rewards (N,) float32 of ``candidates[i]`` against ``refs[i]`` (one list per caption).

        With K samples per image, repeat each image's references K times
        (``[r for r in refs for _ in range(K)]``).
        """
        if len(candidates) != len(refs):
            raise ValueError(
                f"got {len(candidates)} candidates but {len(refs)} reference lists; pass one "
                "list per candidate (repeat an image's references for each of its K samples)"
            )
        cands = [ptb_tokenize_caption(c) for c in candidates]
        memo: dict[str, str] = {}  # an image's refs recur K times: tokenize each once
        for r in {r for rs in refs for r in rs}:
            memo[r] = ptb_tokenize_caption(r)
        toks = [[memo[r] for r in rs] for rs in refs]
        total = np.zeros(len(cands))
        for metric, w in self.weights.items():
            if metric == "cider":
                total += w * self._cider.score_many(cands, toks)
            else:
                total += w * sentence_bleu(cands, toks, n=4)
        return torch.from_numpy(total).float()


# ------------------------------------------------------------------------------------ baselines


class Baseline:
    """Per-sample baseline b_i; the advantage is ``reward_i - b_i`` (see :func:`advantages`)."""

    def __call__(self, rewards: Tensor, k: int, greedy_rewards: Tensor | None = None) -> Tensor:
        """Baseline for each of the B*K ``rewards`` (B*K,); must not depend on sample i itself."""
        raise NotImplementedError

    def advantages(self, rewards: Tensor, k: int, greedy_rewards: Tensor | None = None) -> Tensor:
        """Advantages (B*K,) of float32 ``rewards``: ``rewards - baseline`` unless overridden."""
        return rewards - self(rewards, k, greedy_rewards).detach()

    def update(self, global_mean_reward: float | Tensor) -> None:
        """Fold in this step's mean reward (already all-reduced across ranks). No-op by default."""

    def state_dict(self) -> dict[str, Any]:
        """Resumable state (plain floats/bools: loads under ``torch.load(weights_only=True)``)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class EMABaseline(Baseline):
    """Exponential moving average of past mean rewards: ``b <- decay * b + (1 - decay) * r``.

    The first :meth:`update` sets ``b`` to the mean it is given. Before any update (the first
    step) the baseline is the mean of the rewards passed in. The caller computes advantages
    first and then calls ``update(all_reduce_mean(rewards.mean()))``, so the baseline of a step
    holds only past rewards and every rank holds the same value.
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema baseline decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.value = 0.0
        self.initialized = False

    def __call__(self, rewards: Tensor, k: int, greedy_rewards: Tensor | None = None) -> Tensor:
        value = self.value if self.initialized else float(rewards.float().mean())
        return torch.full_like(rewards, value, dtype=torch.float32)

    def update(self, global_mean_reward: float | Tensor) -> None:
        r = float(global_mean_reward)
        if not math.isfinite(r):
            raise ValueError(f"ema baseline got a non-finite mean reward {r}; check the rewards")
        self.value = r if not self.initialized else self.decay * self.value + (1 - self.decay) * r
        self.initialized = True

    def state_dict(self) -> dict[str, Any]:
        return {"value": float(self.value), "initialized": bool(self.initialized)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = sorted({"value", "initialized"} - set(state))
        if missing:
            raise KeyError(f"ema baseline state lacks {missing}; got keys {sorted(state)}")
        self.value = float(state["value"])
        self.initialized = bool(state["initialized"])


class GreedyBaseline(Baseline):
    """Self-critical (SCST): b_i = reward of the greedy caption of sample i's image."""

    def __call__(self, rewards: Tensor, k: int, greedy_rewards: Tensor | None = None) -> Tensor:
        if greedy_rewards is None:
            raise ValueError(
                "the greedy baseline needs greedy_rewards: decode each image greedily (no grad) "
                "and score it with the same reward"
            )
        g = greedy_rewards.to(rewards.device, torch.float32)
        if g.shape == (rewards.shape[0] // k,):
            g = g.repeat_interleave(k)  # (B*K,)
        if g.shape != rewards.shape:
            raise ValueError(
                f"greedy_rewards has shape {tuple(g.shape)}; expected (B,) = "
                f"({rewards.shape[0] // k},) or (B*K,) = {tuple(rewards.shape)}"
            )
        return g


class LeaveOneOutBaseline(Baseline):
    """Leave-one-out (RLOO): b_i = mean reward of the other K-1 samples of the same image.

    The advantage ``r_i - (sum_j r_j - r_i) / (K - 1)`` is TRL's ``RLOOTrainer`` formula (its
    default ``normalize_advantages=False``); registered as ``loo`` and ``rloo``.
    """

    def __call__(self, rewards: Tensor, k: int, greedy_rewards: Tensor | None = None) -> Tensor:
        if k < 2:
            raise ValueError(f"the loo baseline needs k >= 2 samples per image, got k={k}")
        r = rewards.float().view(-1, k)  # (B, K)
        return ((r.sum(1, keepdim=True) - r) / (k - 1)).reshape(-1)  # (B*K,)


GRPO_SCALES = ("group", "none")


class GroupNormBaseline(Baseline):
    """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)`` over the K samples g of sample i's image.

    TRL's ``GRPOTrainer`` convention: ``std_g`` is the unbiased (Bessel, K - 1) std and ``eps`` is
    added to it, 1e-4. ``scale="none"`` keeps ``r_i - mean_g`` (TRL's ``scale_rewards="none"``,
    Dr. GRPO). A group of equal rewards gets advantage 0. The baseline itself is ``mean_g``.
    """

    def __init__(self, scale: str = "group", eps: float = 1e-4) -> None:
        if scale not in GRPO_SCALES:
            raise ValueError(f"grpo scale must be one of {GRPO_SCALES}, got {scale!r}")
        if not eps > 0:
            raise ValueError(f"grpo eps must be > 0, got {eps}")
        self.scale, self.eps = scale, eps

    def __call__(self, rewards: Tensor, k: int, greedy_rewards: Tensor | None = None) -> Tensor:
        if k < 2:
            raise ValueError(f"the grpo baseline needs k >= 2 samples per image, got k={k}")
        return rewards.float().view(-1, k).mean(1).repeat_interleave(k)  # (B*K,)

    def advantages(self, rewards: Tensor, k: int, greedy_rewards: Tensor | None = None) -> Tensor:
        centred = rewards - self(rewards, k)  # (B*K,)
        if self.scale == "none":
            return centred
        r = rewards.float().view(-1, k)  # (B, K)
        var = ((r - r.mean(1, keepdim=True)) ** 2).mean(1, keepdim=True) * (k / (k - 1))
        return centred / (var.sqrt().view(-1).repeat_interleave(k) + self.eps)


BASELINES: dict[str, type[Baseline]] = {
    "ema": EMABaseline,
    "greedy": GreedyBaseline,
    "loo": LeaveOneOutBaseline,
    "rloo": LeaveOneOutBaseline,
    "grpo": GroupNormBaseline,
}


def build_baseline(name: str, **kwargs: Any) -> Baseline:
    """A baseline by registry key (``ema`` takes ``decay``, ``grpo`` ``scale`` and ``eps``)."""
    if name not in BASELINES:
        close = difflib.get_close_matches(name, list(BASELINES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown baseline {name!r}; choose one of {sorted(BASELINES)}.{hint}")
    return BASELINES[name](**kwargs)


def advantages(
    rewards: Tensor, k: int, baseline: Baseline, greedy_rewards: Tensor | None = None
) -> Tensor:
    """``rewards - baseline`` (B*K,) float32, detached; rows grouped per image (K each).

    Does not update the baseline: call ``baseline.update(...)`` afterwards (see EMABaseline).
    """
    if rewards.ndim != 1 or k < 1 or rewards.shape[0] % k != 0:
        raise ValueError(
            f"rewards must be (B*K,) with K={k} samples per image; got shape {tuple(rewards.shape)}"
        )
    r = rewards.detach().float()
    return baseline.advantages(r, k, greedy_rewards).detach()


# --------------------------------------------------------------------------- sequences, masks


def sequence_mask(lengths: Tensor, max_len: int) -> Tensor:
    """(N, max_len) bool: True for the first ``lengths[i]`` tokens (EOS included when emitted)."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def ends_with_eos(sequences: Tensor, lengths: Tensor, eos_id: int | Sequence[int]) -> Tensor:
    """(N,) bool: the sampled sequence stopped with an EOS id (`eos_id`: one, or every id that
    ends a row), not cut off at max_new_tokens."""
    last = sequences.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]  # (N,)
    ids = [eos_id] if isinstance(eos_id, int) else list(eos_id)
    return torch.isin(last, torch.tensor(ids, dtype=last.dtype, device=last.device)) & (lengths > 0)


def sequence_logits(
    model: nn.Module,
    images: Tensor,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sequences: Tensor,
    lengths: Tensor,
) -> Tensor:
    """Teacher-forced logits (N, L, V) aligned with ``sequences`` (N, L): row t drew token t.

    ``model`` is a :class:`~vltrain.models.captioner.Captioner` (its ``forward``); images and the
    left-padded prompt are per row (repeat them K times for K samples). The input is
    ``[prompt | sequences]``; padding after EOS is masked out of attention.
    """
    seq_mask = sequence_mask(lengths, sequences.shape[1]).to(prompt_mask.dtype)  # (N, L)
    input_ids = torch.cat([prompt_ids, sequences], 1)  # (N, P + L)
    attention_mask = torch.cat([prompt_mask, seq_mask], 1)
    logits = model(images, input_ids, attention_mask)["logits"]  # (N, P + L, V)
    p = prompt_ids.shape[1]
    return logits[:, p - 1 : -1]  # position P-1+t predicts token t


# ----------------------------------------------------------------------------- policy terms


@dataclass
class PolicyTerms:
    """Per-token terms of the sampled sequences, all (N, L), zero where ``mask`` is 0."""

    logprobs: Tensor
    """log pi(token_t | prefix), with gradient."""
    kl: Tensor
    """Exact KL(pi || pi_ref) of the next-token distributions, with gradient through pi."""
    entropy: Tensor
    """H(pi) of the next-token distribution, with gradient."""
    mask: Tensor
    """float mask: 1 for sampled tokens up to and including EOS."""


def policy_terms(
    logits: Tensor, ref_logits: Tensor | None, tokens: Tensor, mask: Tensor
) -> PolicyTerms:
    """Per-token log pi(token), KL(pi || pi_ref) and H(pi) from teacher-forced logits.

    logits, ref_logits: (N, L, V), row t is the distribution token t was drawn from (raw
    policy, temperature 1); tokens, mask: (N, L). ``ref_logits=None`` gives KL = 0 (skip the
    reference forward when ``kl_coeff == 0``). KL is the exact sum over the vocabulary,
    ``sum_v pi_v (log pi_v - log ref_v)``; computed in fp32.
    """
    if logits.shape[:2] != tokens.shape or mask.shape != tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, tokens {tuple(tokens.shape)} and mask "
            f"{tuple(mask.shape)} must agree on (N, L)"
        )
    m = mask.to(torch.float32)  # (N, L)
    logp = F.log_softmax(logits.float(), dim=-1)  # (N, L, V)
    p = logp.exp()
    token_lp = logp.gather(-1, tokens[..., None].long())[..., 0]  # (N, L)
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))  # 0 * log 0 = 0
    entropy = -plogp.sum(-1)  # (N, L)
    if ref_logits is None:
        kl = torch.zeros_like(token_lp)
    else:
        if ref_logits.shape != logits.shape:
            raise ValueError(
                f"ref_logits {tuple(ref_logits.shape)} must match logits {tuple(logits.shape)}"
            )
        ref_logp = F.log_softmax(ref_logits.detach().float(), dim=-1)  # (N, L, V)
        cross = torch.where(p > 0, p * ref_logp, torch.zeros_like(p)).sum(-1)  # (N, L)
        kl = plogp.sum(-1) - cross
    return PolicyTerms(token_lp * m, kl * m, entropy * m, m)


# ------------------------------------------------------------------------------------- loss


def _reduce(x: Tensor, mask: Tensor, normalize: Normalize) -> Tensor:
    """Token: sum / #tokens. Sequence: mean over rows of the per-row sum."""
    if normalize == "token":
        return x.sum() / mask.sum().clamp(min=1)
    return x.sum(1).mean()


def _std(x: Tensor) -> Tensor:
    return x.float().std(correction=0) if x.numel() else x.new_zeros(())


def reinforce_loss(
    terms: PolicyTerms,
    advantages: Tensor,
    kl_coeff: float = 0.0,
    entropy_coeff: float = 0.0,
    normalize: Normalize = "token",
    rewards: Tensor | None = None,
    lengths: Tensor | None = None,
    eos: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``-mean(A * log pi) + kl_coeff * mean KL - entropy_coeff * mean H`` and detached metrics.

    ``normalize="token"``: every term is a mean over all sampled tokens of the batch.
    ``"sequence"``: a mean over sequences of per-sequence sums (``log pi(sequence)``, the
    sequence-level KL and entropy), i.e. ~length times larger; retune the coefficients.
    ``advantages`` (N,) are detached. ``rewards`` (N,), ``lengths`` (N,) and ``eos`` (N,) bool
    only feed the metrics (lengths default to the mask's row sums).
    """
    if normalize not in ("token", "sequence"):
        raise ValueError(f"normalize must be 'token' or 'sequence', got {normalize!r}")
    n = terms.logprobs.shape[0]
    if advantages.shape != (n,):
        raise ValueError(
            f"advantages must be ({n},), one per sequence; got {tuple(advantages.shape)}"
        )
    a = advantages.detach().float()[:, None]  # (N, 1)
    pg = -_reduce(a * terms.logprobs, terms.mask, normalize)
    kl = _reduce(terms.kl, terms.mask, normalize)
    ent = _reduce(terms.entropy, terms.mask, normalize)
    loss = pg + kl_coeff * kl - entropy_coeff * ent
    n_tok = terms.mask.sum().clamp(min=1)
    lengths = terms.mask.sum(1) if lengths is None else lengths
    metrics = {
        "pg_loss": pg.detach(),
        "kl": (terms.kl.detach().sum() / n_tok),  # per token, whatever the normalisation
        "entropy": (terms.entropy.detach().sum() / n_tok),
        "adv_mean": a.mean(),
        "adv_std": _std(a),
        "length_mean": lengths.float().mean(),
    }
    if rewards is not None:
        metrics["reward_mean"] = rewards.detach().float().mean()
        metrics["reward_std"] = _std(rewards.detach())
    if eos is not None:
        metrics["eos_frac"] = eos.float().mean()
    return loss, metrics
