"""FLOP and parameter accounting for the built-in models and the HF CLIP/SigLIP backbones.

Conventions (the same as Kaplan et al. / Chinchilla, stated so every number can be checked):

- a multiply-add is 2 FLOPs; matmuls only (norms, softmax, GELU, residual adds are ignored:
  under 1% at these widths);
- attention is counted at the real sequence length T (queries) x S (keys), dense: QK^T and
  AV are 2 * 2 * T * S * W FLOPs per layer, causal masks included (the kernels compute, or
  at least allocate, the full square; `torch.utils.flop_counter` counts it the same way);
- backward = 2 x forward for a trainable part (input and weight gradients); a frozen part
  that a trainable part feeds into backward costs 1 x forward (input gradients only); a
  frozen part upstream of everything trainable costs nothing backward (a frozen vision tower
  is forward-only). Flash-attention's recomputation of the scores is not counted;
- non-embedding parameters exclude token, position and class-token embeddings (the tied
  output head reuses the token embedding and is counted as FLOPs, not as extra parameters).

Per-sample counts are reported per component (vision, connector, decoder or text tower) so a
user sees where the compute of a multimodal model goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: parameter names (suffixes) that are embeddings, not compute
EMBEDDING_NAMES = ("token_embed.weight", "pos_embed", "class_token", "embed_tokens.weight")


@dataclass
class Component:
    """One part of a model: its parameters and its FLOPs for one sample."""

    name: str
    params: int
    """All parameters of the part."""
    nonembed_params: int
    """Parameters without token/position embeddings."""
    forward: float
    """Forward FLOPs per sample."""
    trainable: bool
    """Receives gradients (not frozen)."""
    backward: float = 0.0
    """Backward FLOPs per sample (set by :func:`assign_backward`)."""
    tokens: int = 0
    """Tokens this part processes per sample."""


@dataclass
class ModelFlops:
    """Per-sample accounting of a whole model, component by component (in data-flow order)."""

    components: list[Component]
    image_tokens: int
    """Visual tokens per sample the language side sees (prefix or cross-attention memory)."""
    text_tokens: int
    """Text tokens per sample (the sequence length the count assumes)."""
    notes: list[str] = field(default_factory=list)

    @property
    def forward(self) -> float:
        return sum(c.forward for c in self.components)

    @property
    def backward(self) -> float:
        return sum(c.backward for c in self.components)

    @property
    def per_sample(self) -> float:
        """Training FLOPs (forward + backward) per sample."""
        return self.forward + self.backward

    @property
    def nonembed_params(self) -> int:
        return sum(c.nonembed_params for c in self.components)

    @property
    def trainable_nonembed_params(self) -> int:
        """N of a scaling law: non-embedding parameters that train."""
        return sum(c.nonembed_params for c in self.components if c.trainable)

    def to_dict(self) -> dict[str, Any]:
        return {
            "per_sample_flops": self.per_sample,
            "forward_flops": self.forward,
            "backward_flops": self.backward,
            "nonembed_params": self.nonembed_params,
            "trainable_nonembed_params": self.trainable_nonembed_params,
            "image_tokens": self.image_tokens,
            "text_tokens": self.text_tokens,
            "components": [vars(c) for c in self.components],
            "notes": self.notes,
        }

    def table(self) -> str:
        """A markdown table, one row per component."""
        header = ["component", "non-emb params", "tokens", "fwd FLOPs", "bwd FLOPs", "trains"]
        rows = [
            [
                c.name,
                str(c.nonembed_params),
                str(c.tokens),
                f"{c.forward:.3e}",
                f"{c.backward:.3e}",
                "yes" if c.trainable else "frozen",
            ]
            for c in self.components
        ]
        rows.append(
            [
                "total",
                str(self.nonembed_params),
                "-",
                f"{self.forward:.3e}",
                f"{self.backward:.3e}",
                f"N={self.trainable_nonembed_params}",
            ]
        )
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# ------------------------------------------------------------------------------ primitives


def linear(tokens: int, d_in: int, d_out: int) -> float:
    """FLOPs of a (tokens, d_in) @ (d_in, d_out) matmul."""
    return 2.0 * tokens * d_in * d_out


def attention_scores(q_tokens: int, kv_tokens: int, width: int) -> float:
    """QK^T and AV over all heads: 2 matmuls of q_tokens x kv_tokens x width."""
    return 2 * linear(q_tokens, width, kv_tokens)


def block_forward(width: int, mlp_hidden: int, tokens: int, kv_tokens: int | None = None) -> float:
    """One pre-norm transformer block (fused qkv, out proj, 2-layer MLP)."""
    kv = tokens if kv_tokens is None else kv_tokens
    return (
        linear(tokens, width, 3 * width)
        + attention_scores(tokens, kv, width)
        + linear(tokens, width, width)
        + linear(tokens, width, mlp_hidden)
        + linear(tokens, mlp_hidden, width)
    )


def cross_attention_forward(width: int, q_tokens: int, memory_tokens: int) -> float:
    """`connectors.CrossAttention`: q on the queries, fused kv on the memory, out proj."""
    return (
        linear(q_tokens, width, width)
        + linear(memory_tokens, width, 2 * width)
        + attention_scores(q_tokens, memory_tokens, width)
        + linear(q_tokens, width, width)
    )


def count_params(module: nn.Module) -> tuple[int, int]:
    """(all parameters, non-embedding parameters) of a module."""
    total = nonembed = 0
    for name, p in module.named_parameters():
        total += p.numel()
        if not name.endswith(EMBEDDING_NAMES):
            nonembed += p.numel()
    return total, nonembed


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _component(name: str, module: nn.Module, forward: float, tokens: int) -> Component:
    total, nonembed = count_params(module)
    return Component(name, total, nonembed, forward, _trainable(module), tokens=tokens)


def assign_backward(components: list[Component]) -> list[Component]:
    """Backward FLOPs in data-flow order: 2x for trainable parts, 1x for frozen parts
    downstream of a trainable one (input gradients), 0 upstream of everything trainable."""
    first = min((i for i, c in enumerate(components) if c.trainable), default=len(components))
    for i, c in enumerate(components):
        if c.trainable:
            c.backward = 2.0 * c.forward
        else:  # frozen: input gradients only when a trainable part lies upstream
            c.backward = 1.0 * c.forward if first < i else 0.0
    return components


# ------------------------------------------------------------------------------ built-ins


def vision_tower_flops(tower: nn.Module) -> tuple[float, int]:
    """`vit.VisionTower`: (forward FLOPs per image, tokens = 1 + patches)."""
    cfg = tower.cfg
    tokens = 1 + cfg.num_patches
    hidden = int(cfg.width * cfg.mlp_ratio)
    if getattr(cfg, "stem", "patch") == "conv":  # 3x3 convs, each output pixel 9 x c_in MACs
        side, c, stem = cfg.image_size, 3, 0.0
        full = len(cfg.stem_channels) - cfg.halvings  # stride-1 convs first
        for i, out in enumerate(cfg.stem_channels):
            side = side if i < full else side // 2
            stem += linear(side * side, 9 * c, out)
            c = out
        stem += linear(side * side, 9 * c, cfg.width)
    else:
        stem = linear(cfg.num_patches, 3 * cfg.patch_size**2, cfg.width)
    if getattr(cfg, "pool", "cls") == "flatten":
        stem += linear(1, cfg.num_patches * cfg.width, cfg.width)
    return stem + cfg.layers * block_forward(cfg.width, hidden, tokens), tokens


def text_blocks_flops(cfg: Any, tokens: int) -> float:
    """The blocks of a text tower (`text.TextTowerConfig`) over `tokens` positions."""
    return cfg.layers * block_forward(cfg.width, int(cfg.width * cfg.mlp_ratio), tokens)


def connector_flops(connector: nn.Module, vision_tokens: int, text_tokens: int) -> float:
    """Forward FLOPs of a built-in connector, including gated cross-attention blocks."""
    from vltrain.models.connectors import GatedXAttnConnector, ProjectorConnector

    if isinstance(connector, ProjectorConnector):
        n = connector.num_prefix_tokens()
        return sum(linear(n, m.in_features, m.out_features) for m in _linears(connector.proj))
    if isinstance(connector, GatedXAttnConnector):
        res = connector.resampler
        width, n_lat = res.latents.shape[1], res.latents.shape[0]
        hidden = res.layers[0].mlp.fc1.out_features if len(res.layers) else 4 * width
        flops = linear(vision_tokens, res.in_proj.in_features, width)
        per_layer = (
            cross_attention_forward(width, n_lat, vision_tokens + n_lat)
            + linear(n_lat, width, hidden) * 2
        )
        flops += len(res.layers) * per_layer
        xhidden = 4 * width
        per_x = cross_attention_forward(width, text_tokens, n_lat) + 2 * linear(
            text_tokens, width, xhidden
        )
        return flops + len(connector.xattn) * per_x
    raise TypeError(
        f"no FLOP formula for connector {type(connector).__name__}; count it with "
        "vltrain.scaling.flops.measure_flops"
    )


def _linears(module: nn.Module) -> Iterable[nn.Linear]:
    return (m for m in module.modules() if isinstance(m, nn.Linear))


def captioner_flops(model: nn.Module, text_tokens: int) -> ModelFlops:
    """`captioner.Captioner` (vision -> connector -> decoder) for one sample of
    `text_tokens` text tokens; freezing is read from `requires_grad`."""
    vision_fwd, vision_tokens = vision_tower_flops(model.vision)
    conn = model.connector
    prefix = conn.num_prefix_tokens()
    dec = model.decoder.cfg
    seq = prefix + text_tokens
    decoder_fwd = text_blocks_flops(dec, seq) + linear(text_tokens, dec.width, dec.vocab_size)
    memory = prefix if conn.uses_prefix else conn.resampler.latents.shape[0]
    parts = [
        _component("vision", model.vision, vision_fwd, vision_tokens),
        _component("connector", conn, connector_flops(conn, vision_tokens, text_tokens), memory),
        _component("decoder", model.decoder, decoder_fwd, seq),
    ]
    notes = [f"decoder sequence = {prefix} visual prefix + {text_tokens} text tokens"]
    return ModelFlops(assign_backward(parts), memory, text_tokens, notes)


def dual_encoder_flops(
    model: nn.Module, text_tokens: int, batch_size: int = 0, texts_per_sample: int = 1
) -> ModelFlops:
    """`dual_encoder.DualEncoder`: both towers and projections for one image and
    `texts_per_sample` texts (its caption, plus its hard negatives and second caption when the
    run trains with them), each of `text_tokens` tokens.

    The contrastive logits (B x B x E per batch) are added per sample when `batch_size` is
    given (they grow with the batch: 2 * B * E FLOPs per sample).
    """
    vision_fwd, vision_tokens = vision_tower_flops(model.vision)
    if getattr(model, "pairs", None) is not None:
        vision, tower = _word_pairs_flops(model, vision_fwd, vision_tokens, text_tokens)
        tower.forward *= texts_per_sample
    else:
        vision_fwd += linear(1, model.vision_proj.in_features, model.embed_dim)
        text = model.text.cfg
        text_fwd = text_blocks_flops(text, text_tokens) + linear(1, text.width, model.embed_dim)
        text_fwd *= texts_per_sample
        vision = _component("vision", model.vision, vision_fwd, vision_tokens)
        vision.params += model.vision_proj.weight.numel()
        vision.nonembed_params += model.vision_proj.weight.numel()
        tower = _component("text", model.text, text_fwd, text_tokens)
        tower.params += model.text_proj.weight.numel()
        tower.nonembed_params += model.text_proj.weight.numel()
    parts = [vision, tower]
    if batch_size:
        parts.append(Component("logits", 0, 0, linear(1, model.embed_dim, batch_size), True))
    # The two towers run side by side: each one's backward depends only on itself.
    for c in parts:
        c.backward = 2.0 * c.forward if c.trainable else 0.0
    return ModelFlops(parts, vision_tokens, text_tokens)


# ------------------------------------------------------------------------------ HF backbones


def hf_tower_flops(cfg: Any, tokens: int) -> float:
    """A HF CLIP/SigLIP encoder stack (separate q, k, v, out projections; fc1/fc2 MLP)."""
    w, hidden = cfg.hidden_size, cfg.intermediate_size
    return cfg.num_hidden_layers * block_forward(w, hidden, tokens)


def _word_pairs_flops(
    model: nn.Module, vision_fwd: float, vision_tokens: int, text_tokens: int
) -> tuple[Component, Component]:
    """`DualEncoder` with the word-pair head, one text: the stem, the readers (the token reader
    at every cell, the row convolution, the next-token reader and the codes at the kept
    cells); a text is a table lookup per token pair (adds only)."""
    head = model.pairs
    cells, width = model.vision.cfg.num_patches, head.read.in_features
    line = head.line[0]
    classes, keep, dim = head.read.out_features, min(head.keep, cells), model.embed_dim
    vision_fwd += linear(cells, width, classes)
    vision_fwd += linear(cells, line.in_channels * line.kernel_size[1], line.out_channels)
    vision_fwd += linear(keep, head.read_next.in_features, classes)
    vision_fwd += 2 * linear(keep, classes, dim)
    vision = _component("vision", model.vision, vision_fwd, vision_tokens)
    total, nonembed = count_params(head)
    vision.params += total
    vision.nonembed_params += nonembed
    text_fwd = 3.0 * dim * max(text_tokens - 1, 1)
    return vision, Component("text", 0, 0, text_fwd, True, tokens=text_tokens)


def hf_dual_encoder_flops(model: nn.Module, text_tokens: int) -> ModelFlops:
    """HF `CLIPModel` / `SiglipModel` (through `hf_embedders`, or bare): both towers."""
    hf = getattr(model, "model", model)
    config = hf.config
    vc, tc = config.vision_config, config.text_config
    patches = (vc.image_size // vc.patch_size) ** 2
    cls = 1 if config.model_type == "clip" else 0  # SigLIP has no class token
    v_tokens = patches + cls
    v_fwd = linear(patches, 3 * vc.patch_size**2, vc.hidden_size) + hf_tower_flops(vc, v_tokens)
    t_fwd = hf_tower_flops(tc, text_tokens)
    if config.model_type == "siglip":  # attention-pool head (a probe attending to the patches)
        v_fwd += cross_attention_forward(vc.hidden_size, 1, v_tokens) + 2 * linear(
            1, vc.hidden_size, vc.intermediate_size
        )
        t_fwd += linear(1, tc.hidden_size, tc.hidden_size)  # text head
    else:
        proj = config.projection_dim
        v_fwd += linear(1, vc.hidden_size, proj)
        t_fwd += linear(1, tc.hidden_size, proj)
    vision = _component("vision", hf.vision_model, v_fwd, v_tokens)
    text = _component("text", hf.text_model, t_fwd, text_tokens)
    for name in ("visual_projection", "text_projection"):
        head = getattr(hf, name, None)
        if head is not None:
            n = sum(p.numel() for p in head.parameters())
            part = vision if name.startswith("visual") else text
            part.params += n
            part.nonembed_params += n
    for c in (vision, text):
        c.backward = 2.0 * c.forward if c.trainable else 0.0
    return ModelFlops([vision, text], v_tokens, text_tokens)


# ------------------------------------------------------------------------------ measured


def _register_cpu_sdpa() -> None:
    """`torch.utils.flop_counter` (torch 2.x) has no formula for the CPU flash-attention
    kernel, so attention would count as 0 on CPU; register the dense SDPA formula for it."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is None or fwd in fc.flop_registry:
        return

    @fc.register_flop_formula(fwd, get_raw=True)
    def _fwd(query, key, value, *args, out_val=None, **kwargs) -> int:
        return fc.sdpa_flop_count(query.shape, key.shape, value.shape)

    if bwd is not None and bwd not in fc.flop_registry:

        @fc.register_flop_formula(bwd, get_raw=True)
        def _bwd(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
            return fc.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def measure_flops(step: Callable[[], None]) -> dict[str, int]:
    """Run `step()` (a forward, or forward + backward) under `torch.utils.flop_counter`:
    {"total": FLOPs, "<module>": FLOPs of each top-level child}. The reference for the
    analytic counts, and the counter for models without a formula here (HF VLMs)."""
    from torch.utils.flop_counter import FlopCounterMode

    _register_cpu_sdpa()
    with FlopCounterMode(display=False, depth=2) as counter:
        step()
    out = {"total": int(counter.get_total_flops())}
    for name, ops in counter.get_flop_counts().items():
        out[name] = int(sum(ops.values()))
    return out
