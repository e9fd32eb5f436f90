"""The rl baselines ``rloo`` and ``grpo`` give TRL 1.16's advantages on identical rewards.

TRL's formulas are re-derived here from its trainers' documented math, independently of
vltrain's code: RLOOTrainer (``normalize_advantages=False``, its default)
``A_i = r_i - (sum_g r_g - r_i) / (K - 1)``; GRPOTrainer (``scale_rewards="group"``, default)
``A_i = (r_i - mean_g) / (std_g + 1e-4)`` with the Bessel-corrected std (TRL's ``nanstd``:
``mean((r - mean)^2) * count / (count - 1)``), and ``scale_rewards="none"``: ``r_i - mean_g``.
Each formula is written twice: in float32 with the same reductions TRL uses (``torch.nanmean``,
``nansum``, the count correction as a tensor), compared bit for bit, and in float64 Python
loops, compared within float32 rounding. bench/trl_advantage_parity.py runs TRL's own trainers.
"""

from __future__ import annotations

import math

import pytest
import torch

from vltrain.objectives.reinforce import GroupNormBaseline, advantages, build_baseline


def _trl_rloo_f32(rewards: torch.Tensor, k: int) -> torch.Tensor:
    grouped = rewards.view(-1, k)
    counts = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped, dim=1, keepdim=True)
    return rewards - ((grouped_sum - grouped) / (counts - 1)).view(-1)


def _trl_nanstd(t: torch.Tensor) -> torch.Tensor:  # over dim 1
    mean = torch.nanmean(t, dim=1, keepdim=True)
    var = torch.nanmean((t - mean) ** 2, dim=1, keepdim=True)
    count = torch.sum(~torch.isnan(t), dim=1, keepdim=True)
    return torch.sqrt(var * (count / (count - 1))).squeeze(1)


def _trl_grpo_f32(rewards: torch.Tensor, k: int, scale: str) -> torch.Tensor:
    mean = torch.nanmean(rewards.view(-1, k), dim=1).repeat_interleave(k)
    adv = rewards - mean
    if scale == "group":
        adv = adv / (_trl_nanstd(rewards.view(-1, k)).repeat_interleave(k) + 1e-4)
    return adv


def _rloo_f64(rewards: list[float], k: int) -> list[float]:
    out = []
    for b in range(len(rewards) // k):
        g = rewards[b * k : (b + 1) * k]
        out += [r - (sum(g) - r) / (k - 1) for r in g]
    return out


def _grpo_f64(rewards: list[float], k: int, scale: str) -> list[float]:
    out = []
    for b in range(len(rewards) // k):
        g = rewards[b * k : (b + 1) * k]
        mean = sum(g) / k
        std = math.sqrt(sum((r - mean) ** 2 for r in g) / (k - 1))
        out += [(r - mean) / (std + 1e-4) if scale == "group" else r - mean for r in g]
    return out


def _reward_sets() -> list[tuple[int, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    sets = [
        (2, torch.tensor([0.3, 1.7, 2.0, 2.0, 0.0, 5.0])),  # K=2, one tied pair
        (3, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.7])),  # a fully tied group, two ties
        (4, torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 4.0])),
    ]
    for k in (2, 3, 4, 5, 8, 16):
        for b in (1, 3, 7):
            r = torch.rand(b * k, generator=gen) * 3.0  # CIDEr-D-like range
            sets.append((k, r))
            sets.append((k, torch.round(r * 2) / 2))  # coarse: many ties
    return sets


@pytest.mark.parametrize("name", ["rloo", "loo"])
def test_rloo_advantages_equal_trl_formula(name: str) -> None:
    for k, r in _reward_sets():
        ours = advantages(r, k, build_baseline(name))
        assert torch.equal(ours, _trl_rloo_f32(r, k)), (k, r)
        ref = torch.tensor(_rloo_f64(r.double().tolist(), k), dtype=torch.float32)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", ["group", "none"])
def test_grpo_advantages_equal_trl_formula(scale: str) -> None:
    for k, r in _reward_sets():
        ours = advantages(r, k, build_baseline("grpo", scale=scale))
        assert torch.equal(ours, _trl_grpo_f32(r, k, scale)), (k, r)
        ref = torch.tensor(_grpo_f64(r.double().tolist(), k, scale), dtype=torch.float32)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_grpo_by_hand_ties_and_k2() -> None:
    # K=2: mean 1, unbiased std sqrt(2) -> (+-1) / (sqrt(2) + 1e-4); tied group -> 0 exactly
    adv = advantages(torch.tensor([0.0, 2.0, 0.5, 0.5]), 2, GroupNormBaseline())
    a = 1 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([-a, a, 0.0, 0.0]))
    assert torch.equal(adv[2:], torch.zeros(2))
    # negative control: the biased std (divide by K) would give 1 / (1 + 1e-4), not ~0.7071
    assert abs(float(adv[1]) - 1 / (1 + 1e-4)) > 0.2
    # scale="none" is only centred; group-normalised advantages sum to 0 per image as well
    none = advantages(torch.tensor([0.0, 2.0, 1.0, 4.0]), 2, GroupNormBaseline("none"))
    torch.testing.assert_close(none, torch.tensor([-1.0, 1.0, -1.5, 1.5]))


def test_grpo_errors() -> None:
    with pytest.raises(ValueError, match="k >= 2"):
        advantages(torch.ones(3), 1, GroupNormBaseline())
    with pytest.raises(ValueError, match="scale"):
        GroupNormBaseline("batch")
