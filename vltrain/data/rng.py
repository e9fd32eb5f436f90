"""Per-sample randomness derived from (seed, epoch, index), never from world size or worker id."""

from __future__ import annotations

import hashlib

import torch


def sample_seed(seed: int, epoch: int, index: int, salt: str = "") -> int:
    """A 63-bit seed that depends only on its arguments (stable across processes and runs)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}/{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_generator(seed: int, epoch: int, index: int, salt: str = "") -> torch.Generator:
    """A torch.Generator for one sample's randomness (caption choice, negatives, augmentation)."""
    g = torch.Generator()
    g.manual_seed(sample_seed(seed, epoch, index, salt))
    return g
