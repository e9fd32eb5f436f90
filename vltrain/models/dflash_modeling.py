"""DFlash draft model for plain transformers: ``AutoModel.from_pretrained(EXPORT,
trust_remote_code=True)``.

`vltrain export --format dflash` copies this file into the export as ``modeling_dflash.py`` and
names it in config.json's ``auto_map``, as z-lab's published DFlash checkpoints ship their
modelling file. It imports torch and transformers only (the reader need not have vltrain) and
is written from the format's facts: a Qwen3 config whose ``dflash_config`` holds
``target_layer_ids`` and ``mask_token_id`` (``block_size`` at the top level); weights ``fc``
(the concatenated target features -> width), ``hidden_norm``, Qwen3 decoder layers with q/k
RMSNorm whose keys/values are ``[context; block]`` and whose attention is not causal, a final
``norm``. The embedding and the LM head are the target's.

Use: ``feature = cat(target_outputs.hidden_states[i + 1] for i in model.target_layer_ids)``
(the target run with ``output_hidden_states=True``), the block ``[anchor, mask, ..., mask]``
embedded by the target, positions ``0 .. S + K - 1``; ``target.lm_head(model(feature,
block_embedding, positions))[:, 1:]`` scores the K - 1 drafted tokens after the anchor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


class DFlashAttention(nn.Module):
    """Queries of the block; keys/values of [context; block]; q/k norm before RoPE."""

    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.dh = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        bias = bool(getattr(c, "attention_bias", False))
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.dh, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.dh, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.dh, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.dh, c.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.dh, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.dh, eps=c.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, n, _ = x.shape
        kv = torch.cat([ctx, x], 1)
        q = self.q_norm(self.q_proj(x).view(b, n, -1, self.dh)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv).view(b, kv.shape[1], -1, self.dh)).transpose(1, 2)
        v = self.v_proj(kv).view(b, kv.shape[1], -1, self.dh).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # the block's queries take the last positions
        q = q * cos[..., -n:, :] + rotate_half(q) * sin[..., -n:, :]
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = F.scaled_dot_product_attention(q, k, v, scale=self.dh**-0.5)
        return self.o_proj(att.transpose(1, 2).reshape(b, n, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x: Tensor, ctx: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(PreTrainedModel):
    """The draft network of a DFlash checkpoint (no embedding, no head: the target's)."""

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        d = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(d["target_layer_ids"])
        self.mask_token_id = int(d["mask_token_id"])
        self.block_size = int(d.get("block_size", getattr(config, "block_size", 16)))
        w = config.hidden_size
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(w, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * w, w, bias=False)
        self.hidden_norm = Qwen3RMSNorm(w, eps=config.rms_norm_eps)
        self.post_init()

    def forward(self, target_hidden: Tensor, noise_embedding: Tensor, position_ids: Tensor):
        """Context features (B, S, F), the block's embeddings (B, K, W), positions (B, S + K)
        -> the block's final hidden states (B, K, W), for the target's LM head."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, ctx, cos, sin)
        return self.norm(x)
