"""The frozen reference pi_ref of the RL KL term: a frozen copy, or the LoRA policy's base model.

* :func:`frozen_reference` deep-copies the starting model (no trainable parameter, eval mode for
  good); :func:`check_frozen_reference` catches the wiring mistakes (shared storage, in the
  optimizer, trainable).
* A policy with peft adapters (LoRA) needs no copy: its base weights are frozen, so the model
  with its adapters disabled *is* the starting model (for a new adapter). :func:`reference_logits`
  runs the forward that way (:func:`adapters_disabled`), as TRL's GRPO/RLOO trainers do, and runs
  a frozen copy otherwise. Wiring rules and resume: ``docs/rl.md``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

__all__ = [
    "adapters_disabled",
    "check_frozen_reference",
    "frozen_reference",
    "has_adapters",
    "reference_logits",
]


# ------------------------------------------------------------------------- frozen copy


def _stay_in_eval(self: nn.Module, mode: bool = True) -> nn.Module:
    """Replacement ``train``: a frozen reference ignores ``train()`` and stays in eval mode."""
    return nn.Module.train(self, False)


def frozen_reference(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with no trainable parameter, in eval mode for good.

    Pass the unwrapped model (not DDP / compiled). Keep the result OUT of the trained module (an
    attribute of the stage, never ``policy.ref = ...``): then the optimizer never sees its
    parameters and checkpoints of the policy do not hold it. See ``docs/rl.md`` for resume:
    rebuild it from the starting checkpoint, never from the resumed policy.
    """
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    for mod in ref.modules():  # `.train()` on the copy (or a parent) must not enable dropout
        mod.train = _stay_in_eval.__get__(mod)
    return ref.eval()


def check_frozen_reference(
    ref: nn.Module, policy: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Raise if ``ref`` could be updated or saved with ``policy``: call once at stage setup."""
    trainable = [n for n, p in ref.named_parameters() if p.requires_grad]
    if trainable:
        raise ValueError(
            f"reference has trainable parameters {trainable[:5]}; use frozen_reference"
        )
    ref_ids = {id(p) for p in ref.parameters()}
    ref_ptrs = {p.data_ptr() for p in ref.parameters() if p.numel()}
    if any(id(p) in ref_ids or p.data_ptr() in ref_ptrs for p in policy.parameters() if p.numel()):
        raise ValueError(
            "reference shares parameters with the policy (a submodule of it, or not a copy); "
            "build it with frozen_reference(model) and keep it outside the trained module"
        )
    if optimizer is not None:
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(id(p) in in_opt for p in ref.parameters()):
            raise ValueError("reference parameters are registered with the optimizer; remove them")


# ------------------------------------------------------------------ reference of a LoRA policy


def _adapter_modules(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """(outermost peft ``PeftModel``s, tuner layers outside them) in ``model``."""
    peft = sys.modules.get("peft")  # a model holds peft layers only if peft was imported
    if peft is None:
        return [], []
    from peft.tuners.tuners_utils import BaseTunerLayer

    wrappers: list[nn.Module] = []
    layers: list[nn.Module] = []
    for m in model.modules():
        inside = any(m is w or any(m is x for x in w.modules()) for w in wrappers)
        if isinstance(m, peft.PeftModel) and not inside:
            wrappers.append(m)
        elif isinstance(m, BaseTunerLayer) and not inside:
            layers.append(m)
    return wrappers, layers


def has_adapters(model: nn.Module) -> bool:
    """``model`` is (or holds) a peft model or peft adapter layers (LoRA etc.)."""
    wrappers, layers = _adapter_modules(model)
    return bool(wrappers or layers)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its base model: every peft adapter off, restored on exit.

    A ``PeftModel`` (at any depth) goes through its own ``disable_adapter()`` context; adapter
    layers injected without one (transformers' ``add_adapter``) are switched with
    ``enable_adapters``. Raises if ``model`` has no adapters.
    """
    wrappers, layers = _adapter_modules(model)
    if not (wrappers or layers):
        raise ValueError(f"{type(model).__name__} has no peft adapters to disable")
    enabled = [m for m in layers if not m.disable_adapters]
    with contextlib.ExitStack() as stack:
        for w in wrappers:
            stack.enter_context(w.disable_adapter())
        try:
            for m in enabled:
                m.enable_adapters(False)
            yield model
        finally:
            for m in enabled:
                m.enable_adapters(True)


def reference_logits(
    logits_fn: Callable[[nn.Module], Tensor], policy: nn.Module, reference: nn.Module | None
) -> Tensor:
    """The reference's logits ``logits_fn(model)`` under ``no_grad``; no second copy for LoRA.

    ``reference``: a :func:`frozen_reference` copy, or ``None`` when ``policy`` (the unwrapped
    model, not DDP) has peft adapters: then the reference is the policy with its adapters
    disabled and in eval mode (no dropout), as TRL does for a new adapter. Both are restored.
    """
    with torch.no_grad():
        if reference is not None:
            return logits_fn(reference)
        if not has_adapters(policy):
            raise ValueError(
                "reference_logits got reference=None for a policy without peft adapters; pass "
                "frozen_reference(starting model)"
            )
        was_training = policy.training
        policy.eval()
        try:
            with adapters_disabled(policy):
                return logits_fn(policy)
        finally:
            policy.train(was_training)
