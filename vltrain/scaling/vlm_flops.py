"""FLOP and parameter accounting for HF vision-language backbones (`model.kind: vlm`):
Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA (CLIP tower), read from the loaded module.

Per sample (one image-side prompt holding the image, one text-side prompt, as the `vlm`
embedder runs them), component by component:

- vision: the patch embedding (a conv whose kernel is its stride: a linear per patch) and the
  blocks at the image's real patch count P (Qwen: t x h x w of its patch grid; LLaVA: the
  fixed grid plus the class token); attention per image, windowed where Qwen2.5-VL windows it;
- connector: the merger (Qwen: on P / merge^2 tokens; Qwen3-VL's deepstack mergers too) or
  LLaVA's projector (on the selected patch tokens);
- decoder: the language model on the image-side sequence (prompt + image tokens) and, as a
  separate sequence, the text-side prompt; attention dense at each real length; the LM head
  only where logits are computed (`logits_tokens`, 0 for the embedder).

Dimensions come from the module's own linears (so head_dim, GQA and MLP variants need no
per-checkpoint table); the formulas are the conventions of :mod:`vltrain.scaling.flops`.
Backward is counted per matmul from what autograd computes: a weight gradient (1 x the
linear's forward) where the weight trains (LoRA adapters included), an input gradient (1 x)
where anything upstream trains, attention's backward (2 x) where its inputs need gradients.
So a frozen vision tower costs nothing backward, a frozen LM fed by a trained merger costs
1 x (input gradients), a LoRA LM costs ~1 x plus its adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from vltrain.scaling.flops import Component, ModelFlops, count_params, linear


@dataclass(frozen=True)
class BlockNames:
    """Where the linears of one transformer block sit (relative to the block)."""

    qkv: tuple[str, ...]
    """The projections of the block input to queries, keys and values (one fused or three)."""
    out: tuple[str, ...]
    mlp_in: tuple[str, ...]
    mlp_out: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """Module paths of one VLM family (relative to the `...ForConditionalGeneration`)."""

    vision_blocks: str
    vision_block: BlockNames
    patch_embed: str
    mergers: tuple[str, ...]
    """Connector modules applied to the vision features (each a chain of linears)."""
    lm_blocks: str = "model.language_model.layers"
    merge: bool = True
    """Patches merged merge^2 -> 1 before the LM (Qwen); else one LM token per patch."""
    class_token: bool = False


LM_BLOCK = BlockNames(
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
_QWEN_ATTN = (("attn.qkv",), ("attn.proj",))

#: model_type -> where its parts are
FAMILIES: dict[str, Family] = {
    "qwen2_vl": Family(
        "model.visual.blocks",
        BlockNames(*_QWEN_ATTN, ("mlp.fc1",), ("mlp.fc2",)),
        "model.visual.patch_embed.proj",
        ("model.visual.merger",),
    ),
    "qwen2_5_vl": Family(
        "model.visual.blocks",
        BlockNames(*_QWEN_ATTN, ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
        "model.visual.patch_embed.proj",
        ("model.visual.merger",),
    ),
    "qwen3_vl": Family(
        "model.visual.blocks",
        BlockNames(*_QWEN_ATTN, ("mlp.linear_fc1",), ("mlp.linear_fc2",)),
        "model.visual.patch_embed.proj",
        ("model.visual.merger", "model.visual.deepstack_merger_list"),
    ),
    "llava": Family(
        "model.vision_tower.encoder.layers",
        BlockNames(
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            ("self_attn.out_proj",),
            ("mlp.fc1",),
            ("mlp.fc2",),
        ),
        "model.vision_tower.embeddings.patch_embedding",
        ("model.multi_modal_projector",),
        merge=False,
        class_token=True,
    ),
}


# ------------------------------------------------------------------------------ matmul costs


@dataclass
class Cost:
    """Forward and backward FLOPs of a run of ops, and whether its output needs gradients."""

    forward: float = 0.0
    backward: float = 0.0

    def add(self, other: Cost) -> None:
        self.forward += other.forward
        self.backward += other.backward


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def linear_cost(module: nn.Module, tokens: int, grad_in: bool) -> tuple[Cost, bool]:
    """An nn.Linear (or a peft LoRA-wrapped one) over `tokens` rows; `grad_in`: its input
    needs gradients. Returns the cost and whether its output needs gradients."""
    base = getattr(module, "base_layer", module)
    f = linear(tokens, base.in_features, base.out_features)
    cost = Cost(f, f * (base.weight.requires_grad + grad_in))
    out_grad = grad_in or base.weight.requires_grad
    for name, lora_a in getattr(module, "lora_A", {}).items():
        lora_b = module.lora_B[name]
        fa = linear(tokens, lora_a.in_features, lora_a.out_features)
        fb = linear(tokens, lora_b.in_features, lora_b.out_features)
        a_w, b_w = lora_a.weight.requires_grad, lora_b.weight.requires_grad
        # B's input gradient is needed to reach A's weight (or anything upstream)
        cost.add(Cost(fa + fb, fa * (a_w + grad_in) + fb * (b_w + (a_w or grad_in))))
        out_grad = out_grad or a_w or b_w
    return cost, out_grad


def chain_cost(module: nn.Module, tokens: int, grad_in: bool) -> tuple[Cost, bool]:
    """The linears of a sequential module (a merger or projector MLP), in order."""
    total = Cost()
    for m in module.modules():
        if isinstance(m, nn.Linear) and not _inside_lora(m, module):
            cost, grad_in = linear_cost(_lora_parent(module, m), tokens, grad_in)
            total.add(cost)
    return total, grad_in


def _lora_parent(root: nn.Module, lin: nn.Linear) -> nn.Module:
    for m in root.modules():
        if getattr(m, "base_layer", None) is lin:
            return m
    return lin


def _inside_lora(lin: nn.Linear, root: nn.Module) -> bool:
    """A LoRA adapter's own linear (counted with the layer it adapts)."""
    return any(
        lin in getattr(m, "lora_A", {}).values() or lin in getattr(m, "lora_B", {}).values()
        for m in root.modules()
    )


def attention_cost(inner: int, lengths: Sequence[int], grad_in: bool) -> Cost:
    """QK^T and AV over sequences of these lengths (each attends within itself)."""
    f = sum(2 * linear(n, inner, n) for n in lengths)
    return Cost(f, 2 * f if grad_in else 0.0)


def block_cost(
    block: nn.Module, names: BlockNames, lengths: Sequence[int], grad_in: bool
) -> tuple[Cost, bool]:
    """One pre-norm block over sequences of `lengths` (attention within each): q/k/v on the
    block input, attention, output projection, MLP in (gate, up) and out."""
    tokens = sum(lengths)
    total, qkv_grad = Cost(), False
    for name in names.qkv:
        cost, g = linear_cost(block.get_submodule(name), tokens, grad_in)
        total.add(cost)
        qkv_grad |= g
    first = block.get_submodule(names.qkv[0])
    q_out = getattr(first, "base_layer", first).out_features
    inner = q_out // 3 if len(names.qkv) == 1 else q_out  # fused qkv: a third are the queries
    total.add(attention_cost(inner, lengths, qkv_grad))
    mid = qkv_grad
    for name in names.out:
        cost, g = linear_cost(block.get_submodule(name), tokens, qkv_grad)
        total.add(cost)
        mid |= g
    mid |= grad_in  # the residual stream
    hidden = False
    for name in names.mlp_in:
        cost, g = linear_cost(block.get_submodule(name), tokens, mid)
        total.add(cost)
        hidden |= g
    out = mid
    for name in names.mlp_out:
        cost, g = linear_cost(block.get_submodule(name), tokens, hidden)
        total.add(cost)
        out |= g
    return total, out


def stack_cost(
    blocks: nn.Module, names: BlockNames, lengths_of: Any, grad_in: bool
) -> tuple[Cost, bool]:
    """Every block of a ModuleList; `lengths_of(i)` gives block i's attention lengths."""
    total = Cost()
    for i, block in enumerate(blocks):
        cost, grad_in = block_cost(block, names, lengths_of(i), grad_in)
        total.add(cost)
    return total, grad_in


# ------------------------------------------------------------------------------ the model


def hf_model(model: nn.Module) -> nn.Module:
    """The `...ForConditionalGeneration` inside a `VLMEmbedder` (LoRA layers injected)."""
    inner = getattr(model, "model", None)
    if isinstance(inner, nn.Module) and hasattr(model, "lora"):  # a vltrain HF embedder
        return model.base_model()
    return model


def window_lengths(grid_h: int, grid_w: int, merge: int, window: int) -> list[int]:
    """Qwen2.5-VL's window attention: the patch grid cut into windows of `window` merged
    units a side (the last row/column of windows partial), each holding units x merge^2."""

    def sides(n: int) -> list[int]:
        return [window] * (n // window) + ([n % window] if n % window else [])

    return [h * w * merge**2 for h in sides(grid_h // merge) for w in sides(grid_w // merge)]


def _vision_lengths(hf: nn.Module, grid: tuple[int, int, int]) -> Any:
    """Block i -> the attention lengths of one image of patch grid (t, h, w)."""
    vc = hf.config.vision_config
    t, h, w = grid
    full = [t * h * w]
    if hf.config.model_type != "qwen2_5_vl":
        return lambda i: full
    window = vc.window_size // vc.spatial_merge_size // vc.patch_size
    windows = t * window_lengths(h, w, vc.spatial_merge_size, window)
    return lambda i: full if i in vc.fullatt_block_indexes else windows


def _used_vision_blocks(hf: nn.Module, n_blocks: int) -> int:
    """How many vision blocks feed the connector: LLaVA reads `vision_feature_layer`
    (hidden_states[k] = the output of the first k blocks); Qwen reads the last."""
    picked = getattr(hf.config, "vision_feature_layer", -1)
    picked = [picked] if isinstance(picked, int) else list(picked)
    return max(k if k >= 0 else n_blocks + 1 + k for k in picked)


def _llava_grid(hf: nn.Module) -> tuple[int, int, int]:
    vc = hf.config.vision_config
    side = vc.image_size // vc.patch_size
    return (1, side, side)


def hf_vlm_flops(
    model: nn.Module,
    image_seq: int,
    text_seq: int | Sequence[int],
    grid: tuple[int, int, int] | None = None,
    logits_tokens: int = 0,
) -> ModelFlops:
    """Per-sample accounting of an HF VLM (or a `VLMEmbedder`): one image of patch grid
    `grid` = (t, h, w) (`image_grid_thw`; None for LLaVA's fixed grid), an image-side
    sequence of `image_seq` tokens (image tokens included), text-side sequences of
    `text_seq` tokens (one int, or one per text: the caption, hard negatives; 0: none), the
    LM head on `logits_tokens` positions."""
    text_seqs = [text_seq] if isinstance(text_seq, int) else list(text_seq)
    hf = hf_model(model)
    mt = hf.config.model_type
    if mt not in FAMILIES:
        raise ValueError(
            f"no FLOP formula for model_type {mt!r} (have {sorted(FAMILIES)}); count one "
            "step with vltrain.scaling.flops.measure_flops"
        )
    fam = FAMILIES[mt]
    grid = grid or _llava_grid(hf)
    patches = grid[0] * grid[1] * grid[2]
    v_tokens = patches + fam.class_token
    # vision: patch embedding (a linear per patch: kernel = stride), then the blocks
    conv = hf.get_submodule(fam.patch_embed)
    f_patch = linear(patches, conv.weight[0].numel(), conv.out_channels)
    vision = Cost(f_patch, f_patch if conv.weight.requires_grad else 0.0)
    v_grad = conv.weight.requires_grad
    lengths = _vision_lengths(hf, grid) if not fam.class_token else (lambda i: [v_tokens])
    blocks = hf.get_submodule(fam.vision_blocks)
    used = _used_vision_blocks(hf, len(blocks))
    cost, v_grad = stack_cost(blocks[:used], fam.vision_block, lengths, v_grad)
    vision.add(cost)
    # blocks after the one the connector reads run forward but never see a gradient
    unused, _ = stack_cost(blocks[used:], fam.vision_block, lengths, False)
    vision.forward += unused.forward
    v_grad |= _trains(hf.get_submodule(fam.vision_blocks)) or conv.weight.requires_grad
    # connector: mergers on P / merge^2 tokens, or the projector on the patch tokens
    merge = hf.config.vision_config.spatial_merge_size if fam.merge else 1
    image_tokens = patches // merge**2
    if fam.class_token and getattr(hf.config, "vision_feature_select_strategy", "") == "full":
        image_tokens += 1  # LLaVA's "full" keeps the class token; "default" drops it
    connector, c_grad, c_modules = Cost(), v_grad, []
    for path in fam.mergers:
        mod = hf.get_submodule(path)
        c_modules.append(mod)
        cost, g = chain_cost(mod, image_tokens, v_grad)
        connector.add(cost)
        c_grad |= g
    # decoder: the image-side and text-side sequences (each attends within itself)
    lm = hf.get_submodule(fam.lm_blocks)
    embed = hf.get_input_embeddings()
    e_grad = embed.weight.requires_grad
    decoder = Cost()
    for seq, g_in in ((image_seq, c_grad or e_grad), *((n, e_grad) for n in text_seqs)):
        if seq:
            cost, _ = stack_cost(lm, LM_BLOCK, lambda i, n=seq: [n], g_in)
            decoder.add(cost)
    if logits_tokens:
        cost, _ = linear_cost(hf.get_output_embeddings(), logits_tokens, True)
        decoder.add(cost)
    parts = [
        _part("vision", [hf.get_submodule(fam.vision_blocks), conv], vision, v_tokens),
        _part("connector", c_modules, connector, image_tokens),
        _part("decoder", [lm, embed], decoder, image_seq + sum(text_seqs)),
    ]
    notes = [
        f"vision: {patches} patches (grid {grid}); {image_tokens} image tokens in the LM",
        *_partly_trained(parts, [[hf.get_submodule(fam.vision_blocks), conv], c_modules, [lm]]),
        f"decoder: image-side sequence {image_seq} + text-side sequences {text_seqs} tokens",
    ]
    return ModelFlops(parts, image_tokens, sum(text_seqs), notes)


def _partly_trained(parts: list[Component], modules: list[list[nn.Module]]) -> list[str]:
    """Notes for components of which only some parameters train (LoRA): N of a scaling law
    counts the component (the model's size), not its adapters."""
    notes = []
    for part, mods in zip(parts, modules, strict=True):
        trained = sum(p.numel() for m in mods for p in m.parameters() if p.requires_grad)
        total = sum(p.numel() for m in mods for p in m.parameters())
        if 0 < trained < total:
            notes.append(f"{part.name}: {trained} of {total} parameters train (LoRA / partial)")
    return notes


def _part(name: str, modules: list[nn.Module], cost: Cost, tokens: int) -> Component:
    total = nonembed = 0
    trains = False
    for m in modules:
        t, n = count_params(m) if not isinstance(m, nn.Embedding) else (m.weight.numel(), 0)
        total, nonembed = total + t, nonembed + n
        trains |= _trains(m)
    return Component(name, total, nonembed, cost.forward, trains, cost.backward, tokens)


# ------------------------------------------------------------------------------ from a config


def mean_flops(counts: Sequence[ModelFlops]) -> ModelFlops:
    """The per-sample mean of several samples' counts (FLOPs are not linear in the lengths:
    attention is quadratic, so the mean of the counts, not the count at the mean length)."""
    n = len(counts)
    parts = [
        Component(
            c.name,
            c.params,
            c.nonembed_params,
            sum(x.components[i].forward for x in counts) / n,
            c.trainable,
            sum(x.components[i].backward for x in counts) / n,
            round(sum(x.components[i].tokens for x in counts) / n),
        )  # fmt: skip
        for i, c in enumerate(counts[0].components)
    ]
    image = round(sum(x.image_tokens for x in counts) / n)
    text = round(sum(x.text_tokens for x in counts) / n)
    notes = [f"mean over {n} training samples at their real lengths"]
    return ModelFlops(parts, image, text, notes)


def vlm_config_flops(cfg: Any, max_samples: int = 64) -> ModelFlops:
    """Per-sample accounting of the `model.kind: vlm` run `cfg` describes: the embedder built
    on the meta device (LoRA and freezing as the run has them; no weights read), each of up to
    `max_samples` training records (spread over the file) collated as the run collates it (the
    image processor's resize, `data.max_visual_tokens`, prompts, hard negatives), counted at
    its real patch grid and lengths, and averaged."""
    from vltrain.data.records import ImageTextDataset
    from vltrain.models.backbones import build_batcher, build_encoder

    emb = build_encoder(cfg, None, weights=False)
    collate = build_batcher(cfg, None)
    d = cfg.data
    data = ImageTextDataset(
        d.train, d.image_size, cfg.run.seed, cfg.objective.hard_negatives, train=True,
        native=True, image_column=d.image_column, text_column=d.text_column,
    )  # fmt: skip
    step = max(1, len(data) // max_samples)
    counts = []
    for i in range(0, len(data), step)[:max_samples]:
        sample = data[(0, 0, i)]
        if "bad" in sample:
            continue
        inputs, _ = collate.image_batch([sample["image"]])
        grid = inputs.get("image_grid_thw")
        texts = [sample["text"], *sample.get("negatives", [])]
        ids, mask = collate.text_batch(texts)
        counts.append(
            hf_vlm_flops(
                emb,
                int(inputs["attention_mask"].sum()),
                [int(n) for n in mask.sum(1)],
                tuple(int(x) for x in grid[0]) if grid is not None else None,
            )
        )
    if not counts:
        raise ValueError(f"data.train={d.train} holds no readable samples to count FLOPs on")
    return mean_flops(counts)
