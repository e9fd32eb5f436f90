"""Benchmark vltrain's batched beam search against HF `generate` on a random tiny-ish LLaVA.

Run: ``python bench/bench_decoding.py [--images 32] [--beams 5] [--max-new 20] [--repeats 3]``.
Three ways to caption the same images with beam search (num_beams=5):
HF `generate` on the whole batch, vltrain `generate` on the whole batch, and vltrain one image
at a time. The script fails loudly unless all three produce identical tokens, then prints a
markdown table of median throughputs and writes it to bench/results_decoding.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import transformers

from vltrain.inference.decoding import generate
from vltrain.inference.hf_target import HFTarget

PAD, BOS, EOS = 0, 1, 2
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results_decoding.md")


def build_llava(vocab: int, width: int, layers: int, eos_norm: float, seed: int = 0) -> Any:
    """Random LLaVA: CLIP vision (32px, patch 8 -> 16 image tokens) + Llama decoder."""
    torch.manual_seed(seed)
    vision = transformers.CLIPVisionConfig(
        image_size=32,
        patch_size=8,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=128,
    )
    text = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=4 * width,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=width // 64,
        max_position_embeddings=512,
        eos_token_id=EOS,
        pad_token_id=PAD,
        bos_token_id=BOS,
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=vocab - 1,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # EOS row norm sets how early captions end (init norm ~0.02*sqrt(width))
        row = model.lm_head.weight[EOS]
        row.mul_(eos_norm / row.norm())
    return model


def make_inputs(n: int, vocab: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """Prompt = BOS, 16 image tokens, 8 random text tokens (left-padded by 0-3 tokens)."""
    g = torch.Generator().manual_seed(seed)
    txt = torch.randint(3, vocab - 1, (n, 8), generator=g)
    ids = torch.cat([torch.full((n, 1), BOS), torch.full((n, 16), vocab - 1), txt], 1)
    mask = torch.ones_like(ids)
    for b in range(n):
        pad = b % 4
        if pad:
            ids[b] = torch.cat([torch.full((pad,), PAD), ids[b, :-pad]])
            mask[b, :pad] = 0
    pixels = torch.randn(n, 3, 32, 32, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


def new_tokens_hf(model: Any, inputs: dict, beams: int, max_new: int) -> torch.Tensor:
    """HF beam search; filler after EOS normalised to PAD (HF fills with EOS when pad id is 0)."""
    with torch.no_grad():
        out = model.generate(
            **inputs,
            do_sample=False,
            num_beams=beams,
            max_new_tokens=max_new,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )
    new = out[:, inputs["input_ids"].shape[1] :]
    after_eos = ((new == EOS).int().cumsum(1) - (new == EOS).int()) > 0
    return new.masked_fill(after_eos, PAD)


def one_at_a_time(target: HFTarget, inputs: dict, beams: int, max_new: int) -> list:
    """vltrain beam search called once per image (the loop users write without batching)."""
    outs = []
    for b in range(inputs["input_ids"].shape[0]):
        one = {k: v[b : b + 1] for k, v in inputs.items()}
        mask = one["attention_mask"][0].bool()  # drop this row's own left padding
        one["input_ids"], one["attention_mask"] = (
            one["input_ids"][:, mask],
            one["attention_mask"][:, mask],
        )
        outs.append(generate(target, one, "beam", max_new_tokens=max_new, num_beams=beams))
    return outs


def timed(fns: dict[str, Callable[[], Any]], repeats: int) -> tuple[dict, dict]:
    """Median wall time per function, run round-robin so machine noise hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    outs: dict[str, Any] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}, outs


def check_identical(hf: torch.Tensor, batched: Any, singles: list) -> None:
    if not torch.equal(batched.sequences, hf):
        raise SystemExit(f"MISMATCH vltrain batched vs HF:\n{batched.sequences}\n{hf}")
    for b, one in enumerate(singles):
        width = one.sequences.shape[1]
        row = batched.sequences[b]
        if not (torch.equal(one.sequences[0], row[:width]) and bool((row[width:] == PAD).all())):
            raise SystemExit(f"MISMATCH one-at-a-time vs batched, image {b}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--beams", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--eos-norm", type=float, default=1.0, help="EOS lm_head row norm")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_llava(args.vocab, args.width, args.layers, args.eos_norm)
    inputs = make_inputs(args.images, args.vocab)
    target = HFTarget(model)
    k, m = args.beams, args.max_new
    fns = {
        "HF generate (batched)": lambda: new_tokens_hf(model, inputs, k, m),
        "vltrain (batched)": lambda: generate(
            target, inputs, "beam", max_new_tokens=m, num_beams=k
        ),
        "vltrain (one image at a time)": lambda: one_at_a_time(target, inputs, k, m),
    }
    generate(target, make_inputs(2, args.vocab), "beam", max_new_tokens=2, num_beams=k)  # warm
    med, outs = timed(fns, args.repeats)
    names = list(fns)
    check_identical(outs[names[0]], outs[names[1]], outs[names[2]])
    table = report(args, med, outs[names[1]])
    print(table)
    if not args.no_write:
        with open(OUT, "w") as f:
            f.write(table)


def report(args: argparse.Namespace, med: dict[str, float], batched: Any) -> str:
    names = list(med)
    ours = med["vltrain (batched)"]
    lengths = batched.lengths.float()
    lines = [
        "## Decoding: vltrain batched beam search vs HF `generate`",
        "",
        f"`python bench/bench_decoding.py --images {args.images} --beams {args.beams} "
        f"--max-new {args.max_new} --repeats {args.repeats} --eos-norm {args.eos_norm}`: "
        f"random LLaVA (CLIP vision 2x128, "
        f"16 image tokens; Llama decoder {args.layers} layers x {args.width}, vocab {args.vocab}), "
        f"fp32, prompt = BOS + 16 image tokens + 8 text tokens, left-padded 0-3. "
        f"num_beams={args.beams}, max_new_tokens={args.max_new}, caption lengths "
        f"{int(lengths.min())}-{int(lengths.max())} (mean {lengths.mean():.1f}). All three "
        "produce identical tokens (checked). Medians of "
        f"{args.repeats} round-robin runs.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {version('transformers')}.",
        "",
        "| method | time (s) | images/s | vltrain batched speedup |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        t = med[name]
        lines.append(f"| {name} | {t:.2f} | {args.images / t:.2f} | {t / ours:.2f}x |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
