"""Batched greedy answers from SmolLM2-135M-Instruct: vltrain `generate` (what `vltrain data
regenerate` runs) against HF `generate`, same prompts, same batches, identical tokens.

    python bench/bench_regenerate.py [--prompts 64] [--batch-size 16] [--max-new 128] [--repeats 2]

HF keeps a finished row in the batch until the batch's longest answer ends; vltrain drops a row
once it has emitted EOS (`reorder`) and runs the native Llama forward. The script prints,
per method, the median wall-clock time over alternating repeats, answer tokens/s, and the
row-steps each scheme computes (HF: batch rows x the batch's longest answer; vltrain: the sum of
the answers' lengths), and exits non-zero unless both wrote the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from bench_drafter import PROMPTS, gguf_path, machine

from vltrain.data.draft_data import chat_prompt_ids
from vltrain.inference.captioning import left_pad
from vltrain.inference.decoding import generate
from vltrain.inference.hf_target import load_hf_causal_lm
from vltrain.inference.native_llama import causal_lm_target


def _cut(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_hf_causal_lm(gguf_path())
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    dec = causal_lm_target(model, [], "auto", pad)
    eos = dec.eos_token_id
    step = max(1, len(PROMPTS) // args.prompts)  # spread over the topics and templates
    prompts = PROMPTS[::step][: args.prompts]
    batches = []
    for i in range(0, len(prompts), args.batch_size):
        ids, mask = left_pad(
            [chat_prompt_ids(tok, q) for q in prompts[i : i + args.batch_size]], pad
        )
        batches.append((ids, mask))

    def hf() -> list[list[int]]:
        rows = []
        for ids, mask in batches:
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=args.max_new,
                pad_token_id=pad,
                eos_token_id=eos,
            )
            rows += [_cut(r, eos) for r in out[:, ids.shape[1] :].tolist()]
        return rows

    def ours() -> list[list[int]]:
        rows = []
        for ids, mask in batches:
            out = generate(dec, {"input_ids": ids, "attention_mask": mask}, "greedy", args.max_new)
            rows += [s[: int(n)].tolist() for s, n in zip(out.sequences, out.lengths, strict=True)]
        return rows

    methods = {"HF generate (static batch)": hf, "vltrain generate (rows leave at EOS)": ours}
    times: dict[str, list[float]] = {m: [] for m in methods}
    answers: dict[str, list[list[int]]] = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, fn in methods.items():
                t = time.perf_counter()
                answers[name] = fn()
                times[name].append(time.perf_counter() - t)
    a, b = answers.values()
    same = a == b
    lens = [len(r) for r in b]
    static = sum(
        len(lens[i : i + args.batch_size]) * max(lens[i : i + args.batch_size])
        for i in range(0, len(lens), args.batch_size)
    )
    base = statistics.median(times["HF generate (static batch)"])
    print(json.dumps(machine()))
    print(
        f"{len(prompts)} prompts, batch {args.batch_size}, max_new {args.max_new}: answers of "
        f"{min(lens)}-{max(lens)} tokens (mean {statistics.mean(lens):.1f}, {sum(lens)} in all); "
        f"row-steps static {static} vs dropped {sum(lens)} ({static / sum(lens):.2f}x)"
    )
    print("| method | median s | answer tokens/s | speed-up vs HF |\n|---|---:|---:|---:|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.1f} | {sum(lens) / med:.1f} | {base / med:.2f}x |")
    print(f"identical tokens: {same}")
    if not same:
        bad = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        raise SystemExit(f"outputs differ on prompts {bad}")


if __name__ == "__main__":
    main()
