"""CLIP-style dual encoder: ViT + text tower, each with a linear projection to a shared space.

Embeddings are L2-normalised in fp32 (bf16 norms are too coarse for contrastive logits). The
temperature / bias live in the loss, not here. With `reading_tokens` the image tower also reads the
token drawn at each cell of its grid (`encode_image_read`, for `objective.reading`); with
``head="word_pairs"`` both sides are a word-pair code instead (`vltrain.models.word_pairs`: the
image tower reads, the text side needs no tower).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vltrain.models.layers import init_weights
from vltrain.models.presets import text_config, vision_config
from vltrain.models.text import TextTower, TextTowerConfig
from vltrain.models.vit import VisionTower, VisionTowerConfig, norm_layer
from vltrain.models.word_pairs import LINE_CHANNELS, Reading, WordPairHead

HEADS = ("pooled", "word_pairs")


class DualEncoder(nn.Module):
    """``encode_image(images) -> (B, E)`` and ``encode_text(ids, mask) -> (B, E)``, unit norm."""

    #: padding is never attended and pooling reads the last real token, so trailing padding
    #: columns can be cut (GradCache groups texts by length, `length_sorted_chunks`)
    ignores_trailing_padding = True

    def __init__(
        self,
        vision_cfg: VisionTowerConfig,
        text_cfg: TextTowerConfig,
        embed_dim: int,
        *,
        head: str = "pooled",
        reading_tokens: Sequence[int] | None = None,
        specials: int = 0,
        pair_code: str = "add",
    ) -> None:
        """`head`: "pooled" (each tower pools, a linear map projects) or "word_pairs" (a shared
        word-pair code, `embed_dim` wide; needs `reading_tokens`). `reading_tokens`: the token
        ids the image tower learns to read (`vltrain.data.reading.reading_tokens`; None: it
        does not read); `specials`: the tokenizer's lowest ids, never tokens of a text; `pair_code`:
        how the word-pair head codes a pair (`vltrain.models.word_pairs.PAIR_CODES`)."""
        super().__init__()
        reads = None if reading_tokens is None else len(reading_tokens)
        if embed_dim <= 0 or head not in HEADS or reads == 0:
            raise ValueError(
                f"DualEncoder: embed_dim must be positive, head one of {HEADS} and "
                f"reading_tokens None or not empty (got {embed_dim}, {head!r})"
            )
        if (head == "word_pairs") != (vision_cfg.pool == "none") or (
            head == "word_pairs" and reading_tokens is None
        ):
            raise ValueError(
                "DualEncoder: the word-pair head codes what the image tower reads at each cell "
                "of its grid: it needs reading_tokens and a tower that pools nothing (pool "
                f"'none'), and only it reads such a tower (got head={head!r}, "
                f"pool={vision_cfg.pool!r}, reading tokens: {reads})"
            )
        self.embed_dim, self.head = embed_dim, head
        self.vision = VisionTower(vision_cfg)
        self.pairs: WordPairHead | None = None
        self.reader: nn.Linear | None = None
        classes = reads or 0
        if head == "word_pairs":
            assert reading_tokens is not None
            token_class = torch.full((text_cfg.vocab_size,), classes + 1, dtype=torch.long)
            token_class[torch.tensor(list(reading_tokens))] = torch.arange(classes)
            side = vision_cfg.image_size // vision_cfg.patch_size
            self.pairs = WordPairHead(
                vision_cfg.width,
                classes,
                embed_dim,
                side,
                token_class=token_class,
                specials=specials,
                norm=norm_layer(vision_cfg.stem_norm, LINE_CHANNELS),
                pair_code=pair_code,
            )
            return
        self.text = TextTower(text_cfg)
        self.vision_proj = nn.Linear(vision_cfg.width, embed_dim, bias=False)
        self.text_proj = nn.Linear(text_cfg.width, embed_dim, bias=False)
        init_weights(self.vision_proj)
        init_weights(self.text_proj)
        if classes:
            self.reader = nn.Linear(vision_cfg.width, classes + 1)  # the last: background
            init_weights(self.reader)

    @property
    def text_dropout_active(self) -> bool:
        """True while text dropout draws masks (training with p > 0); texts are then encoded
        one set at a time (`encode_text_sets`), in the order GradCache's chunks draw them, so
        one GradCache chunk stays exactly the plain step."""
        return self.pairs is None and self.training and self.text.cfg.dropout > 0

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
        if self.pairs is not None:
            return self.encode_image_read(images, normalize)[0]
        x = self.vision_proj(self.vision.pooled(images))  # (B, E)
        return F.normalize(x.float(), dim=-1) if normalize else x

    def encode_image_read(self, images: Tensor, normalize: bool = True) -> tuple[Tensor, Reading]:
        """`encode_image` (B, E) and what the tower reads on each image (`Reading`: the dense
        targets of `vltrain.objectives.reading`)."""
        if self.pairs is not None:
            x, read = self.pairs.page(self.vision.grid(images))
            return (F.normalize(x.float(), dim=-1) if normalize else x), read
        pooled, grid = self.vision.pooled_and_grid(images)
        if self.reader is not None:
            x, read = self.vision_proj(pooled), Reading(self.reader(grid))
        else:
            raise ValueError("DualEncoder.encode_image_read: built without reading_tokens")
        return (F.normalize(x.float(), dim=-1) if normalize else x), read

    def encode_text(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, normalize: bool = True
    ) -> Tensor:
        """Token ids (B, T) + mask (B, T) -> embeddings (B, E), fp32, unit norm by default."""
        if self.pairs is not None:
            x = self.pairs.text(input_ids, attention_mask)
        else:
            x = self.text_proj(self.text.pooled(input_ids, attention_mask))  # (B, E)
        return F.normalize(x.float(), dim=-1) if normalize else x

    def forward(
        self, images: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Both embeddings in one call (so DDP sees a single forward): (B, E), (B', E)."""
        return self.encode_image(images), self.encode_text(input_ids, attention_mask)
