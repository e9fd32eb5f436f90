"""`vltrain quickstart`: synthetic data -> CLIP -> caption pretrain -> finetune -> RL -> report.

Every stage trains a real (tiny) model on the synthetic shapes data, in minutes on a laptop CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from vltrain.stages import load_run_config

CONFIGS = Path(__file__).parent / "configs"
PRESET = CONFIGS / "quickstart.yaml"

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
    synth_command(str(data_dir), n_train, n_eval, n_eval, seed)
    stamp.write_text(json.dumps(want))
    print(f"[1/{total}] wrote synthetic shapes data to {data_dir} ({time.time() - t:.1f} s)")


def results_table(summary: dict[str, Any]) -> str:
    """Markdown table of val/test retrieval and hard-negative accuracy, with chance levels."""
    val, test = summary.get("val", {}), summary.get("test", {})
    lines = ["| metric | val | test (unseen combos) | chance (val) |", "|---|---|---|---|"]
    n_val = val.get("eval_n_images", 0) or 1
    for name, key in ROWS:
        v = val.get(f"eval_{key}")
        t = test.get(key)
        k = 5 if key.endswith("5") else 1
        chance = 0.5 if key == "hardneg_acc" else min(1.0, k / n_val)
        fmt = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
        lines.append(f"| {name} | {fmt(v)} | {fmt(t)} | {fmt(chance)} |")
    return "\n".join(lines)


def run_quickstart(
    out: str = "runs/quickstart",
    size: str = "tiny",
    steps: int = 500,
    n_train: int = 4000,
    n_eval: int = 300,
    batch_size: int = 128,
    num_workers: int = 1,
    extra: list[str] | None = None,
    caption_steps: int = 300,
    caption_extra: list[str] | None = None,
    rl_steps: int = 60,
) -> dict[str, Any]:
    """Run the whole demo; returns {"clip": summary, "caption": metrics, "stages": rows}.

    caption_steps=0 skips the captioner (and RL); rl_steps=0 skips RL. `stages` holds one row
    per trained stage (name, steps, seconds, test metrics) and is what `report.md` tabulates.
    """
    from vltrain.runs import train

    root = Path(out)
    data = root / "data"
    t0 = time.time()
    rl_steps = rl_steps if caption_steps else 0
    total = 3 + bool(caption_steps) + bool(rl_steps)
    _ensure_data(data, n_train, n_eval, seed=0, total=total)
    splits = [
        f"data.train={data / 'train.jsonl'}",
        f"data.eval={data / 'val.jsonl'}",
        f"data.test={data / 'test.jsonl'}",
        f"data.num_workers={num_workers}",
    ]
    overrides = [
        f"run.out_dir={root / 'clip'}",
        *splits,
        f"model.vision={size}",
        f"model.text={size}",
        f"train.max_steps={steps}",
        f"train.eval_every={max(steps // 3, 1)}",
        f"train.save_every={max(steps // 3, 1)}",
        f"data.batch_size={batch_size}",
        f"optim.warmup_steps={min(50, steps // 5)}",
        *(extra or []),
    ]
    cfg = load_run_config(PRESET, overrides)
    print(
        f"[2/{total}] training the CLIP stage ({size}, {steps} steps, batch {batch_size}) "
        f"-> {cfg.run.out_dir}"
    )
    t = time.time()
    summary = train(cfg)
    result: dict[str, Any] = {"clip": summary}
    rows = [_row("CLIP (contrastive)", root / "clip", summary["test"], t)]
    if caption_steps:
        print(
            f"[3/{total}] captioner: pretrain (vision tower from the CLIP run, frozen) -> "
            "finetune (vision at 0.1x lr)"
        )
        result["caption"] = run_caption_stages(
            root, splits, cfg.run.out_dir, size, caption_steps, caption_extra or []
        )
        rows += result["caption"].pop("rows")
    if rl_steps:
        print(
            f"[4/{total}] RL: REINFORCE on CIDEr-D from the finetuned captioner ({rl_steps} steps, "
            "K=4 nucleus samples per image, EMA baseline, KL to the frozen start)"
        )
        t = time.time()
        rl = run_rl_stage(root, splits, size, rl_steps, caption_extra or [])
        result["rl"] = rl
        rows.append(_row("caption RL", root / "caption_rl", _strip(rl["test"]), t))
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
    (root / "report.md").write_text(
        "# vltrain quickstart report\n\nHeld-out test split (attribute combinations never seen "
        f"in training).\n\n{report}\n\nTotal time: {elapsed:.0f} s.\n"
    )
    runs = ", ".join(str(root / r["run"]) for r in rows)
    print(
        f"\nrun folders: {runs}  (config.yaml, metrics.jsonl, checkpoints/, summary.json)\n"
        f"report: {root / 'report.md'}\ntotal time: {elapsed:.0f} s"
    )
    return result


def _row(name: str, run: Path, test: dict[str, Any], t_start: float) -> dict[str, Any]:
    summary = json.loads((run / "summary.json").read_text())
    return {
        "stage": name,
        "run": run.name,
        "steps": summary["steps"],
        "seconds": time.time() - t_start,
        "test": dict(test),
    }


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
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r["stage"], str(r["steps"]), f"{r['seconds']:.0f}"]
        for _, key, scale in STAGE_COLUMNS:
            v = r["test"].get(key)
            cells.append("-" if v is None else f"{scale * v:.1f}" if scale == 100 else f"{v:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_caption_stages(
    root: Path, splits: list[str], clip_run: str, size: str, steps: int, extra: list[str]
) -> dict[str, Any]:
    """Caption pretrain -> finetune on the synthetic data; greedy and beam BLEU/CIDEr-D.

    Returns the finetuned model's metrics by "<split> <decoding>" and, under "rows", one
    all-stages table row per stage.
    """
    from vltrain.runs import train
    from vltrain.engine.runtime import eval_mode
    from vltrain.tools.loading import load_trained

    common = [
        *splits,
        f"model.vision={size}",
        f"model.text={size}",
        "data.batch_size=64",
        "caption.strategy=greedy",
        "log.tensorboard=false",
        *extra,
    ]
    pre, fine = root / "caption_pretrain", root / "caption_finetune"
    pre_steps, fine_steps = steps * 2 // 3, steps - steps * 2 // 3
    t = time.time()
    pre_summary = train(
        load_run_config(
            CONFIGS / "caption_pretrain.yaml",
            [
                f"run.out_dir={pre}",
                f"model.vision_init_from={clip_run}",
                "model.freeze=[vision]",
                f"train.max_steps={pre_steps}",
                f"train.eval_every={pre_steps}",
                f"train.save_every={pre_steps}",
                f"optim.warmup_steps={min(50, pre_steps // 5)}",
                *common,
            ],
        )
    )
    rows = [_row("caption pretrain", pre, pre_summary.get("test") or {}, t)]
    t = time.time()
    fine_summary = train(
        load_run_config(
            CONFIGS / "caption_finetune.yaml",
            [
                f"run.out_dir={fine}",
                f"model.init_from={pre}",
                f"train.max_steps={fine_steps}",
                f"train.eval_every={fine_steps}",
                f"train.save_every={fine_steps}",
                f"optim.warmup_steps={min(20, fine_steps // 5)}",
                *common,
            ],
        )
    )
    out: dict[str, Any] = {
        "val greedy": _strip(fine_summary.get("val", {})),
        "test greedy": fine_summary.get("test", {}),
    }
    _, stage, model = load_trained(fine, ["caption.strategy=beam", "caption.num_beams=3"])
    with eval_mode(model):
        for split in ("val", "test"):
            out[f"{split} beam"] = stage.evaluate(model, split)
    test = {**out["test greedy"], **{f"beam_{k}": v for k, v in out["test beam"].items()}}
    rows.append(_row("caption finetune", fine, test, t))
    out["rows"] = rows
    return out


def run_rl_stage(
    root: Path, splits: list[str], size: str, steps: int, extra: list[str]
) -> dict[str, Any]:
    """RL (configs/rl.yaml recipe) from the finetuned captioner; greedy and beam eval."""
    from vltrain.runs import train

    return train(
        load_run_config(
            CONFIGS / "rl.yaml",
            [
                f"run.out_dir={root / 'caption_rl'}",
                *splits,
                f"model.init_from={root / 'caption_finetune'}",
                f"model.vision={size}",
                f"model.text={size}",
                f"train.max_steps={steps}",
                f"train.eval_every={steps}",
                f"train.save_every={steps}",
                f"optim.warmup_steps={min(10, steps // 5)}",
                "rl.eval_beam=true",
                "log.tensorboard=false",
                *extra,
            ],
        )
    )


def _strip(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("eval_"): v for k, v in metrics.items()}


def caption_table(results: dict[str, dict[str, float]]) -> str:
    """Markdown table of BLEU-4 and CIDEr-D for val/test with greedy and beam decoding."""
    cols = ["val greedy", "val beam", "test greedy", "test beam"]
    lines = ["| captioner | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name in ("BLEU-4", "CIDEr-D"):
        vals = [results.get(c, {}).get(name) for c in cols]
        lines.append(
            f"| {name} | " + " | ".join("-" if v is None else f"{v:.3f}" for v in vals) + " |"
        )
    return "\n".join(lines)
