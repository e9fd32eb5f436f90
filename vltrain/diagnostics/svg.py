"""A tiny inline-SVG plotter for the run report (no JS, no network, no plotting library)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
SEVERITY_COLORS = {"info": "#7f7f7f", "warn": "#ff9f1c", "error": "#d62728"}


@dataclass
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    kind: str = "line"  # line | points
    color: str = ""
    width: float = 1.6
    opacity: float = 1.0


@dataclass
class Marker:
    """A vertical mark at `x` (a doctor finding on a curve)."""

    x: float
    label: str
    color: str = SEVERITY_COLORS["warn"]


@dataclass
class Plot:
    title: str
    series: list[Series] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    xlabel: str = "step"
    log_y: bool = False


def ema(ys: Sequence[float], alpha: float = 0.1) -> list[float]:
    """Exponential moving average (non-finite values are carried over, not mixed in)."""
    out, m = [], None
    for y in ys:
        if math.isfinite(y):
            m = y if m is None else (1 - alpha) * m + alpha * y
        out.append(m if m is not None else float("nan"))
    return out


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    return [start + i * step for i in range(int((hi - start) / step) + 1)]


def _fmt(v: float, step: float = 0.0, scale: float | None = None) -> str:
    """A tick label with as many decimals as the tick spacing needs; `scale` (the axis's
    largest |tick|) picks one notation for the whole axis, not 0.00100 beside 8.00e-04."""
    scale = abs(v) if scale is None else scale
    if scale >= 1e4 or (0 < scale < 1e-3):
        return f"{v:.2e}"
    if step > 0:
        return f"{v:.{max(0, 1 - math.floor(math.log10(step)))}f}"
    return f"{v:.3g}"


LEGEND_ROW = 14  # px per legend row, below the plot area
CHAR_W = 6.0  # rough width of one 10-px sans-serif character, to lay legend entries out


def legend_rows(labels: Sequence[str], width: float) -> list[list[tuple[int, float]]]:
    """Legend entries laid out left to right in rows of at most `width` px: per row, (series
    index, x offset) pairs. Each entry is a 14-px swatch, a gap and its label."""
    rows: list[list[tuple[int, float]]] = [[]]
    x = 0.0
    for i, label in enumerate(labels):
        w = 18 + CHAR_W * len(label) + 14
        if rows[-1] and x + w > width:
            rows.append([])
            x = 0.0
        rows[-1].append((i, x))
        x += w
    return rows if rows[0] else []


def render(plot: Plot, width: int = 590, height: int = 240) -> str:
    """The plot as an `<svg>` element (class "plot"), or a note when it has no finite data.
    The legend sits below the x axis, never on the curves; `height` is the plot's own,
    legend rows add to it."""
    tf = (lambda y: math.log10(y) if y > 0 else float("nan")) if plot.log_y else (lambda y: y)
    pts = [
        (x, tf(y))
        for s in plot.series
        for x, y in zip(s.xs, s.ys, strict=True)
        if math.isfinite(x) and math.isfinite(y)
    ]
    pts = [(x, y) for x, y in pts if math.isfinite(y)]
    if not pts:
        return f'<p class="empty">{escape(plot.title)}: no data</p>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5 * (abs(y0) or 1), y1 + 0.5 * (abs(y1) or 1)
    pad = 0.05 * (y1 - y0)
    y0, y1 = y0 - pad, y1 + pad
    left, right, top, bottom = 56, 12, 24, 34
    pw, ph = width - left - right, height - top - bottom
    legend = legend_rows([s.label for s in plot.series], pw)
    total = height + LEGEND_ROW * len(legend)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [
        f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total}" '
        f'viewBox="0 0 {width} {total}" role="img" aria-label="{escape(plot.title)}">',
        f'<rect x="0" y="0" width="{width}" height="{total}" fill="#ffffff"/>',
        f'<text x="{left}" y="15" font-size="13" font-weight="bold">{escape(plot.title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    yt = _ticks(y0, y1)
    ystep = yt[1] - yt[0] if len(yt) > 1 else 0.0
    yscale = max(abs(t) for t in yt)
    for t in yt:
        label = _fmt(10**t) if plot.log_y else _fmt(t, ystep, yscale)
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" stroke="#eee"/>'
            f'<text x="{left - 4}" y="{sy(t) + 4:.1f}" font-size="10" text-anchor="end">'
            f"{label}</text>"
        )
    for t in _ticks(x0, x1):
        out.append(
            f'<text x="{sx(t):.1f}" y="{top + ph + 14}" font-size="10" text-anchor="middle">'
            f"{_fmt(t)}</text>"
        )
    out.append(
        f'<text x="{left + pw / 2}" y="{height - 4}" font-size="10" text-anchor="middle">'
        f"{escape(plot.xlabel)}</text>"
    )
    for m in plot.markers:
        if x0 <= m.x <= x1:
            out.append(
                f'<line x1="{sx(m.x):.1f}" x2="{sx(m.x):.1f}" y1="{top}" y2="{top + ph}" '
                f'stroke="{m.color}" stroke-dasharray="3,2"><title>{escape(m.label)}</title></line>'
            )
    colors = [s.color or PALETTE[i % len(PALETTE)] for i, s in enumerate(plot.series)]
    for s, color in zip(plot.series, colors, strict=True):
        xy = [
            (sx(x), sy(tf(y)))
            for x, y in zip(s.xs, s.ys, strict=True)
            if math.isfinite(x) and math.isfinite(y) and math.isfinite(tf(y))
        ]
        if s.kind == "points" or len(xy) == 1:
            out += [
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}" '
                f'fill-opacity="{s.opacity}"/>'
                for x, y in xy
            ]
        elif xy:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{color}" '
                f'stroke-width="{s.width}" stroke-opacity="{s.opacity}"/>'
            )
    for row, entries in enumerate(legend):
        y = height + 10 + LEGEND_ROW * row  # baselines below the x-axis label
        for i, x in entries:
            s, color, x = plot.series[i], colors[i], left + x
            swatch = (
                f'<circle cx="{x + 7}" cy="{y - 3}" r="2.5" fill="{color}"/>'
                if s.kind == "points"
                else f'<line x1="{x}" x2="{x + 14}" y1="{y - 3}" y2="{y - 3}" stroke="{color}" '
                f'stroke-width="2"/>'
            )
            out.append(
                swatch + f'<text x="{x + 18}" y="{y}" font-size="10" fill="#333">'
                f"{escape(s.label)}</text>"
            )
    out.append("</svg>")
    return "".join(out)
