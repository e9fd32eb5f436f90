"""The curate run: decide every record, write OUT, OUT.removed.jsonl and the report."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from vltrain.curation import report, semantic
from vltrain.curation.features import iter_features
from vltrain.curation.filters import caption_problem, clip_score_keep, image_problem
from vltrain.curation.minhash import optimal_params, s_curve
from vltrain.curation.pipeline import (
    CurateOptions,
    Decider,
    Decision,
    Embedder,
    EvalSets,
    _items,
    iter_lines,
    settings,
)
from vltrain.data.readers import DataError


def removed_path(out: Path) -> Path:
    """OUT.removed.jsonl beside OUT (out.jsonl -> out.removed.jsonl)."""
    return out.with_name(out.stem + ".removed" + out.suffix)


def _check_paths(inp: Path, out: Path, against: list[Path], report_dir: Path | None) -> None:
    """Every path checked before anything is written (a --report that cannot be a folder
    failed after the curated file was written)."""
    for p in (inp, *against):
        if p.is_dir():
            raise DataError(f"{p} is a folder; curate reads a JSONL records file")
        if not p.is_file():
            raise DataError(f"data file {p} does not exist")
        if p.suffix.lower() != ".jsonl":
            raise DataError(
                f'{p}: curate reads JSONL records (one {{"image", "text"}} object a line), '
                f"not {p.suffix or 'this'} files"
            )
    if out.resolve() == inp.resolve():
        raise DataError(f"--out {out} is the input file; write to another file")
    if any(a.resolve() == inp.resolve() for a in against):
        raise DataError(f"--against {inp} is the input file: every record would leak")
    if report_dir is not None:
        taken = next((q for q in (report_dir, *report_dir.parents) if q.exists()), None)
        if taken is not None and not taken.is_dir():
            raise DataError(f"--report {report_dir}: {taken} is a file, not a folder")


def _clip_decisions(
    path: Path, opts: CurateOptions, embedder: Embedder | None
) -> tuple[dict[int, Decision], torch.Tensor | None, torch.Tensor | None]:
    """CLIP-score removals and the image embeddings (for semantic dedup), when an embedder is
    given; records it could not embed are neither removed here nor deduplicated semantically."""
    if embedder is None:
        return {}, None, None
    img, txt, valid = embedder.embed(path)
    scores = (img * txt).sum(1)  # (N,) cosine: both unit-norm
    out: dict[int, Decision] = {}
    if "filter" in opts.steps and (opts.clip_threshold, opts.clip_top_fraction) != (None, None):
        idx = valid.nonzero().flatten()
        keep = clip_score_keep(scores[idx].tolist(), opts.clip_threshold, opts.clip_top_fraction)
        for i, k in zip(idx.tolist(), keep.tolist(), strict=True):
            if not k:
                out[i] = Decision("clip_score_low", None, float(scores[i]))
    return out, img, valid


def decide(
    inp: Path, against: list[Path], opts: CurateOptions, embedder: Embedder | None
) -> tuple[list[Decision], dict[str, Any]]:
    """One decision per record (input order) and facts for the report."""
    opts.check()
    bands, rows = optimal_params(opts.caption_threshold, opts.num_perm)
    info: dict[str, Any] = {"lsh": {"bands": bands, "rows": rows, "s_curve": s_curve(bands, rows)}}
    evals = EvalSets(against, opts, bands, rows) if against and "decontam" in opts.steps else None
    if evals is not None:
        b = evals.bloom
        info["bloom"] = {
            "ngrams": len(evals.grams),
            "n_bits": b.n_bits,
            "n_hashes": b.n_hashes,
            "configured_fp_rate": opts.bloom_fp_rate,
            "expected_fp_rate": b.expected_fp_rate(),
            "measured_fp_rate": evals.measured_fp_rate(),
        }
    clip, img_emb, valid = _clip_decisions(inp, opts, embedder)
    dedup = Decider(opts, bands, rows)
    decisions: list[Decision] = []
    feats = iter_features(
        _items(inp), settings(inp, opts, evals.bloom if evals else None), opts.workers
    )
    for f in feats:
        d = _decide_one(f, opts, clip, evals, dedup)
        if d.reason is None:
            dedup.insert(f)
        decisions.append(d)
    if img_emb is not None and "dedup" in opts.steps:
        _semantic(decisions, img_emb, valid, opts)
    return decisions, info


def _decide_one(f, opts: CurateOptions, clip, evals: EvalSets | None, dedup: Decider) -> Decision:
    if f.bad is not None:
        return Decision(f"bad_image_{f.bad}")
    if "filter" in opts.steps:
        why = (
            caption_problem(f.first_caption, opts.caption_rules)
            if f.first_caption
            else "caption_short"
        )
        why = why or (
            image_problem(f.image.width, f.image.height, opts.image_rules) if f.image else None
        )
        if why:
            return Decision(why)
        if f.index in clip:
            return clip[f.index]
    if evals is not None:
        d = evals.match(f)
        if d.reason is not None:
            return d
    if "dedup" in opts.steps:
        return dedup.match(f)
    return Decision()


def _semantic(
    decisions: list[Decision], emb: torch.Tensor, valid: torch.Tensor, opts: CurateOptions
) -> None:
    """Semantic duplicates among kept records; witnesses of earlier removals stay kept."""
    alive = [i for i, d in enumerate(decisions) if d.reason is None and bool(valid[i])]
    if len(alive) < 2:
        return
    witnesses = {
        d.witness
        for d in decisions
        if d.reason and d.witness is not None and d.witness_source == "train"
    }
    pinned = torch.tensor([i in witnesses for i in alive])
    for r in semantic.witness_dedup(emb[alive], opts.semantic_eps, pinned=pinned, seed=opts.seed):
        decisions[alive[r.index]] = Decision("dup_semantic", alive[r.witness], r.score)


def write_outputs(
    inp: Path, out: Path, decisions: list[Decision], ids: list[str], eval_ids: list[str]
) -> None:
    """Kept lines byte for byte to `out` (images copied when the folder differs), removed ones
    with reason and witness to OUT.removed.jsonl."""
    out.parent.mkdir(parents=True, exist_ok=True)
    copy_images = out.parent.resolve() != inp.parent.resolve()
    tmp, tmp_rm = Path(f"{out}.tmp"), Path(f"{removed_path(out)}.tmp")
    with open(tmp, "wb") as fo, open(tmp_rm, "w", encoding="utf-8", errors="surrogateescape") as fr:
        for index, raw, rec in iter_lines(inp):
            d = decisions[index]
            if d.reason is None:
                fo.write(raw if raw.endswith(b"\n") else raw + b"\n")
                if copy_images:
                    _copy_image(inp.parent, out.parent, rec["image"])
                continue
            src = eval_ids if d.witness_source == "eval" else ids
            row = {
                "reason": d.reason,
                "duplicate_of": src[d.witness] if d.witness is not None else None,
                "duplicate_source": d.witness_source if d.witness is not None else None,
                # 6 decimals: the last bits of a float similarity differ between CPU types
                "similarity": None if d.similarity is None else round(d.similarity, 6),
                "detail": d.detail,
                "record": json.loads(raw.decode("utf-8-sig", "surrogateescape")),
            }
            fr.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    os.replace(tmp_rm, removed_path(out))


def _copy_image(src_root: Path, dst_root: Path, rel: str) -> None:
    src, dst = src_root / rel, dst_root / rel
    if src.is_file() and not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def curate(
    inp: str | Path,
    out: str | Path,
    against: list[str | Path] | None = None,
    opts: CurateOptions | None = None,
    embedder: Embedder | None = None,
    report_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Run the curate steps of `opts` over `inp`, write `out`, and return the summary."""
    inp, out = Path(inp), Path(out)
    against_p = [Path(a) for a in against or []]
    opts = opts or CurateOptions()
    _check_paths(inp, out, against_p, Path(report_dir) if report_dir is not None else None)
    t0 = time.perf_counter()
    decisions, info = decide(inp, against_p, opts, embedder)
    ids = [rec["id"] for _, _, rec in iter_lines(inp)]
    eval_ids = [f"{p.name}:{rec['id']}" for p in against_p for _, _, rec in iter_lines(p)]
    write_outputs(inp, out, decisions, ids, eval_ids)
    summary = report.summarize(
        inp, out, decisions, ids, eval_ids, opts, info, time.perf_counter() - t0
    )
    if report_dir is not None:
        report.write(Path(report_dir), summary)
    return summary
