"""One SFT step, vltrain vs TRL's SFTTrainer, on the same tiny LLaVA and the same batch (CPU, fp32).

The model is `trl_sft_label_parity.build_llava` at a width that makes a step take a fraction of a
second on CPU; the batch is 8 chats of `trl_sft_label_parity.chat_records` (one- and two-turn).
A step is what each side does per batch, from samples to updated weights:

- vltrain: `VLMCaptionCollate` (chat format) -> `HFVLM.forward` (teacher-forced CE, assistant
  tokens only) -> backward -> AdamW step (the caption stage's model and collate; the engine's
  clipping, logging and accumulation are not included);
- TRL: ``DataCollatorForVisionLanguageModeling`` (assistant-only loss) ->
  ``SFTTrainer.training_step`` (its fused LM-head loss and token metrics, backward) -> the
  trainer's AdamW step.

Each run is a fresh process (warm-up steps, then `--steps` timed steps; peak RSS above the RSS
before the timed steps, with the kernel's high-water mark reset through /proc/self/clear_refs);
runs alternate A B A B. Prints one JSON line per run and a summary (medians, ratios).

``PYTHONPATH=. /work/venv-trl/bin/python bench/trl_sft_step.py --runs 5``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_sft_label_parity import build_llava, chat_records, texts_of, trl_collator

BATCH = 8


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def vltrain_step_fn(path: Path, recs: list[dict[str, Any]], lr: float) -> Any:
    from transformers import AutoModelForImageTextToText

    from vltrain.data.vlm_caption_data import VLMCaptionCollate
    from vltrain.models.hf_vlm import HFVLM

    model = HFVLM(AutoModelForImageTextToText.from_pretrained(path), "hf_vlm").train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    collate = VLMCaptionCollate(str(path), "llava", "chat", max_text_len=100_000)
    samples = [
        {"image": Image.open(r["image"]).convert("RGB"), "messages": r["messages"], "index": i}
        for i, r in enumerate(recs)
    ]

    def step() -> float:
        b = collate(samples)
        out = model(b["images"], b["input_ids"], b["attention_mask"], b["labels"])
        out["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out["loss"])

    return step


def trl_step_fn(path: Path, recs: list[dict[str, Any]], lr: float, out_dir: str) -> Any:
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText
    from trl import SFTConfig, SFTTrainer

    model = AutoModelForImageTextToText.from_pretrained(path)
    collator = trl_collator(path, "llava")
    rows = [
        {"images": [Image.open(r["image"]).convert("RGB")], "messages": r["messages"]} for r in recs
    ]
    args = SFTConfig(
        output_dir=out_dir,
        assistant_only_loss=True,
        per_device_train_batch_size=BATCH,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.01,
        max_length=None,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        remove_unused_columns=False,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=collator.processor,
        data_collator=collator,
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=100)
    trainer.current_gradient_accumulation_steps = 1  # what train() sets before its steps
    model.train()

    def step() -> float:
        examples = [
            {"images": [Image.open(r["image"]).convert("RGB")], "messages": r["messages"]}
            for r in recs
        ]
        batch = collator(examples)
        loss = trainer.training_step(model, batch)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return step


def child(which: str, path: Path, data: Path, steps: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    recs = chat_records(data, BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        if which == "vltrain":
            step = vltrain_step_fn(path, recs, 1e-4)
        else:
            step = trl_step_fn(path, recs, 1e-4, tmp)
        losses = [step() for _ in range(warmup)]
        base = _rss_kb("VmRSS")
        _reset_peak()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(step())
            times.append(time.perf_counter() - t0)
        peak = _rss_kb("VmHWM")
    return {
        "which": which,
        "step_s": statistics.median(times),
        "peak_rss_delta_mb": (peak - base) / 1024,
        "first_loss": losses[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs of each, alternated")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--child", nargs=3, metavar=("WHICH", "MODEL", "DATA"))
    args = ap.parse_args()
    if args.child:
        which, path, data = args.child
        res = child(which, Path(path), Path(data), args.steps, args.warmup)
        print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory() as tmp:
        from vltrain.data.synth import write_shapes_dataset

        data, model = Path(tmp) / "shapes", Path(tmp) / "llava"
        write_shapes_dataset(data, n_train=BATCH, n_val=2, n_test=2, image_size=32)
        model.mkdir()
        build_llava(model, texts_of(chat_records(data, BATCH)), args.hidden, args.layers)
        n_params = sum(
            p.numel()
            for p in __import__("transformers")
            .AutoModelForImageTextToText.from_pretrained(model)
            .parameters()
        )
        runs: dict[str, list[dict[str, Any]]] = {"vltrain": [], "trl": []}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        for _ in range(args.runs):
            for which in ("vltrain", "trl"):
                cmd = [sys.executable, __file__, "--child", which, str(model), str(data)]
                cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode:
                    raise SystemExit(f"{which} run failed:\n{out.stderr[-3000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                row["load1"] = os.getloadavg()[0]
                print(json.dumps(row), flush=True)
                runs[which].append(row)
    med = {
        w: {k: statistics.median(r[k] for r in rs) for k in ("step_s", "peak_rss_delta_mb")}
        for w, rs in runs.items()
    }
    summary = {
        "params": n_params,
        "hidden": args.hidden,
        "layers": args.layers,
        "batch": BATCH,
        "median": med,
        "ratio_trl_over_vltrain": {
            k: med["trl"][k] / med["vltrain"][k] for k in ("step_s", "peak_rss_delta_mb")
        },
        "load1": [r["load1"] for rs in runs.values() for r in rs],
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
