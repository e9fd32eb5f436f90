"""A small ViT image tower (CLIP-style: conv patches, class token, pre-LN, blocks, final LN)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from vltrain.models.layers import check_dims, init_weights, make_blocks

# CLIP's pixel statistics; images arrive as float in [0, 1] and are normalised inside the tower.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class VisionTowerConfig:
    """Dimensions of a ViT image tower."""

    image_size: int
    """Side of the square input image in pixels."""
    patch_size: int
    """Side of a square patch; must divide image_size."""
    width: int
    """Hidden size of every token."""
    layers: int
    """Number of transformer blocks."""
    heads: int
    """Attention heads; must divide width."""
    mlp_ratio: float = 4.0
    """MLP hidden size as a multiple of width."""
    dropout: float = 0.0
    """Dropout on attention weights and residual branches."""

    def __post_init__(self) -> None:
        check_dims("VisionTowerConfig", self.width, self.heads, self.layers, self.mlp_ratio)
        if self.patch_size <= 0 or self.image_size % self.patch_size != 0:
            raise ValueError(
                f"VisionTowerConfig: patch_size {self.patch_size} must divide "
                f"image_size {self.image_size}"
            )

    @property
    def num_patches(self) -> int:
        """Patches per image (tokens excluding the class token)."""
        return (self.image_size // self.patch_size) ** 2


class VisionTower(nn.Module):
    """ViT encoder: ``forward(images (B, 3, H, W) in [0, 1]) -> tokens (B, 1 + P, W)``."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.width = cfg.width
        self.patch_embed = nn.Conv2d(
            3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False
        )
        self.class_token = nn.Parameter(torch.zeros(cfg.width))
        self.pos_embed = nn.Parameter(torch.zeros(1 + cfg.num_patches, cfg.width))
        self.norm_pre = nn.LayerNorm(cfg.width)
        self.blocks = make_blocks(cfg.width, cfg.layers, cfg.heads, cfg.mlp_ratio, cfg.dropout)
        self.norm = nn.LayerNorm(cfg.width)
        self.register_buffer("pixel_mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor(CLIP_STD).view(1, 3, 1, 1), False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, zero biases, unit LayerNorms."""
        self.apply(init_weights)
        nn.init.normal_(self.class_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: Tensor) -> Tensor:
        """Encode images (B, 3, H, W) float in [0, 1] to tokens (B, 1 + P, W); token 0 = class."""
        size = self.cfg.image_size
        if images.ndim != 4 or images.shape[1] != 3 or tuple(images.shape[-2:]) != (size, size):
            raise ValueError(
                f"VisionTower expects images of shape (B, 3, {size}, {size}), "
                f"got {tuple(images.shape)}"
            )
        x = (images - self.pixel_mean) / self.pixel_std
        x = self.patch_embed(x.to(self.patch_embed.weight.dtype))  # (B, W, h, w)
        x = x.flatten(2).transpose(1, 2)  # (B, P, W)
        cls = self.class_token.to(x.dtype).expand(x.shape[0], 1, -1)  # (B, 1, W)
        x = torch.cat([cls, x], dim=1) + self.pos_embed.to(x.dtype)  # (B, 1 + P, W)
        x = self.norm_pre(x)
        for block in self.blocks:
            x, _ = block(x)
        return self.norm(x)

    def pooled(self, images: Tensor) -> Tensor:
        """Class-token features (B, W)."""
        return self.forward(images)[:, 0]
