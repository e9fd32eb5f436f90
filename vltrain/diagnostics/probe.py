"""Reads the model and the optimizer for the doctor, cheaply, through optimizer step hooks.

The probe never changes training: it registers a pre- and a post-hook on the optimizer (so the
loop needs no extra call around ``optimizer.step``) and samples a fixed handful of elements
per parameter (at most ``SAMPLE`` each) instead of copying the weights, so the update/weight
ratio, "the step changed nothing" and the cross-rank weight fingerprint cost a few small
gathers per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from vltrain.diagnostics.record import StepRecord

#: sampled elements per parameter
SAMPLE = 8
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) parameter; the tensor itself otherwise."""
    return p.to_local() if hasattr(p, "to_local") else p


def _sharded(p: torch.Tensor) -> bool:
    """An FSDP2 (DTensor) parameter sharded over ranks: each rank holds a different part."""
    return any(pl.is_shard() for pl in getattr(p, "placements", ()))


def _sample_index(p: torch.Tensor) -> torch.Tensor:
    """Evenly spaced flat indices into `p` (at most SAMPLE)."""
    n = p.numel()
    k = min(n, SAMPLE)
    # integer arithmetic: float32 linspace rounds past the last index beyond 2^24 weights
    # (SmolLM2's 49153 x 576 embedding: index 28312128 of 28312128)
    steps = torch.arange(k, device=p.device, dtype=torch.long)
    return (steps * (n - 1) + (k - 1) // 2) // max(k - 1, 1)


def frozen_by_design(module: nn.Module) -> set[str]:
    """Names of the parameters `module`'s parts froze themselves: a part lists them (under
    itself) in ``frozen_by_design`` (an HF embedder's LM head, its loss-owned logit scale, the
    vision layers a LLaVA projector never reads: docs/hf_backbones.md)."""
    out = set()
    for prefix, part in module.named_modules():
        for name in getattr(part, "frozen_by_design", ()):
            out.add(f"{prefix}.{name}" if prefix else name)
    return out


class Probe:
    """Per-step model/optimizer facts for a :class:`StepRecord`.

    `frozen_parts` are the top-level module names the config freezes (``model.freeze``);
    `expect_all_trainable` says every other parameter should train (false under LoRA, where
    the base weights are frozen by design).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        frozen_parts: list[str],
        expect_all_trainable: bool,
    ) -> None:
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.module, self.optimizer = module, optimizer
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        params = list(module.named_parameters())
        self.not_in_optimizer = [n for n, p in params if p.requires_grad and id(p) not in in_opt]
        top, design = set(frozen_parts), frozen_by_design(module)
        part_of = getattr(module, "part_of", None)  # the HF VLM's parts: vision, connector...

        def part(name: str) -> str:
            return part_of(name) if callable(part_of) else name.split(".")[0]

        self.frozen_unasked = [
            n
            for n, p in params
            if expect_all_trainable
            and not p.requires_grad
            and part(n) not in top
            and n not in design
        ]
        self.frozen_trainable = [n for n, p in params if p.requires_grad and part(n) in top]
        self.unasked_parts = sorted({part(n) for n in self.frozen_unasked})
        self.groups = [list(g["params"]) for g in optimizer.param_groups]
        self.index = [[_sample_index(_local(p)) for p in g] for g in self.groups]
        # the DDP-divergence fingerprint reads replicated weights only: FSDP shards differ
        # between ranks by design (a false ddp_divergence at step 0 of every fsdp run)
        self.fp_mask = [
            torch.cat([torch.full((len(i),), not _sharded(p)) for p, i in zip(g, ix, strict=True)])
            if g
            else torch.zeros(0, dtype=torch.bool)
            for g, ix in zip(self.groups, self.index, strict=True)
        ]
        self.gates = {
            n: m for n, m in module.named_modules() if getattr(m, "zero_init_gate", False) is True
        }
        self.temps = {
            n: m
            for n, m in module.named_modules()
            if isinstance(getattr(m, "max_log_scale", None), float) and hasattr(m, "logit_scale")
        }
        self._before: list[torch.Tensor] = []
        self._numpy_ok = [
            bool(g)
            and all(
                not hasattr(p, "to_local") and p.device.type == "cpu" and p.dtype in _NUMPY_DTYPES
                for p in g
            )
            for g in self.groups
        ]
        self._views: dict[int, Any] = {}  # group -> (data pointers, numpy views, indices)
        self._facts: dict[str, Any] = {}
        # A gradient hook sees the incoming gradient before it is accumulated into `.grad`: at
        # the first backward of a step `.grad` must be empty (or zero), else the step applies
        # the previous step's gradients too (a missing zero_grad).
        self.first_backward, self.stale = True, ""
        watched = sorted(
            (p for g in self.groups for p in g if p.requires_grad), key=lambda p: p.numel()
        )[:3]
        self.handles = [p.register_hook(self._grad_hook(p)) for p in watched]
        self.handles += [
            optimizer.register_step_pre_hook(self._pre_step),
            optimizer.register_step_post_hook(self._post_step),
        ]

    def _grad_hook(self, p: torch.Tensor) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if self.first_backward:
                self.first_backward = False
                if p.grad is not None and bool(p.grad.detach().abs().sum() > 0):
                    self.stale = self.names.get(id(p), "?")

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _fingerprint(self, sampled: list[torch.Tensor]) -> float:
        """Sum of the sampled replicated weights (equal on every rank of a healthy run)."""
        return float(sum(float(a[m].sum()) for a, m in zip(sampled, self.fp_mask, strict=True)))

    def _sampled(self) -> list[torch.Tensor]:
        """Per group, the sampled weights (float64, on CPU)."""
        out = []
        for gi, (params, index) in enumerate(zip(self.groups, self.index, strict=True)):
            fast = self._numpy_views(gi)
            if fast is not None:  # plain CPU weights: numpy indexing, ~10x fewer dispatches
                views, idx = fast
                parts_np = [v[i] for v, i in zip(views, idx, strict=True)]
                out.append(torch.from_numpy(np.concatenate(parts_np).astype(np.float64)))
                continue
            parts = [_local(p.detach()).reshape(-1)[i] for p, i in zip(params, index, strict=True)]
            out.append(torch.cat(parts).double().cpu() if parts else torch.zeros(0))
        return out

    def _numpy_views(self, gi: int) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
        """Flat numpy views of group `gi`'s weights when each is a plain CPU tensor of a numpy
        dtype (else None: DTensor shards, CUDA, bfloat16 take the torch path), rebuilt when a
        weight's storage moved (``p.data = ...``)."""
        if not self._numpy_ok[gi]:
            return None
        params = self.groups[gi]
        ptrs = [p.data_ptr() for p in params]
        cached = self._views.get(gi)
        if cached is None or cached[0] != ptrs:
            views = [p.detach().numpy().reshape(-1) for p in params]
            cached = self._views[gi] = (ptrs, views, [i.numpy() for i in self.index[gi]])
        return cached[1], cached[2]

    def _pre_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self._before = self._sampled()
        no_grad = [self.names.get(id(p), "?") for g in self.groups for p in g if p.grad is None]
        self._facts = {
            "lr_applied": [float(g["lr"]) for g in optimizer.param_groups],
            "lr_scales": [float(g.get("lr_scale", 1.0)) for g in optimizer.param_groups],
            "no_grad": no_grad,
        }

    def _post_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        after = self._sampled()
        ratios = []
        for b, a in zip(self._before, after, strict=True):
            w = float(b.norm())
            ratios.append(
                float((a - b).norm()) / w if w > 0 else float("nan")
            )  # zero-init: no ratio
        self._facts["update_ratio"] = ratios
        self._facts["stepped"] = True
        self._facts["weight_fp"] = self._fingerprint(after)

    def fill(self, rec: StepRecord) -> None:
        """Add what the probe saw during this step (call after the optimizer step, before
        ``zero_grad``: the gradients are still there for non-finite provenance)."""
        facts, self._facts = self._facts, {}
        for key, value in facts.items():
            setattr(rec, key, value)
        if not rec.stepped:  # skipped step: the fingerprint is still the current weights
            rec.weight_fp = self._fingerprint(self._sampled())
        if self.stale:
            rec.stale_grads = [self.stale]
        self.first_backward, self.stale = True, ""
        with torch.no_grad():
            rec.gates = {
                n: float(m.scale.detach().tanh().abs().max()) for n, m in self.gates.items()
            }
            rec.temperature = {
                n: float(m.logit_scale.detach()) - m.max_log_scale for n, m in self.temps.items()
            }
        if not rec.finite:
            rec.nonfinite = self.provenance()

    def provenance(self) -> dict[str, Any]:
        """The first parameter (module order) whose weight, else gradient, is non-finite."""
        bad_w, bad_g = [], []
        for name, p in self.module.named_parameters():
            if not torch.isfinite(p.detach()).all():
                bad_w.append(name)
            if p.grad is not None and not torch.isfinite(p.grad).all():
                bad_g.append(name)
        if bad_w:
            return {"kind": "weight", "first": bad_w[0], "count": len(bad_w)}
        if bad_g:
            return {"kind": "grad", "first": bad_g[0], "count": len(bad_g)}
        return {"kind": "loss", "first": "", "count": 0}
