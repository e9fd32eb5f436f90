"""CLIP-style dual encoder: ViT + text tower, each with a linear projection to a shared space.

Embeddings are L2-normalised in fp32 (bf16 norms are too coarse for contrastive logits). The
temperature / bias live in the loss, not here.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.models.layers import init_weights
from vltrain.models.presets import text_config, vision_config
from vltrain.models.text import TextTower, TextTowerConfig
from vltrain.models.vit import VisionTower, VisionTowerConfig


class DualEncoder(nn.Module):
    """``encode_image(images) -> (B, E)`` and ``encode_text(ids, mask) -> (B, E)``, unit norm."""

    #: padding is never attended and pooling reads the last real token, so trailing padding
    #: columns can be cut (GradCache groups texts by length, `length_sorted_chunks`)
    ignores_trailing_padding = True

    def __init__(
        self, vision_cfg: VisionTowerConfig, text_cfg: TextTowerConfig, embed_dim: int
    ) -> None:
        super().__init__()
        if embed_dim <= 0:
            raise ValueError(f"DualEncoder: embed_dim must be positive, got {embed_dim}")
        self.embed_dim = embed_dim
        self.vision = VisionTower(vision_cfg)
        self.text = TextTower(text_cfg)
        self.vision_proj = nn.Linear(vision_cfg.width, embed_dim, bias=False)
        self.text_proj = nn.Linear(text_cfg.width, embed_dim, bias=False)
        init_weights(self.vision_proj)
        init_weights(self.text_proj)

    @property
    def text_dropout_active(self) -> bool:
        """True while text dropout draws masks (training with p > 0); texts are then encoded
        one set at a time (`encode_text_sets`), in the order GradCache's chunks draw them, so
        one GradCache chunk stays exactly the plain step."""
        return self.training and self.text.cfg.dropout > 0

    @classmethod
    def from_preset(
        cls,
        vision: str = "tiny",
        text: str = "tiny",
        embed_dim: int = 128,
        *,
        vocab_size: int,
        context_length: int | None = None,
        dropout: float = 0.0,
    ) -> DualEncoder:
        """Build from named sizes (see ``vltrain.models.presets``)."""
        extra = {} if context_length is None else {"context_length": context_length}
        v_cfg = vision_config(vision, dropout=dropout)
        t_cfg = text_config(text, vocab_size=vocab_size, dropout=dropout, **extra)
        return cls(v_cfg, t_cfg, embed_dim)

    def encode_image(self, images: Tensor, normalize: bool = True) -> Tensor:
        """Images (B, 3, H, W) in [0, 1] -> embeddings (B, E), fp32, unit norm by default."""
        x = self.vision_proj(self.vision.pooled(images))  # (B, E)
        return F.normalize(x.float(), dim=-1) if normalize else x

    def encode_image_grid(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """`encode_image` (B, E) and the vision tower's grid tokens (B, P, W) it pooled, for a
        dense loss on the image (`vltrain.objectives.reading`)."""
        pooled, grid = self.vision.pooled_and_grid(images)
        return F.normalize(self.vision_proj(pooled).float(), dim=-1), grid

    def encode_text(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, normalize: bool = True
    ) -> Tensor:
        """Token ids (B, T) + mask (B, T) -> embeddings (B, E), fp32, unit norm by default."""
        x = self.text_proj(self.text.pooled(input_ids, attention_mask))  # (B, E)
        return F.normalize(x.float(), dim=-1) if normalize else x

    def forward(
        self, images: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Both embeddings in one call (so DDP sees a single forward): (B, E), (B', E)."""
        return self.encode_image(images), self.encode_text(input_ids, attention_mask)
