"""What the evaluators need of the process, the model and the batcher, as typed seams.

The evaluators of this package sit below the models and the engine (they import neither): a
stage hands them its run context (`vltrain.engine.runtime.RunContext` is a `Placement`), its
encoder and its backbone's batcher, which these protocols describe.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor


class Placement(Protocol):
    """Where this process evaluates: its device, and its shard of the ranks."""

    device: torch.device
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool: ...


class Encoder(Protocol):
    """A contrastive encoder: unit-norm embeddings (B, E) of images and of texts."""

    def encode_image(self, images: Any) -> Tensor: ...

    def encode_text(self, ids: Tensor, mask: Tensor) -> Tensor: ...


class Batcher(Protocol):
    """A backbone's batcher (`vltrain.models.backbones.build_batcher`): model inputs of images
    and of texts, and visual-token counts per image (None when it does not count them)."""

    def image_batch(
        self, images: list[Any], texts: Any = None, instructions: Any = None, role: str = ""
    ) -> tuple[Any, Tensor | None]: ...

    def text_batch(
        self, texts: list[str], instructions: Any = None, role: str = ""
    ) -> tuple[Tensor, Tensor]: ...
