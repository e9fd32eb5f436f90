"""`vltrain data regenerate`: the target answers a dataset's prompts (drafter training data)."""

from __future__ import annotations

import argparse

from vltrain.cli.options import (
    add_forward_option,
    non_negative_int,
    positive_float,
    positive_int,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "regenerate",
        help="make a target model answer a dataset's prompts (drafter training data)",
        description="Batched, greedy or sampled, resumable (ids already in --out are skipped), "
        "sharded over ranks (OUT.rank{r}). --model: an HF causal LM dir or .gguf and a prompts "
        'JSONL ({"prompt"}); --checkpoint: a captioner run and caption records.',
    )
    s.add_argument("--data", required=True, help="prompts JSONL (--model) or caption records")
    s.add_argument("--out", required=True, help="output JSONL (appended to when resuming)")
    s.add_argument("--model", default="", help="HF causal LM directory or .gguf file")
    s.add_argument("--checkpoint", default="", help="captioner run dir or checkpoint")
    s.add_argument("--strategy", default="greedy", choices=("greedy", "sample"))
    s.add_argument("--temperature", type=positive_float, default=1.0)
    s.add_argument("--max-new-tokens", type=positive_int, default=128)
    s.add_argument("--batch-size", type=positive_int, default=8)
    s.add_argument("--seed", type=int, default=0)
    add_forward_option(s)
    s.add_argument(
        "--device",
        default="auto",
        help="auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu, cuda, cuda:N",
    )
    s.add_argument(
        "--rank", type=non_negative_int, default=0, help="this shard (or RANK of torchrun)"
    )
    s.add_argument("--world-size", type=positive_int, default=1, help="shards (or WORLD_SIZE)")
    s.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from vltrain.tools.regenerate import regenerate

    regenerate(args)
    return 0
