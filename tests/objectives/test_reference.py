"""The KL reference of a LoRA policy is the policy with its adapters disabled: the base model's
logits, with no second copy of the weights; a plain policy uses its frozen copy."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from tests.fixtures import tiny_causal_lm
from vltrain.objectives.reference import (
    adapters_disabled,
    frozen_reference,
    has_adapters,
    reference_logits,
)

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

IDS = torch.tensor([[1, 5, 9, 14, 3, 7], [1, 22, 4, 4, 8, 30]])


def _base() -> nn.Module:
    torch.manual_seed(0)
    cfg, cls = tiny_causal_lm("llama", layers=2)
    return cls(cfg).eval()


def _lora(model: nn.Module) -> nn.Module:
    """LoRA with dropout on q/v; lora_B randomised so the adapters change the logits."""
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"])
    policy = peft.get_peft_model(model, lcfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return policy


def _logits(m: nn.Module) -> torch.Tensor:
    return m(input_ids=IDS).logits


def _live_parameters() -> int:
    gc.collect()
    return sum(isinstance(o, nn.Parameter) for o in gc.get_objects())


def test_lora_reference_is_the_base_model_without_a_copy() -> None:
    base = _base()
    with torch.no_grad():
        want = _logits(base)
    policy = _lora(base).train()  # training mode: LoRA dropout active
    assert has_adapters(policy) and not has_adapters(_base())
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    ptrs = sorted(p.data_ptr() for p in policy.parameters())
    live = _live_parameters()

    ref = reference_logits(_logits, policy, None)

    assert torch.equal(ref, want)  # the base model's logits, bit for bit
    assert not ref.requires_grad
    assert _live_parameters() == live  # no parameter was created (no copy of the model)
    assert sorted(p.data_ptr() for p in policy.parameters()) == ptrs
    # everything restored: train mode, adapters on, the same trainable set
    assert policy.training
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == trainable
    policy.eval()
    with torch.no_grad():
        assert not torch.allclose(_logits(policy), want, atol=1e-3)  # negative control: adapters on
    # negative control of the copy count: a frozen copy does create parameters
    copy = frozen_reference(policy)
    assert _live_parameters() > live
    del copy


def test_reference_forward_between_policy_forward_and_backward_keeps_gradients() -> None:
    def lora_grads(with_reference: bool) -> dict[str, torch.Tensor]:
        policy = _lora(_base()).eval()  # eval: no dropout, comparable runs
        loss = _logits(policy).logsumexp(-1).mean()
        if with_reference:
            reference_logits(_logits, policy, None)
        loss.backward()
        return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    plain, interleaved = lora_grads(False), lora_grads(True)
    assert plain and set(plain) == set(interleaved)
    assert all(torch.equal(plain[n], interleaved[n]) for n in plain)
    assert any(g.abs().sum() > 0 for g in plain.values())


def test_adapters_nested_and_injected_without_peft_model() -> None:
    # a LoRA language model inside a larger module (the llava shape): found and disabled
    base = _base()
    with torch.no_grad():
        want = _logits(base)
    outer = nn.ModuleDict({"lm": _lora(base), "proj": nn.Linear(4, 4)}).eval()
    assert has_adapters(outer)
    with torch.no_grad(), adapters_disabled(outer):
        assert torch.equal(_logits(outer["lm"]), want)
    with torch.no_grad():
        assert not torch.allclose(_logits(outer["lm"]), want, atol=1e-3)  # restored
    # peft's inject_adapter_in_model (what transformers' add_adapter does): no PeftModel around
    model = _base()
    lcfg = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False)
    model = peft.inject_adapter_in_model(lcfg, model)
    assert has_adapters(model)
    ref = reference_logits(_logits, model, None)
    assert torch.equal(ref, want)
    with torch.no_grad():
        assert not torch.allclose(_logits(model), want, atol=1e-3)


def test_frozen_copy_path_and_errors() -> None:
    model = _base()
    copy = frozen_reference(model)
    with torch.no_grad():
        torch.testing.assert_close(reference_logits(_logits, model, copy), _logits(model))
    with pytest.raises(ValueError, match="without peft adapters"):
        reference_logits(_logits, model, None)
    with pytest.raises(ValueError, match="no peft adapters"), adapters_disabled(model):
        pass
