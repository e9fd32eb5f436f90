"""Process setup: device, seeds, determinism, precision contexts, DataLoader workers."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.core import distributed


@dataclass
class RunContext:
    """Where this process runs: passed to stages so they never ask torch.distributed."""

    device: torch.device
    rank: int
    world_size: int
    precision: str
    seed: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 or fp16 autocast when configured (CPU and CUDA), else a no-op."""
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        if dtype is not None:
            return torch.autocast(device_type=self.device.type, dtype=dtype)
        return contextlib.nullcontext()


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels. On GPU this disables cuDNN autotuning and TF32 (slower)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def resolve_device(want: str, name: str = "run.device") -> torch.device:
    """This process's device for `want` (auto | cpu | cuda | cuda:N): auto is cuda when CUDA is
    visible, else cpu; plain cuda is cuda:LOCAL_RANK (torchrun's local rank). `name` is the
    setting named in the error when CUDA is asked for and absent."""
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"{name}={want} but no CUDA device is visible to this process; use "
            f"{name}=cpu (or auto), or check CUDA_VISIBLE_DEVICES and the torch build"
        )
    return torch.device("cuda", distributed.local_rank()) if want == "cuda" else torch.device(want)


def setup(cfg: Config) -> RunContext:
    """Pick the device, join the process group, seed and configure this process."""
    device = resolve_device(cfg.run.device)
    distributed.init_from_env(device.type)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    set_deterministic(cfg.run.deterministic)
    return RunContext(
        device=device,
        rank=distributed.rank(),
        world_size=distributed.world_size(),
        precision=cfg.run.precision,
        seed=cfg.run.seed,
    )


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """no_grad + eval(), restoring train mode and leaving the training RNG stream untouched."""
    was_training = model.training
    model.eval()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        try:
            yield
        finally:
            model.train(was_training)
