"""AdamW with parameter groups, per-module learning-rate multipliers, and LR schedules."""

from __future__ import annotations

import math

import torch
from torch import nn

from vltrain.config.core import ConfigError
from vltrain.config.schema import OptimConfig

_NO_DECAY_MODULES = (nn.LayerNorm, nn.Embedding, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)


def no_decay_names(model: nn.Module) -> set[str]:
    """Parameters exempt from weight decay.

    Biases and other 1-D parameters, norm and embedding weights, plus whatever the model lists
    in `no_weight_decay()` (positional embeddings, class tokens, temperature, bias of SigLIP).
    """
    names = set()
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.ndim < 2 or isinstance(mod, _NO_DECAY_MODULES):
                names.add(full)
        hook = getattr(mod, "no_weight_decay", None)
        if callable(hook):
            prefix = f"{mod_name}." if mod_name else ""
            names.update(prefix + n for n in hook())
    return names


def _matches(name: str, module: str) -> bool:
    """`vision` matches `vision.x`, `backbone.vision.x` (whole path segments), not `visionx`."""
    return f".{module}." in f".{name}."


def _lr_scale_for(name: str, lr_scale: dict[str, float], part: str | None = None) -> float:
    """The multiplier of the longest matching module path, or of the parameter's `part`
    (1.0 when none matches)."""
    best, scale = -1, 1.0
    for module, s in lr_scale.items():
        if (_matches(name, module) or module == part) and len(module) > best:
            best, scale = len(module), s
    return scale


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """Group trainable parameters by (lr multiplier, weight decay on/off).

    A model with a ``part_of(name) -> str`` method (the HF VLM wrapper) lets ``optim.lr_scale``
    name its parts (``vision``) as well as module paths."""
    no_decay = no_decay_names(model)
    part_of = getattr(model, "part_of", None)
    used_prefixes: set[str] = set()
    groups: dict[tuple[float, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        part = part_of(name) if callable(part_of) else None
        scale = _lr_scale_for(name, cfg.lr_scale, part)
        used_prefixes.update(m for m in cfg.lr_scale if _matches(name, m) or m == part)
        decay = name not in no_decay
        g = groups.setdefault(
            (scale, decay),
            {
                "params": [],
                "names": [],
                "lr_scale": scale,
                "weight_decay": cfg.weight_decay if decay else 0.0,
            },
        )
        g["params"].append(p)
        g["names"].append(name)
    unused = sorted(set(cfg.lr_scale) - used_prefixes)
    if unused:
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if callable(part_of):
            names = f"the trainable parts are {sorted({part_of(n) for n in trainable})}"
        else:
            tops = sorted({n.split(".")[0] for n in trainable})
            names = f"top-level modules with trainable parameters are {tops}"
        if any(p.requires_grad is False for p in model.parameters()):
            names += " (frozen parts, and a LoRA run's base weights, take no learning rate)"
        raise ConfigError(
            f"'optim.lr_scale' names {unused}, which match no trainable parameter; {names}"
        )
    return list(groups.values())


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over `param_groups`; group LRs are set each step by `set_lr`."""
    groups = param_groups(model, cfg)
    if not groups:
        raise ConfigError("no trainable parameters: check model.freeze")
    for g in groups:
        g["lr"] = cfg.lr * g["lr_scale"]
    params = [p for g in groups for p in g["params"]]
    kernel = adamw_kernel(params, cfg.implementation)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kernel)


def adamw_kernel(params: list[torch.Tensor], implementation: str) -> dict[str, bool]:
    """AdamW's kernel flags for `optim.implementation` (see its docs)."""
    if implementation == "fused":
        return {"fused": True}
    if implementation == "foreach":
        return {"foreach": True}
    if implementation == "for_loop":
        return {"foreach": False}
    plain = all(
        type(p) in (torch.Tensor, nn.Parameter)
        and p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
        for p in params
    )
    return {"fused": True} if plain else {}


def lr_factor(step: int, max_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based).

    Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine, linear or constant
    decay reaching `min_lr_ratio` at the last step.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    decay_steps = max(1, max_steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return 1.0


def set_lr(optimizer: torch.optim.Optimizer, step: int, max_steps: int, cfg: OptimConfig) -> float:
    """Set every group's LR for `step`; return the base LR (before per-module multipliers)."""
    lr = cfg.lr * lr_factor(step, max_steps, cfg)
    for g in optimizer.param_groups:
        g["lr"] = lr * g["lr_scale"]
    return lr


#: the dynamic loss scaler's first scale (torch's default); tests raise it to force overflow
INIT_SCALE = 2.0**16


def build_scaler(
    precision: str, device: torch.device, sharded: bool
) -> torch.amp.GradScaler | None:
    """The dynamic loss scaler of `run.precision=fp16` (None otherwise): fp16 gradients
    underflow without it. Under FSDP the sharded scaler, which finds overflow in every rank's
    shard (one all-reduce) so that all ranks skip the same step."""
    if precision != "fp16":
        return None
    if sharded:
        from vltrain.engine.sharding import sharded_scaler

        return sharded_scaler(device.type, INIT_SCALE)
    return torch.amp.GradScaler(device.type, init_scale=INIT_SCALE)
