"""The image tower: a ViT (CLIP-style: conv patches, class token, pre-LN, blocks, final LN), or
the same token interface over a small convolutional stem.

``stem="patch"`` embeds each patch with one linear map (a strided conv), the ViT way.
``stem="conv"`` halves the image with a 3x3 stride-2 convolution (GroupNorm, GELU) once per
factor of two of ``patch_size``, then a 3x3 convolution to ``width`` gives the same
(image / patch)^2 grid of tokens, each of which has seen its neighbours (Xiao et al. 2021,
"Early convolutions help transformers see better"). ``pool="flatten"`` makes token 0 a linear
map of the whole grid instead of a learned class token, so the pooled feature keeps where things
are (a CNN head); with ``layers=0`` the tower is then a plain CNN. ``pool="max"`` makes token 0
the channel-wise max over the grid: one detector shared by every place, so what is found does
not depend on where (a page's words; `vltrain.objectives.reading` trains the grid to read them).
``pool="none"`` (no blocks) makes the tower its stem: it pools nothing, and a dense head reads its
grid (`grid`; the word-pair head of `vltrain.models.word_pairs`).
On the synthetic shapes data the conv stem with the flatten head learns several times faster
per step than the patch-8 ViT (bench/quickstart_recipe.py).
"""

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
    stem: str = "patch"
    """Token embedding: "patch" (one linear map per patch, ViT) or "conv" (stride-2 3x3 convs)."""
    stem_channels: tuple[int, ...] = ()
    """Conv stem: channels of its stride-2 convolutions, one per factor 2 of patch_size (empty:
    width / 2^k, doubling up to width); one entry more puts a stride-1 conv at full
    resolution first (small shapes keep their outline)."""
    stem_norm: str = "batch"
    """Conv stem: "batch" (BatchNorm: learns fastest; running statistics per rank, kept in eval
    mode when the tower is frozen) or "group" (GroupNorm: no batch statistics, so GradCache
    chunks and DDP ranks compute exactly the unchunked single-process function)."""
    stem_grid_channels: tuple[int, ...] = ()
    """Conv stem: channels of stride-1 3x3 convs at the grid's resolution, after the halvings
    and before the conv to width (each widens the receptive field by 2 x patch_size pixels)."""
    pool: str = "cls"
    """Token 0: "cls" (a learned class token, attended through the blocks), "flatten" (a
    linear map of the whole token grid: keeps positions; the usual head of a small CNN) or
    "max" (the channel-wise max over the grid tokens: position-invariant) or "none" (no token
    0, no blocks: the tower is its stem and only `grid` is defined)."""

    def __post_init__(self) -> None:
        check_dims("VisionTowerConfig", self.width, self.heads, self.layers, self.mlp_ratio)
        if self.patch_size <= 0 or self.image_size % self.patch_size != 0:
            raise ValueError(
                f"VisionTowerConfig: patch_size {self.patch_size} must divide "
                f"image_size {self.image_size}"
            )
        if self.stem not in STEMS or self.pool not in POOLS or self.stem_norm not in NORMS:
            raise ValueError(
                f"VisionTowerConfig: stem must be one of {STEMS}, stem_norm one of {NORMS} and "
                f"pool one of {POOLS} (got stem={self.stem!r}, stem_norm={self.stem_norm!r}, "
                f"pool={self.pool!r})"
            )
        self.stem_channels = tuple(int(c) for c in self.stem_channels)
        if self.stem == "conv":
            halvings = self.halvings
            if self.patch_size != 1 << halvings:
                raise ValueError(
                    f"VisionTowerConfig: stem='conv' halves the image per stride-2 conv, so "
                    f"patch_size must be a power of two (got {self.patch_size})"
                )
            if not self.stem_channels:
                self.stem_channels = tuple(
                    max(8, self.width >> (halvings - i)) for i in range(1, halvings + 1)
                )
            n = len(self.stem_channels)
            if n not in (halvings, halvings + 1) or min(self.stem_channels) <= 0:
                raise ValueError(
                    f"VisionTowerConfig: stem_channels {self.stem_channels} must hold "
                    f"{halvings} positive channel counts (one per halving of patch "
                    f"{self.patch_size}), or {halvings + 1} with a stride-1 conv first"
                )
        elif self.stem_channels or self.stem_grid_channels:
            raise ValueError(
                "VisionTowerConfig: stem_channels and stem_grid_channels need stem='conv'"
            )
        if self.pool == "none" and self.layers:
            raise ValueError(
                f"VisionTowerConfig: pool='none' is a tower without blocks (its grid is read "
                f"directly), got layers={self.layers}"
            )
        self.stem_grid_channels = tuple(int(c) for c in self.stem_grid_channels)
        if self.stem_grid_channels and min(self.stem_grid_channels) <= 0:
            raise ValueError(
                f"VisionTowerConfig: stem_grid_channels {self.stem_grid_channels} must be positive"
            )

    @property
    def halvings(self) -> int:
        """Stride-2 convolutions of a conv stem: log2(patch_size), rounded down."""
        return self.patch_size.bit_length() - 1

    @property
    def num_patches(self) -> int:
        """Patches per image (tokens excluding the class token)."""
        return (self.image_size // self.patch_size) ** 2


STEMS = ("patch", "conv")
POOLS = ("cls", "flatten", "max", "none")
NORMS = ("batch", "group")


def norm_layer(kind: str, channels: int) -> nn.Module:
    """A conv stem's norm: "batch" (BatchNorm2d) or "group" (GroupNorm, up to 8 groups)."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    groups = next(g for g in (8, 4, 2, 1) if channels % g == 0)
    return nn.GroupNorm(groups, channels)


def conv_stem(cfg: VisionTowerConfig) -> nn.Sequential:
    """(B, 3, S, S) -> (B, width, S / patch, S / patch): [a stride-1 3x3 conv,] stride-2 3x3
    convs with a norm and GELU each, [stride-1 convs at the grid's resolution,] then a 3x3 conv
    to width (norm, GELU)."""
    layers: list[nn.Module] = []
    c = 3
    halvings = cfg.halvings
    strides = [1] * (len(cfg.stem_channels) - halvings) + [2] * halvings
    strides += [1] * (len(cfg.stem_grid_channels) + 1)
    channels = (*cfg.stem_channels, *cfg.stem_grid_channels, cfg.width)
    for out, stride in zip(channels, strides, strict=True):
        layers += [nn.Conv2d(c, out, 3, stride, 1, bias=False), norm_layer(cfg.stem_norm, out)]
        layers.append(nn.GELU())
        c = out
    return nn.Sequential(*layers)


class VisionTower(nn.Module):
    """ViT encoder: ``forward(images (B, 3, H, W) in [0, 1]) -> tokens (B, 1 + P, W)``."""

    def __init__(self, cfg: VisionTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.width = cfg.width
        if cfg.stem == "conv":
            self.patch_embed: nn.Module = conv_stem(cfg)
        else:
            self.patch_embed = nn.Conv2d(
                3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size, bias=False
            )
        if cfg.pool == "flatten":  # token 0 from the whole grid, positions kept
            self.grid_pool = nn.Linear(cfg.num_patches * cfg.width, cfg.width)
        elif cfg.pool == "cls":
            self.class_token = nn.Parameter(torch.zeros(cfg.width))
        self.blocks = make_blocks(cfg.width, cfg.layers, cfg.heads, cfg.mlp_ratio, cfg.dropout)
        if cfg.pool != "none":  # (a stem-only tower has no parameter it would not train)
            self.pos_embed = nn.Parameter(torch.zeros(1 + cfg.num_patches, cfg.width))
            self.norm_pre = nn.LayerNorm(cfg.width)
            self.norm = nn.LayerNorm(cfg.width)
        self.register_buffer("pixel_mean", torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor(CLIP_STD).view(1, 3, 1, 1), False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, zero biases, unit LayerNorms."""
        self.apply(init_weights)
        if self.cfg.pool == "cls":
            nn.init.normal_(self.class_token, std=0.02)
        if self.cfg.pool != "none":
            nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: Tensor) -> Tensor:
        """Encode images (B, 3, H, W) float in [0, 1] to tokens (B, 1 + P, W); token 0 = class."""
        self._pools("forward")
        x = self._grid(images)  # (B, P, W)
        if self.cfg.pool == "flatten":
            cls = self.grid_pool(x.flatten(1))[:, None]  # (B, 1, W)
        elif self.cfg.pool == "max":
            cls = x.amax(1, keepdim=True)  # (B, 1, W)
        else:
            cls = self.class_token.to(x.dtype).expand(x.shape[0], 1, -1)  # (B, 1, W)
        x = torch.cat([cls, x], dim=1) + self.pos_embed.to(x.dtype)  # (B, 1 + P, W)
        x = self.norm_pre(x)
        for block in self.blocks:
            x, _ = block(x)
        return self.norm(x)

    def _pools(self, what: str) -> None:
        if self.cfg.pool == "none":
            raise ValueError(f"VisionTower.{what}: a pool='none' tower has only its grid")

    def grid(self, images: Tensor) -> Tensor:
        """Grid tokens (B, P, W) of a tower without blocks: its stem's output."""
        if len(self.blocks):
            raise ValueError("VisionTower.grid: the tower has blocks (use pooled_and_grid)")
        return self._grid(images)

    def _grid(self, images: Tensor) -> Tensor:
        """Normalised images (B, 3, H, W) through the stem -> grid tokens (B, P, W)."""
        size = self.cfg.image_size
        if images.ndim != 4 or images.shape[1] != 3 or tuple(images.shape[-2:]) != (size, size):
            raise ValueError(
                f"VisionTower expects images of shape (B, 3, {size}, {size}), "
                f"got {tuple(images.shape)}"
            )
        x = (images - self.pixel_mean) / self.pixel_std
        if self.cfg.stem == "conv" and x.device.type == "cpu":
            # oneDNN's channels-last convolutions: forward + backward of the tiny_cnn stem in
            # 0.13 s instead of 0.16 s per batch of 128 (AMD EPYC, 2 cores); weights stay as
            # they are, only the activations change layout
            x = x.contiguous(memory_format=torch.channels_last)
        x = self.patch_embed(x.to(next(self.patch_embed.parameters()).dtype))  # (B, W, h, w)
        return x.flatten(2).transpose(1, 2)  # (B, P, W)

    def pooled(self, images: Tensor) -> Tensor:
        """Class-token features (B, W). With the flatten or max pool and no blocks nothing mixes
        the tokens, so only token 0 is normalised (the (B, 1 + P, W) concatenation and its two
        LayerNorms are skipped: the same values, ~4 ms less per batch of 128 on 2 cores)."""
        return self.pooled_and_grid(images)[0]

    def pooled_and_grid(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """Class-token features (B, W) and the grid tokens they were pooled from (B, P, W):
        the stem's output without blocks, else the last block's (what a dense loss reads)."""
        self._pools("pooled_and_grid")
        if self.cfg.pool != "cls" and not len(self.blocks):
            x = self._grid(images)  # (B, P, W)
            cls = self.grid_pool(x.flatten(1)) if self.cfg.pool == "flatten" else x.amax(1)
            cls = cls + self.pos_embed[0].to(x.dtype)  # (B, W)
            return self.norm(self.norm_pre(cls)), x
        x = self.forward(images)  # (B, 1 + P, W)
        return x[:, 0], x[:, 1:]
