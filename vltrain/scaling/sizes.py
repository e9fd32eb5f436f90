"""The family of model sizes a sweep trains: a target non-embedding parameter count -> a
(depth, width) pair by one documented rule.

Rule: among depths 1..16 and widths that are multiples of 16 (32..2048) whose aspect ratio
width / depth lies in [32, 128], pick the pair whose non-embedding parameter count
12 * L * W^2 (+ the connector, fixed per family) is closest to the target in log space; ties
go to the aspect ratio closest to 64 (Kaplan et al. found loss flat across aspect ratios
~20-200, so one ratio band keeps the family one shape). Explicit `LxW` specs bypass the rule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from vltrain.config.core import ConfigError


@dataclass(frozen=True)
class Size:
    """One member of the family."""

    layers: int
    width: int

    @property
    def label(self) -> str:
        return f"{self.layers}x{self.width}"

    @property
    def block_params(self) -> int:
        """Non-embedding parameters of the transformer blocks (weights; biases and norms
        add ~13 W per layer)."""
        return self.layers * (12 * self.width**2 + 13 * self.width)


def size_for_params(target: float, aspect: float = 64.0) -> Size:
    """The (layers, width) the rule picks for `target` non-embedding block parameters."""
    if target <= 0:
        raise ConfigError(f"a model size must be positive, got {target}")
    best: tuple[float, float, Size] | None = None
    for layers in range(1, 17):
        for width in range(32, 2049, 16):
            if not 32 <= width / layers <= 128:
                continue
            s = Size(layers, width)
            key = (abs(math.log(s.block_params / target)), abs(math.log(width / layers / aspect)))
            if best is None or key < best[:2]:
                best = (*key, s)
    assert best is not None
    return best[2]


def width_for_params(target: float, layers: int) -> Size:
    """The width (a multiple of 16, at least 16) whose `layers`-deep blocks come nearest
    `target` parameters in log space: a prediction inside a fixed-depth sweep's family."""
    if target <= 0:
        raise ConfigError(f"a model size must be positive, got {target}")
    sizes = [Size(layers, w) for w in range(16, 8193, 16)]
    return min(sizes, key=lambda s: abs(math.log(s.block_params / target)))


_SPEC = re.compile(r"^(\d+)x(\d+)$")
_COUNT = re.compile(r"^(\d+(?:\.\d+)?)([kKmM]?)$")


def parse_size(spec: str) -> Size:
    """`LxW` (explicit), or a parameter count like `200k`, `1.5M`, `80000` (by the rule)."""
    spec = spec.strip()
    m = _SPEC.match(spec)
    if m:
        layers, width = int(m.group(1)), int(m.group(2))
        if layers < 1 or width < 4 or width % 4:
            raise ConfigError(f"size {spec!r}: need layers >= 1 and a width divisible by 4")
        return Size(layers, width)
    m = _COUNT.match(spec)
    if not m:
        raise ConfigError(
            f"size {spec!r} is neither LAYERSxWIDTH (e.g. 2x128) nor a parameter count "
            "(e.g. 200k, 1.5M)"
        )
    scale = {"": 1, "k": 1e3, "m": 1e6}[m.group(2).lower()]
    return size_for_params(float(m.group(1)) * scale)


def parse_sizes(specs: list[str]) -> list[Size]:
    sizes = [parse_size(s) for spec in specs for s in spec.split(",") if s.strip()]
    if len(set(sizes)) != len(sizes):
        dup = sorted({s.label for s in sizes if sizes.count(s) > 1})
        raise ConfigError(f"--sizes maps two entries to the same model {dup}; space them out")
    return sorted(sizes, key=lambda s: s.block_params)
