"""The quickstart CLIP recipe study: retrieval and relation accuracy against steps, per variant.

    python bench/quickstart_recipe.py --out runs/recipe [--steps 500] [--seeds 0] \
        [--variants vit cnn cnn_hn1 ...] [--eval-every 100]

Every variant is the quickstart's CLIP stage (configs/quickstart.yaml, the quickstart's data:
4,000 train / 300 val / 300 test synthetic images) with a few overrides (VARIANTS below), trained
by `vltrain train` in its own folder and evaluated every `--eval-every` steps on val; the final
weights also on test. Prints one markdown table of the final numbers (with the ceiling the
evaluation reports) and one of the val curves, and writes both plus the raw rows to --out.
Finished runs are reused (delete the folder to rerun one).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from vltrain.data.synth import synth_command
from vltrain.runs.quickstart import CONFIGS

S1 = "model.vision_options={stem_channels: [16, 32, 64, 128]}"  # a stride-1 conv first
#: the quickstart defaults these variants were recorded with (rounds 1-2), before round 3 took
#: the 16-32-64 stem, one text block and lr 1e-3 and round 4 the mean-pooled causal text tower
#: and the caption-caption loss (bench/quickstart_reference.py); a variant's own
#: model.text_options (CAUSAL) comes later and wins
ROUND2 = [
    "model.text_layers=2",
    "optim.lr=2.0e-3",
    "model.text_options={causal: false, pool: last}",  # dict overrides merge: say each field
    "objective.caption_contrast=0",
]
#: round 3's text tower and loss, for the round-3 rows below
ROUND3 = ["model.text_options={causal: true, pool: last}", "objective.caption_contrast=0"]
ROUND2_STEM = "model.vision_options={stem_channels: [32, 64, 128]}"
CAUSAL = "model.text_options={causal: true, pool: last}"  # CLIP's causal text encoder
#: name -> overrides of configs/quickstart.yaml
VARIANTS: dict[str, list[str]] = {
    "vit": ["model.vision=tiny", "objective.hard_negatives=0"],  # the quickstart before
    "vit_hn1": ["model.vision=tiny", "objective.hard_negatives=1"],
    "cnn": ["model.vision=tiny_cnn", "objective.hard_negatives=0"],
    "cnn_hn1": ["model.vision=tiny_cnn", "objective.hard_negatives=1"],
    "cnn_hn3": ["model.vision=tiny_cnn", "objective.hard_negatives=3"],
    "cnn_s1": ["model.vision=tiny_cnn", S1, "objective.hard_negatives=0"],
    "cnn_s1_hn3": ["model.vision=tiny_cnn", S1, "objective.hard_negatives=3"],
    "cnn_hn3_t03": [
        "model.vision=tiny_cnn",
        "objective.hard_negatives=3",
        "objective.temperature=0.03",
    ],
    "cnn_hn3_causal": ["model.vision=tiny_cnn", "objective.hard_negatives=3", CAUSAL],
    "cnn_hn1_causal": ["model.vision=tiny_cnn", "objective.hard_negatives=1", CAUSAL],
    "cnn_hn1_causal_t3": [
        "model.vision=tiny_cnn",
        "objective.hard_negatives=1",
        CAUSAL,
        "model.text_layers=3",
    ],
    "cnn_causal": ["model.vision=tiny_cnn", "objective.hard_negatives=0", CAUSAL],
    "cnn1": ["model.vision=tiny_cnn", "model.vision_layers=1", "objective.hard_negatives=0"],
    "cnn1_hn3": ["model.vision=tiny_cnn", "model.vision_layers=1", "objective.hard_negatives=3"],
}
#: variants on later defaults (round 4 = configs/quickstart.yaml as it ships), not pinned to
#: ROUND2
CURRENT: dict[str, list[str]] = {
    "round3": ROUND3,
    "round3_hn0": [*ROUND3, "objective.hard_negatives=0"],
    "round4": [],
    "round4_hn0": ["objective.hard_negatives=0"],
}
VARIANTS.update(CURRENT)


def variant_overrides(name: str) -> list[str]:
    """The overrides of one variant, recorded ones pinned to the defaults they ran with."""
    if name in CURRENT:
        return CURRENT[name]
    own = VARIANTS[name]
    cnn = "model.vision=tiny_cnn" in own and not any("vision_options" in o for o in own)
    return [*ROUND2, *([ROUND2_STEM] if cnn else []), *own]


def train(
    data: Path, out: Path, name: str, seed: int, steps: int, every: int, threads: int
) -> float:
    """Train one variant (skipped when its summary exists); returns the wall seconds."""
    if (out / "summary.json").is_file():
        return float(json.loads((out / "summary.json").read_text()).get("train_seconds", 0))
    over = [
        f"run.out_dir={out}",
        f"run.seed={seed}",
        f"data.train={data / 'train.jsonl'}",
        f"data.eval={data / 'val.jsonl'}",
        f"data.test={data / 'test.jsonl'}",
        f"train.max_steps={steps}",
        f"train.eval_every={every}",
        f"train.save_every={steps}",
        "train.overwrite=true",
        "log.progress=false",
        f"run.threads={threads}",
        *variant_overrides(name),
    ]
    t = time.time()
    cmd = [sys.executable, "-m", "vltrain", "train", str(CONFIGS / "quickstart.yaml"), *over]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.time() - t


def rows_of(out: Path) -> tuple[dict, list[dict]]:
    """(summary, eval rows of metrics.jsonl) of a finished run."""
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if "eval_i2t_R@1" in r]
    return summary, evals


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/recipe"))
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--n-train", type=int, default=4000, help="synthetic training images")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (0: all)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    a = p.parse_args(argv)
    data = a.out / "data"
    if not (data / "test.jsonl").is_file():
        synth_command(str(data), a.n_train, 300, 300, 0, force=True, workers=2)
    final, curves = [], []
    for name in a.variants:
        for seed in a.seeds:
            run = a.out / f"{name}_s{seed}"
            secs = train(data, run, name, seed, a.steps, a.eval_every, a.threads)
            summary, evals = rows_of(run)
            v, t = summary["val"], summary["test"]
            final.append(
                [name, seed, summary["steps"], f"{secs:.0f}"]
                + [pct(v.get(f"eval_{k}")) for k in ("i2t_R@1", "t2i_R@1")]
                + [pct(v.get("eval_i2t_R@1_ceiling"))]
                + [pct(t.get(k)) for k in ("i2t_R@1", "t2i_R@1", "i2t_R@1_ceiling")]
                + [pct(v.get("eval_hardneg_acc_relation")), pct(t.get("hardneg_acc_relation"))]
                + [pct(t.get(f"hardneg_acc_{k}")) for k in ("color", "shape", "size")]
            )
            for r in evals:
                curves.append(
                    [name, seed, r["step"], pct(r["eval_i2t_R@1"]), pct(r["eval_t2i_R@1"])]
                    + [pct(r.get("eval_hardneg_acc_relation"))]
                )
    head = (
        "| variant | seed | steps | wall s | val i2t R@1 | val t2i R@1 | val ceiling | "
        "test i2t R@1 | test t2i R@1 | test ceiling | val relation | test relation | "
        "test colour | test shape | test size |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in final]
    ch = "| variant | seed | step | val i2t R@1 | val t2i R@1 | val relation |"
    clines = [ch, "|" + "---|" * (ch.count("|") - 1)]
    clines += ["| " + " | ".join(map(str, r)) + " |" for r in curves]
    text = "\n".join(lines) + "\n\nval curves:\n\n" + "\n".join(clines) + "\n"
    print(text)
    (a.out / "recipe.md").write_text(text)


if __name__ == "__main__":
    main()
