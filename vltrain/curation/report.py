"""The curate report: counts by step and reason, example pairs, summary.json and report.html."""

from __future__ import annotations

import html
import json
import os
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

_STEP_OF = {"bad": "decode", "caption": "filter", "image": "filter", "clip": "filter",
            "leak": "decontam", "dup": "dedup"}  # fmt: skip
_EXAMPLES = 5


def step_of(reason: str) -> str:
    """The step that owns a removal reason ('dup_near_image' -> 'dedup')."""
    return _STEP_OF[reason.split("_", 1)[0]]


def summarize(inp, out, decisions, ids, eval_ids, opts, info, seconds) -> dict[str, Any]:
    """The summary dict written to summary.json (and returned by `curate`)."""
    reasons = Counter(d.reason for d in decisions if d.reason)
    by_step = Counter()
    for r, n in reasons.items():
        by_step[step_of(r)] += n
    examples: dict[str, list[dict[str, Any]]] = {}
    for i, d in enumerate(decisions):
        if d.reason and len(examples.setdefault(d.reason, [])) < _EXAMPLES:
            src = eval_ids if d.witness_source == "eval" else ids
            examples[d.reason].append({
                "record": ids[i], "duplicate_of": src[d.witness] if d.witness is not None else None,
                "source": d.witness_source, "similarity": d.similarity, "detail": d.detail,
            })  # fmt: skip
    o = asdict(opts)
    return {
        "input": str(inp), "output": str(out), "records": len(decisions),
        "kept": len(decisions) - sum(reasons.values()), "removed": sum(reasons.values()),
        "removed_by_step": dict(sorted(by_step.items())),
        "removed_by_reason": dict(sorted(reasons.items())),
        "examples": examples, "options": o, "seconds": round(seconds, 3), **info,
    }  # fmt: skip


def write(folder: Path, summary: dict[str, Any]) -> None:
    """summary.json and a self-contained report.html in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, folder / "summary.json")
    (folder / "report.html").write_text(render_html(summary), encoding="utf-8")


def render_html(summary: dict[str, Any]) -> str:
    """A plain HTML page: totals, per-reason counts, example pairs, LSH and Bloom facts."""
    e = html.escape
    rows = "".join(f"<tr><td>{e(r)}</td><td>{e(step_of(r))}</td><td>{n}</td></tr>"
                   for r, n in summary["removed_by_reason"].items())  # fmt: skip
    ex = []
    for reason, items in summary["examples"].items():
        for it in items:
            sim = "" if it["similarity"] is None else f"{it['similarity']:.3f}"
            ex.append(f"<tr><td>{e(reason)}</td><td>{e(str(it['record']))}</td>"
                      f"<td>{e(str(it['duplicate_of']))} ({e(it['source'])})</td><td>{sim}</td>"
                      f"<td>{e(str(it['detail'] or ''))}</td></tr>")  # fmt: skip
    facts = {k: summary[k] for k in ("lsh", "bloom") if k in summary}
    return (
        "<!doctype html><meta charset='utf-8'><title>vltrain curate report</title>"
        f"<h1>Curation of {e(summary['input'])}</h1>"
        f"<p>{summary['records']} records: {summary['kept']} kept, {summary['removed']} removed "
        f"in {summary['seconds']} s. Output: {e(summary['output'])}</p>"
        "<h2>Removed by reason</h2><table border=1><tr><th>reason</th><th>step</th><th>n</th></tr>"
        f"{rows}</table><h2>Examples</h2><table border=1><tr><th>reason</th><th>record</th>"
        f"<th>duplicate of</th><th>similarity</th><th>detail</th></tr>{''.join(ex)}</table>"
        f"<h2>Index facts</h2><pre>{e(json.dumps(facts, indent=2))}</pre>"
    )
