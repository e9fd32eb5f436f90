"""``F.linear`` on weights pre-packed by MKL, for row counts that recur (CPU, float32).

MKL's fp32 GEMM re-packs the weight matrix on every call; at the 2-33 rows of a speculative
round that packing costs as much as the product. Pre-packed weights (``torch.ops.mkl``'s
``_mkl_reorder_linear_weight`` / ``_mkl_linear``, what inductor's CPU freezing uses) skip it:
SmolLM2-135M's 211 linears on a 2-core Xeon take 41 instead of 51 ms at 17 rows and 35
instead of 45 at 8; a block drafter's 16,384-row head at 7 rows 2.3 instead of 3.5 ms. A
packing holds one row count; ``x`` with another count falls back to ``F.linear``.

Numerics: from 16 rows on, the packed product equals ``F.linear`` bit for bit (MKL packs the
same way internally); below 16 it differs by float rounding (~1e-5 on logits of magnitude
~30), as ``F.linear`` itself does between 1 and 8 rows. Elsewhere (no MKL, GPU, other
dtypes, autograd) this is plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def can_pack(weight: Tensor) -> bool:
    """Whether MKL packing applies: a float32 CPU weight outside autograd, MKL present."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and not (weight.requires_grad and torch.is_grad_enabled())
        and torch.backends.mkl.is_available()
    )


class PackedLinears:
    """Packed copies of weights, per row count; the ``keep`` latest row counts are kept.

    Each row count holds a full copy of the weights it has seen (memory!): keep it small.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._packs: dict[int, dict[int, tuple[Tensor, int, Tensor]]] = {}

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        """``F.linear(x, weight, bias)`` through a packed copy of ``weight`` for x's rows."""
        rows = x.numel() // max(x.shape[-1], 1)
        if rows < 2 or not can_pack(weight):
            return F.linear(x, weight, bias)
        pack = self._packs.get(rows)
        if pack is None:
            if len(self._packs) >= self.keep:
                self._packs.pop(next(iter(self._packs)))  # the oldest row count
            pack = self._packs[rows] = {}
        entry = pack.get(id(weight))
        # a new tensor may reuse a freed id; an in-place update (copy_, an optimizer step)
        # bumps the version: either way the packed copy is out of date
        if entry is None or entry[0] is not weight or entry[1] != weight._version:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows)
            entry = pack[id(weight)] = (weight, weight._version, packed)
        x = x.contiguous()
        return torch.ops.mkl._mkl_linear(x, entry[2], weight.detach(), bias, rows)

    def clear(self) -> None:
        self._packs.clear()
