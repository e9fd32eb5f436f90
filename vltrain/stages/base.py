"""The task interface the engine drives, and the stage registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset

from vltrain.config.schema import Config
from vltrain.engine.runtime import RunContext


class BatchSampler(Protocol):
    """What the engine needs of a training sampler (see vltrain.data.samplers)."""

    def __iter__(self) -> Any: ...

    def position_after(self, key: tuple[int, int, int]) -> tuple[int, int]: ...


class Stage(ABC):
    """A small task object: model, data, loss and evaluation. The engine owns the loop."""

    #: eval metric that picks checkpoints/best unless train.best_metric overrides it
    best_metric: str = "eval_loss"
    best_mode: str = "min"

    def __init__(self, cfg: Config, out_dir: Path, ctx: RunContext) -> None:
        self.cfg = cfg
        self.out_dir = out_dir
        self.ctx = ctx

    def prepare(self) -> None:
        """One-time work before the model is built (e.g. train or load a tokenizer)."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """The trainable module (everything the optimizer updates, incl. loss parameters)."""

    @abstractmethod
    def train_dataset(self) -> Dataset:
        """Dataset indexed by SampleKey (epoch, batch_in_epoch, index)."""

    @abstractmethod
    def train_sampler(self, dataset: Dataset, start: tuple[int, int]) -> BatchSampler:
        """This rank's batch sampler, starting at (epoch, batch_in_epoch)."""

    @abstractmethod
    def collate(self, samples: list[dict]) -> dict[str, Any]:
        """Turn good samples into a batch of tensors."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict]:
        """Forward pass: the scalar loss to backpropagate and metrics to log."""

    @abstractmethod
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Metrics on `split` ('val' or 'test'); called on every rank, sharded internally."""

    def backward(
        self, model: nn.Module, batch: dict[str, Any], scale: float
    ) -> tuple[torch.Tensor, dict]:
        """Compute the loss and backpropagate `loss * scale`. Stages may override (GradCache)."""
        loss, metrics = self.loss(model, batch)
        (loss * scale).backward()
        return loss.detach(), metrics

    def checkpoint_files(self) -> dict[str, Path]:
        """Files copied into every checkpoint (e.g. the tokenizer)."""
        return {}

    def export(self, model: nn.Module, folder: Path) -> None:
        """Write extra artifacts into a checkpoint folder being saved (e.g. HF save_pretrained)."""

    def state_dict(self) -> dict[str, Any]:
        """Extra stage state to save with the trainer state (tensors, numbers, strings)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of state_dict."""


STAGES: dict[str, type[Stage]] = {}


def register_stage(name: str):
    """Class decorator adding a stage to the registry under `name`."""

    def deco(cls: type[Stage]) -> type[Stage]:
        STAGES[name] = cls
        return cls

    return deco


def get_stage(name: str) -> type[Stage]:
    """The stage class for a registry key (importing the built-in stages on first use)."""
    import vltrain.stages.caption  # noqa: F401  (registers itself)
    import vltrain.stages.contrastive  # noqa: F401  (registers itself)
    import vltrain.stages.rl  # noqa: F401  (registers itself)

    if name not in STAGES:
        raise KeyError(f"unknown stage '{name}'; known: {sorted(STAGES)}")
    return STAGES[name]


def resolve_init(init_from: str) -> Path | None:
    """`model.init_from` as a checkpoint folder (best, else newest); None when it is unset."""
    from vltrain.config.core import ConfigError
    from vltrain.engine.checkpoint import resolve_checkpoint

    try:
        return resolve_checkpoint(init_from) if init_from else None
    except FileNotFoundError as e:
        raise ConfigError(f"model.init_from: {e}") from None


def copy_init_tokenizer(init_ckpt: Path, tok_dir: Path) -> None:
    """Reuse the tokenizer saved with `init_ckpt`: token ids must match the weights."""
    import shutil

    from vltrain.config.core import ConfigError

    src = init_ckpt / "tokenizer"
    if not (src / "tokenizer.json").is_file():
        raise ConfigError(f"model.init_from: {init_ckpt} holds no tokenizer/")
    shutil.copytree(src, tok_dir)
