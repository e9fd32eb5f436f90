"""The report's SVG plots: legends sit below the plot area, never on the curves."""

from __future__ import annotations

import re

from vltrain.diagnostics import svg

HEIGHT, BOTTOM = 240, 34  # render's default height and the margin under the plot area


def _text_y(page: str, label: str) -> float:
    found = re.findall(rf'<text x="[^"]+" y="([^"]+)"[^>]*>{re.escape(label)}</text>', page)
    assert len(found) == 1, (label, found)  # the label is drawn once: the search is not vacuous
    return float(found[0])


def test_legend_rows_sit_below_the_plot_area_and_grow_the_image() -> None:
    labels = [f"eval_metric_with_a_long_name_{i}" for i in range(6)]
    xs = list(range(10))
    plot = svg.Plot("eval", [svg.Series(n, xs, [i + x for x in xs]) for i, n in enumerate(labels)])
    page = svg.render(plot)
    rows = svg.legend_rows(labels, 590 - 56 - 12)
    assert len(rows) >= 2 and sum(len(r) for r in rows) == len(labels)  # wraps, drops nothing
    for label in labels:
        assert _text_y(page, label) > HEIGHT - BOTTOM + 20  # under the x tick labels
    assert f'height="{HEIGHT + svg.LEGEND_ROW * len(rows)}"' in page
    assert _text_y(page, "eval") < 20  # the title stays on top


def test_a_plot_without_series_has_no_legend_rows() -> None:
    assert svg.legend_rows([], 500) == []
    assert svg.legend_rows(["a"], 500) == [[(0, 0.0)]]
