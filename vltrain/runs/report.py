"""The one writer of run-summary tables (markdown), used by pipelines, the quickstart and tune."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def cell(value: Any, scale: float = 1.0, spec: str = ".4f") -> str:
    """One table cell: '-' for missing, numbers scaled and formatted with `spec`, everything
    else as text."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) and scale == 1.0:
        return str(value)
    x = float(value) * scale
    return format(x, spec) if math.isfinite(x) else str(x)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; cells that are not strings go through :func:`cell`."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        texts = [c if isinstance(c, str) else cell(c) for c in row]
        if len(texts) != len(header):
            raise ValueError(f"row has {len(texts)} cells for {len(header)} columns: {texts}")
        lines.append("| " + " | ".join(texts) + " |")
    return "\n".join(lines)
