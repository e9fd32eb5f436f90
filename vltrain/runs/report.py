"""The one writer of run-summary tables (markdown and HTML), used by pipelines, the quickstart,
tune and the HTML run report."""

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


def html_table(
    header: Sequence[str], rows: Iterable[Sequence[Any]], highlight: Iterable[int] = ()
) -> str:
    """The same table as HTML (cells escaped; rows whose index is in `highlight` get
    class "best")."""
    from html import escape

    marked = set(highlight)
    out = ["<table>", "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        texts = [c if isinstance(c, str) else cell(c) for c in row]
        if len(texts) != len(header):
            raise ValueError(f"row has {len(texts)} cells for {len(header)} columns: {texts}")
        cls = ' class="best"' if i in marked else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{escape(t)}</td>" for t in texts) + "</tr>")
    out.append("</table>")
    return "\n".join(out)
