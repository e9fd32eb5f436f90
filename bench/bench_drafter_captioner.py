"""Drafters for the quickstart captioner: tau and wall clock against its own greedy decoding.

    vltrain quickstart --out runs/quickstart
    for s in train val; do vltrain data regenerate --checkpoint runs/quickstart/caption_finetune \
        --data runs/quickstart/data/$s.jsonl --out runs/quickstart/data/${s}_regen.jsonl; done
    python bench/bench_drafter_captioner.py --qs runs/quickstart --out bench/out/drafter_cap \
        [--grid 8:4 8:7 8:10 16:4 16:7 16:10] [--steps 300] [--budgets 0 16 32] [--repeats 3] \
        [--batch-size 64] [--limit N] [--results results.json]

Per (block, gamma) a drafter is trained against the frozen finetuned captioner on its own
regenerated captions (configs/drafter.yaml, evaluated on the regenerated val captions, so
training-time tau is measured against the target's greedy tokens; finished runs are reused),
then the held-out test images are captioned in batches by the captioner's plain greedy
decoding and by speculative decoding with each drafter (chain, and DDTree at each node
budget), alternating, `--repeats` times; medians of the wall seconds. Every speculative
caption must equal the greedy one (lossless); per image, tree tau >= chain tau is counted.
Prints a markdown table and writes OUT/RESULTS (results.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def train(qs: Path, out: Path, block: int, gamma: float, steps: int) -> Path:
    run = out / f"b{block}_g{gamma:g}_s{steps}"
    if (run / "summary.json").is_file():
        return run
    cmd = [
        sys.executable, "-m", "vltrain", "train", str(ROOT / "configs/drafter.yaml"),
        f"model.target={qs / 'caption_finetune'}", f"data.train={qs / 'data/train_regen.jsonl'}",
        f"data.eval={qs / 'data/val_regen.jsonl'}", f"run.out_dir={run}",
        f"train.max_steps={steps}",
        f"drafter.block_size={block}", f"drafter.gamma={gamma}", "log.progress=false",
        "train.overwrite=true",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    return run


def test_images(qs: Path, size: int) -> torch.Tensor:
    from vltrain.data.images import load_image

    recs = [json.loads(x) for x in (qs / "data/test.jsonl").read_text().splitlines()]
    return torch.stack([load_image(qs / "data" / r["image"], size) for r in recs])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--qs", required=True, help="a finished quickstart folder (regenerated data)")
    p.add_argument("--out", default="bench/out/drafter_cap")
    p.add_argument("--grid", nargs="+", default=["8:4", "8:7", "8:10", "16:4", "16:7", "16:10"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 32])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--limit", type=int, default=0, help="first N test images only (0: all)")
    p.add_argument("--results", default="results.json", help="file name under --out")
    a = p.parse_args()
    qs, out = Path(a.qs).resolve(), (ROOT / a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for spec in a.grid:
        block, gamma = spec.split(":")
        runs[spec] = train(qs, out, int(block), float(gamma), a.steps)

    from vltrain.data import chat
    from vltrain.inference.captioning import decode_captions
    from vltrain.models.drafter_checkpoint import load_drafter
    from vltrain.tools.generate import generation_prompt, load_for_generation
    from vltrain.tools.speculate import caption_speculative

    model, tok, cfg = load_for_generation(str(qs / "caption_finetune"))
    prompt = chat.encode_prompt(tok, generation_prompt(cfg, None))
    images = test_images(qs, cfg.data.image_size)
    images = images[: a.limit] if a.limit else images
    batches = [images[i : i + a.batch_size] for i in range(0, len(images), a.batch_size)]
    drafters = {k: load_drafter(str(r))[0] for k, r in runs.items()}

    @torch.no_grad()
    def greedy() -> list[str]:
        caps = []
        for b in batches:
            caps += decode_captions(model, tok, b, [prompt] * len(b), strategy="greedy",
                                    num_beams=1, max_new_tokens=a.max_new_tokens)  # fmt: skip
        return caps

    @torch.no_grad()
    def spec(key: str, budget: int) -> tuple[list[str], list]:
        args = SimpleNamespace(max_new_tokens=a.max_new_tokens, tree_budget=budget)
        caps, stats = [], []
        for b in batches:
            caps += caption_speculative(model, tok, b, prompt, args, drafters[key], stats)
        return caps, stats

    arms = [("greedy", None, 0)] + [(k, k, n) for k in runs for n in a.budgets]
    times: dict[str, list[float]] = {}
    outputs: dict[str, tuple] = {}
    for _ in range(a.repeats):  # alternate: every arm once per round
        for name, key, budget in arms:
            label = name if key is None else f"{key} n{budget}"
            t = time.perf_counter()
            res = greedy() if key is None else spec(key, budget)
            times.setdefault(label, []).append(time.perf_counter() - t)
            outputs[label] = res
    ref = outputs["greedy"]
    g_s = statistics.median(times["greedy"])
    rows = []
    for _name, key, budget in arms[1:]:
        label = f"{key} n{budget}"
        caps, stats = outputs[label]
        acc = [x for s in stats for row in s.accepted for x in row]
        row_tau = [t for s in stats for t in s.row_tau()]
        chain = [t for s in outputs[f"{key} n0"][1] for t in s.row_tau()]
        summary = json.loads((runs[key] / "summary.json").read_text())
        val = summary.get("val", summary.get("eval", {}))
        rows.append({
            "drafter": key, "budget": budget, "lossless": caps == ref,
            "tau": sum(acc) / max(len(acc), 1),
            "tree_ge_chain": sum(t >= c - 1e-9 for t, c in zip(row_tau, chain, strict=True)),
            "images": len(row_tau), "seconds": statistics.median(times[label]),
            "speedup": g_s / statistics.median(times[label]),
            "train_tau": {k: v for k, v in val.items() if "tau" in k or "streak" in k},
        })  # fmt: skip
    from vltrain.diagnostics.card import cpu_model

    machine = {
        "cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(),
    }  # fmt: skip
    result = {"machine": machine, "greedy_seconds": g_s, "images": len(images),
              "greedy_tokens": sum(len(tok.encode(c)) for c in ref), "rows": rows,
              "times": times}  # fmt: skip
    result["batch_size"] = a.batch_size
    (out / a.results).write_text(json.dumps(result, indent=2))
    print(f"greedy: {g_s:.3f} s for {len(images)} test images, batch {a.batch_size} "
          f"({machine['cpu']})")  # fmt: skip
    print("| drafter (block:gamma) | verify | tau | tree >= chain | lossless | s | vs greedy |")
    print("|---|---|---:|---:|---|---:|---:|")
    for r in rows:
        v = "chain" if r["budget"] == 0 else f"tree {r['budget']}"
        print(f"| {r['drafter']} | {v} | {r['tau']:.2f} | {r['tree_ge_chain']}/{r['images']} | "
              f"{r['lossless']} | {r['seconds']:.3f} | {r['speedup']:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
