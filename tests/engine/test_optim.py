from __future__ import annotations

import math

import pytest
from torch import nn

from vltrain.config import ConfigError, load_config
from vltrain.engine.optim import build_optimizer, lr_factor, param_groups


def _cfg(*overrides: str):
    return load_config(None, ["train.max_steps=100", *overrides]).optim


@pytest.mark.parametrize(
    "schedule, step, expected",
    [
        ("cosine", 0, 0.1),
        ("cosine", 9, 1.0),
        ("cosine", 10, 1.0),
        ("cosine", 10 + 89 // 2, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (44 / 89)))),
        ("cosine", 99, 0.1),
        ("linear", 99, 0.1),
        ("linear", 10, 1.0),
        ("linear", 54, 0.1 + 0.9 * (1 - 44 / 89)),
        ("constant", 99, 1.0),
        ("constant", 4, 0.5),
    ],
)
def test_schedule_values_at_key_steps(schedule: str, step: int, expected: float) -> None:
    cfg = _cfg("optim.warmup_steps=10", f"optim.schedule={schedule}", "optim.min_lr_ratio=0.1")
    assert lr_factor(step, 100, cfg) == pytest.approx(expected)


def test_cosine_is_monotone_after_warmup() -> None:
    cfg = _cfg("optim.warmup_steps=10")
    vals = [lr_factor(s, 100, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(vals, vals[1:], strict=False))


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.text = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)
        self.logit_scale = nn.Parameter(nn.init.zeros_(nn.Parameter(nn.Linear(1, 1).weight)))

    def no_weight_decay(self) -> list[str]:
        return ["logit_scale"]


def test_param_groups_exclude_bias_norm_embedding_and_temperature_from_decay() -> None:
    groups = param_groups(_Toy(), _cfg("optim.weight_decay=0.1"))
    decay = {n for g in groups if g["weight_decay"] > 0 for n in g["names"]}
    no_decay = {n for g in groups if g["weight_decay"] == 0 for n in g["names"]}
    assert decay == {"vision.0.weight", "head.weight"}
    assert no_decay == {
        "vision.0.bias",
        "vision.1.weight",
        "vision.1.bias",
        "text.weight",
        "head.bias",
        "logit_scale",
    }


def test_lr_scale_multiplies_module_lr_and_unknown_module_fails() -> None:
    opt = build_optimizer(_Toy(), _cfg("optim.lr=1e-3", "optim.lr_scale={vision: 0.1}"))
    by_name = {n: g["lr"] for g in opt.param_groups for n in g["names"]}
    assert by_name["vision.0.weight"] == pytest.approx(1e-4)
    assert by_name["head.weight"] == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match="visoin"):
        build_optimizer(_Toy(), _cfg("optim.lr_scale={visoin: 0.1}"))


def test_frozen_parameters_are_not_optimized() -> None:
    m = _Toy()
    m.vision.requires_grad_(False)
    names = {n for g in param_groups(m, _cfg()) for n in g["names"]}
    assert not any(n.startswith("vision") for n in names)


def _steps(opt, model: nn.Module, n: int, seed: int = 0) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize(
    "impl, flags",
    [
        ("auto", {"fused": True}),
        ("fused", {"fused": True}),
        ("foreach", {"foreach": True}),
        ("for_loop", {"foreach": False}),
    ],
)
def test_adamw_kernel_choice(impl: str, flags: dict) -> None:
    opt = build_optimizer(_Toy(), _cfg(f"optim.implementation={impl}"))
    assert all(opt.defaults[k] == v for k, v in flags.items())
    assert [g["fused"] for g in opt.param_groups] == [flags.get("fused")] * len(opt.param_groups)


def test_fused_adamw_follows_the_loop_and_resumes_its_checkpoints() -> None:
    """The fused kernel (the CPU default) takes the per-tensor loop's steps, and a checkpoint
    written by the loop (every run before it) resumes in the fused optimizer."""
    import copy

    import torch

    torch.manual_seed(0)
    start = _Toy()
    cfg = "optim.lr=1e-2", "optim.lr_scale={vision: 0.1}"
    loop_model, fused_model = copy.deepcopy(start), copy.deepcopy(start)
    loop = build_optimizer(loop_model, _cfg(*cfg, "optim.implementation=for_loop"))
    fused = build_optimizer(fused_model, _cfg(*cfg))
    _steps(loop, loop_model, 5)
    _steps(fused, fused_model, 5)
    for a, b in zip(loop_model.parameters(), fused_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, dict(start.named_parameters())[_name(loop_model, a)])
    resumed_model = copy.deepcopy(loop_model)
    resumed = build_optimizer(resumed_model, _cfg(*cfg))
    resumed.load_state_dict(copy.deepcopy(loop.state_dict()))  # as read back from a file
    _steps(loop, loop_model, 3, seed=1)
    _steps(resumed, resumed_model, 3, seed=1)
    for a, b in zip(loop_model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _name(model: nn.Module, param) -> str:
    return next(n for n, p in model.named_parameters() if p is param)
