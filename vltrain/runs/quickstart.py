"""`vltrain quickstart`: synthetic data -> CLIP -> caption pretrain -> finetune -> RL -> report.

Every stage trains a real (tiny) model on the synthetic shapes data, in minutes on a laptop CPU.
The chain itself is the pipeline configs/quickstart_pipeline.yaml; this module writes the data,
turns the command-line flags into per-stage overrides, and prints the tables.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from vltrain.config.core import preset_dir
from vltrain.runs.pipeline import PipelineStage, run_pipeline
from vltrain.runs.report import cell, markdown_table
from vltrain.runs.run_report import write_report

CONFIGS = preset_dir()
PRESET = CONFIGS / "quickstart.yaml"
PIPELINE = CONFIGS / "quickstart_pipeline.yaml"
#: pipeline stage -> the name its row has in the all-stages table
STAGE_NAMES = {
    "clip": "CLIP (contrastive)",
    "caption_pretrain": "caption pretrain",
    "caption_finetune": "caption finetune",
    "caption_rl": "caption RL",
}

#: `--size` -> the towers every stage uses (the captioner loads the CLIP run's image tower)
SIZES = {
    "tiny": {"vision": "tiny_cnn", "text": "tiny"},  # the CNN tower learns the shapes fastest
    "tiny_vit": {"vision": "tiny", "text": "tiny"},
    "small": {"vision": "small", "text": "small"},
}
#: `--size` -> extra CLIP-stage overrides: quickstart.yaml's single text block is the tiny_cnn
#: recipe; the other sizes keep their text preset's depth
SIZE_CLIP = {"tiny": [], "tiny_vit": ["model.text_layers=0"], "small": ["model.text_layers=0"]}

#: every stage keeps its decoded training images in memory (later epochs skip PNG decoding)
IMAGE_CACHE_MB = 256

ROWS = (
    ("image->text R@1", "i2t_R@1"),
    ("image->text R@5", "i2t_R@5"),
    ("text->image R@1", "t2i_R@1"),
    ("text->image R@5", "t2i_R@5"),
    ("hard-negative acc", "hardneg_acc"),
)


def _ensure_data(data_dir: Path, n_train: int, n_eval: int, seed: int, total: int) -> None:
    from vltrain.data.synth import synth_command

    stamp = data_dir / "quickstart.json"
    want = {"n_train": n_train, "n_val": n_eval, "n_test": n_eval, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        print(f"[1/{total}] synthetic data already in {data_dir}")
        return
    t = time.time()
    # its own folder; two processes render the same files as one, in half the time
    synth_command(str(data_dir), n_train, n_eval, n_eval, seed, force=True, workers=2)
    stamp.write_text(json.dumps(want))
    print(f"[1/{total}] wrote synthetic shapes data to {data_dir} ({time.time() - t:.1f} s)")


def results_table(summary: dict[str, Any]) -> str:
    """Markdown table of val/test retrieval and hard-negative accuracy, with chance levels and
    the best R@1 a perfect model could expect (`vltrain.eval.ceiling`: images whose captions
    mean the same thing are indistinguishable)."""
    val, test = summary.get("val", {}), summary.get("test", {})
    n_val = val.get("eval_n_images", 0) or 1
    rows = []
    kinds = sorted(k[len("eval_hardneg_acc_") :] for k in val if k.startswith("eval_hardneg_acc_"))
    names = [*ROWS, *((f"  {k} swaps", f"hardneg_acc_{k}") for k in kinds)]
    for name, key in names:
        k = 5 if key.endswith("5") else 1
        chance = 0.5 if key.startswith("hardneg_acc") else min(1.0, k / n_val)
        ceiling = key.endswith("R@1")
        values = (
            val.get(f"eval_{key}"),
            val.get(f"eval_{key}_ceiling") if ceiling else None,
            test.get(key),
            test.get(f"{key}_ceiling") if ceiling else None,
            chance,
        )
        rows.append([name, *(cell(x, 100, ".1f") for x in values)])
    head = ["metric", "val", "val ceiling", "test (unseen combos)", "test ceiling", "chance (val)"]
    return markdown_table(head, rows)


def default_workers() -> int:
    """Loader processes for the quickstart: on 2 cores a worker competes with the 2 training
    threads (200 CLIP steps 6% and 15% slower with 1 worker than with 0 in two A/B pairs on
    an AMD EPYC; images are decoded once and cached, so the main process loads a batch in
    ~35 ms); with more cores a worker overlaps loading with compute."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 0 if (cores or 1) <= 2 else 1


def stage_overrides(
    size: str,
    steps: int,
    batch_size: int,
    caption_steps: int,
    rl_steps: int,
    extra: list[str],
    caption_extra: list[str],
) -> dict[str, list[str]]:
    """The quickstart's flags as per-stage overrides of configs/quickstart_pipeline.yaml."""
    sizes = [f"model.{tower}={preset}" for tower, preset in SIZES[size].items()]
    pre_steps, fine_steps = caption_steps * 2 // 3, caption_steps - caption_steps * 2 // 3

    def budget(n: int, warmup: int, every: int) -> list[str]:
        return [
            f"train.max_steps={n}",
            f"train.eval_every={every}",
            f"train.save_every={every}",
            f"optim.warmup_steps={min(warmup, n // 5)}",
        ]

    return {
        "clip": [
            *sizes,
            *SIZE_CLIP[size],
            # three evaluations, the last at the end (not 2 steps before it: 166, 332, 498, 500)
            *budget(steps, 50, max(-(-steps // 3), 1)),
            f"data.batch_size={batch_size}",
            *extra,
        ],
        "caption_pretrain": [*budget(pre_steps, 50, pre_steps), *sizes, *caption_extra],
        "caption_finetune": [*budget(fine_steps, 20, fine_steps), *sizes, *caption_extra],
        "caption_rl": [*sizes, *budget(rl_steps, 10, rl_steps), *caption_extra],
    }


def run_quickstart(
    out: str = "runs/quickstart",
    size: str = "tiny",
    steps: int = 700,
    n_train: int = 12000,
    n_eval: int = 300,
    batch_size: int = 128,
    num_workers: int | None = None,
    extra: list[str] | None = None,
    caption_steps: int = 300,
    caption_extra: list[str] | None = None,
    rl_steps: int = 50,
) -> dict[str, Any]:
    """Run the whole demo; returns {"clip": summary, "caption": metrics, "stages": rows}.

    caption_steps=0 skips the captioner (and RL); rl_steps=0 skips RL. `stages` holds one row
    per trained stage (name, steps, seconds, test metrics) and is what `report.md` tabulates.
    """
    root = Path(out)
    data = root / "data"
    t0 = time.time()
    rl_steps = rl_steps if caption_steps else 0
    if num_workers is None:
        num_workers = default_workers()
    only = ["clip"] + (["caption_pretrain", "caption_finetune"] if caption_steps else [])
    only += ["caption_rl"] if rl_steps else []
    total = 2 + len(only)
    _ensure_data(data, n_train, n_eval, seed=0, total=total)
    splits = [
        f"data.train={data / 'train.jsonl'}",
        f"data.eval={data / 'val.jsonl'}",
        f"data.test={data / 'test.jsonl'}",
        f"data.num_workers={num_workers}",
        f"data.image_cache_mb={IMAGE_CACHE_MB}",  # 12,000 decoded 64x64 images: ~150 MB
    ]
    per_stage = stage_overrides(
        size, steps, batch_size, caption_steps, rl_steps, extra or [], caption_extra or []
    )
    messages = {
        "clip": f"training the CLIP stage ({size}, {steps} steps, batch {batch_size})",
        "caption_pretrain": "captioner: pretrain (vision tower from the CLIP run, frozen)",
        "caption_finetune": "captioner: finetune (vision at 0.1x lr)",
        "caption_rl": f"RL: REINFORCE on CIDEr-D from the finetuned captioner ({rl_steps} steps, "
        "K=4 nucleus samples per image, EMA baseline, KL to the frozen start)",
    }

    def announce(st: PipelineStage) -> None:
        print(f"[{only.index(st.name) + 2}/{total}] {messages[st.name]} -> {st.cfg.run.out_dir}")

    ran = run_pipeline(
        PIPELINE,
        splits,
        stage_overrides={k: v for k, v in per_stage.items() if k in only},
        root=root,
        only=only,
        announce=announce,
        report=False,
    )
    by_name = {r["name"]: r for r in ran}
    summary = by_name["clip"]["summary"]
    result: dict[str, Any] = {"clip": summary}
    rows = [_row(r, root) for r in ran]
    if caption_steps:
        fine = by_name["caption_finetune"]["summary"]
        val, test = _strip(fine.get("val", {})), fine.get("test", {})
        result["caption"] = {
            "val greedy": val,
            "test greedy": test,
            "val beam": _beam(val),
            "test beam": _beam(test),
        }
    if rl_steps:
        result["rl"] = by_name["caption_rl"]["summary"]
    result["stages"] = rows
    print(
        f"[{total}/{total}] results (percent for retrieval; val = attribute combos seen in "
        "training, test = held-out combos):\n"
    )
    print(results_table(summary))
    if caption_steps:
        print("\n" + caption_table(result["caption"]))
    report = stages_table(rows)
    print("\nAll stages, held-out test split:\n\n" + report)
    elapsed = time.time() - t0
    note = machine_note()
    (root / "report.md").write_text(
        "# vltrain quickstart report\n\nHeld-out test split (attribute combinations never seen "
        f"in training).\n\n{report}\n\n{note}\n\nTotal time: {elapsed:.0f} s.\n"
    )
    runs = ", ".join(str(root / r["run"]) for r in rows)
    html = write_report([str(root / r["run"]) for r in rows], root / "report.html", "quickstart")
    print(
        f"\nrun folders: {runs}  (config.yaml, metrics.jsonl, checkpoints/, summary.json)\n"
        f"report: {root / 'report.md'}, {html}\ntotal time: {elapsed:.0f} s\n{note}"
    )
    return result


def machine_note() -> str:
    """Where these numbers came from, and how far they reproduce."""
    import torch

    from vltrain.diagnostics.card import cpu_gemm_gflops, cpu_model

    return (
        f"machine: {cpu_model() or 'unknown CPU'}, {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, fp32 GEMM {cpu_gemm_gflops():.0f} GFLOP/s measured now "
        "(hosts of one CPU model differ in speed: compare times at this figure). "
        "The numbers are bitwise reproducible on this machine type "
        "with the same library builds and thread count (fp32 on CPU); another CPU type (e.g. "
        "AVX-512 vs not) or BLAS build rounds differently and prints other numbers."
    )


def _row(ran: dict[str, Any], root: Path) -> dict[str, Any]:
    """One all-stages table row from a pipeline row."""
    summary = ran["summary"]
    return {
        "stage": STAGE_NAMES[ran["name"]],
        "run": ran["name"],
        "steps": summary["steps"],
        "seconds": ran["seconds"],
        "test": dict(summary.get("test") or {}),
    }


def _beam(metrics: dict[str, Any]) -> dict[str, Any]:
    """The beam-search scores (beam_*) of an evaluation, under their plain names."""
    return {k.removeprefix("beam_"): v for k, v in metrics.items() if k.startswith("beam_")}


#: (column header, test-metric key, scale) of the all-stages table
STAGE_COLUMNS = (
    ("i2t R@1", "i2t_R@1", 100),
    ("i2t R@5", "i2t_R@5", 100),
    ("t2i R@1", "t2i_R@1", 100),
    ("t2i R@5", "t2i_R@5", 100),
    ("hard-neg acc", "hardneg_acc", 100),
    ("BLEU-4 greedy", "BLEU-4", 1),
    ("CIDEr-D greedy", "CIDEr-D", 1),
    ("BLEU-4 beam", "beam_BLEU-4", 1),
    ("CIDEr-D beam", "beam_CIDEr-D", 1),
)


def stages_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: one row per stage, its held-out test metrics and wall time."""
    head = ["stage", "steps", "time (s)", *(c[0] for c in STAGE_COLUMNS)]
    body = [
        [r["stage"], cell(r["steps"]), cell(r["seconds"], spec=".0f")]
        + [
            cell(r["test"].get(key), scale, ".1f" if scale == 100 else ".3f")
            for _, key, scale in STAGE_COLUMNS
        ]
        for r in rows
    ]
    return markdown_table(head, body)


def _strip(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("eval_"): v for k, v in metrics.items()}


def caption_table(results: dict[str, dict[str, float]]) -> str:
    """Markdown table of BLEU-4 and CIDEr-D for val/test with greedy and beam decoding."""
    cols = ["val greedy", "val beam", "test greedy", "test beam"]
    body = [
        [name, *(cell(results.get(c, {}).get(name), spec=".3f") for c in cols)]
        for name in ("BLEU-4", "CIDEr-D")
    ]
    return markdown_table(["captioner", *cols], body)
