"""A loader for z-lab's DFlash format, written from the facts of z-lab's modelling code
(github.com/z-lab/dflash, ``dflash/model.py``), not from vltrain's drafter.

Facts used: config.json is a Qwen3 config with ``dflash_config.target_layer_ids`` /
``mask_token_id`` (and ``block_size``, top level or in ``dflash_config``); the weights are
``fc``, ``hidden_norm``, ``norm`` and Qwen3 decoder layers (``self_attn.{q,k,v,o}_proj``,
``self_attn.{q,k}_norm``, ``mlp.{gate,up,down}_proj``, ``input_layernorm``,
``post_attention_layernorm``); the embedding and LM head are the target's. The context feature
is ``cat(hidden_states[layer_id + 1])``; ``target_hidden = hidden_norm(fc(feature))``; in every
layer the keys/values are ``k_proj``/``v_proj`` of [target_hidden; the block's normed states],
q and k go through the per-head norms before RoPE (the block's queries take the last positions),
attention is non-causal over everything, then o_proj, the residual, the SwiGLU MLP; the output
is ``norm(hidden)``; decoding feeds the target's embedding of [anchor, mask, ..., mask] and
scores the last ``block_size - 1`` slots with the target's head.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def context_features(hidden_states: tuple[Tensor, ...], layer_ids: list[int], offset: int = 1):
    """z-lab's feature: the target's ``hidden_states[layer_id + 1]``, concatenated."""
    return torch.cat([hidden_states[i + offset] for i in layer_ids], dim=-1)


class Attention(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.dh = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.dh, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.dh, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.dh, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.dh, c.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.dh, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.dh, eps=c.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        from transformers.models.qwen3.modeling_qwen3 import rotate_half

        b, q_len, _ = x.shape
        kv = torch.cat([ctx, x], 1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, -1, self.dh)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv).view(b, kv.shape[1], -1, self.dh)).transpose(1, 2)
        v = self.v_proj(kv).view(b, kv.shape[1], -1, self.dh).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -q_len:, :] + rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = F.scaled_dot_product_attention(q, k, v, scale=self.dh**-0.5)
        return self.o_proj(att.transpose(1, 2).reshape(b, q_len, -1))


class Layer(nn.Module):
    def __init__(self, c) -> None:
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        self.self_attn = Attention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashReference(nn.Module):
    """The draft network of a z-lab DFlash checkpoint."""

    def __init__(self, c) -> None:
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        d = getattr(c, "dflash_config", {}) or {}
        self.target_layer_ids = d.get("target_layer_ids", getattr(c, "target_layer_ids", None))
        self.mask_token_id = d.get("mask_token_id", getattr(c, "mask_token_id", None))
        self.block_size = int(d.get("block_size", getattr(c, "block_size", 16)))
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(c)
        n = len(self.target_layer_ids)
        self.fc = nn.Linear(n * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, target_feature: Tensor, noise_embedding: Tensor, position_ids: Tensor):
        """Context features (1, S, F), block embeddings (1, K, W), positions (1, S + K)."""
        ctx = self.hidden_norm(self.fc(target_feature))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, cos, sin)
        return self.norm(x)


def load(folder: str | Path) -> tuple[DFlashReference, list[str]]:
    """(model in eval mode, key problems: missing / unexpected) of a DFlash export."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    raw = json.loads((Path(folder) / "config.json").read_text())
    if raw.get("architectures") != ["DFlashDraftModel"]:
        return DFlashReference(Qwen3Config()), [f"architectures {raw.get('architectures')}"]
    c = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures",)})
    model = DFlashReference(c)
    state = load_file(str(Path(folder) / "model.safetensors"))
    res = model.load_state_dict(state, strict=False)
    problems = [f"missing {k}" for k in res.missing_keys]
    problems += [f"unexpected {k}" for k in res.unexpected_keys]
    return model.eval(), problems
