"""`vltrain generate --draft`: speculative decoding with a trained drafter, and causal-LM prompts.

The drafter checkpoint (``drafter.json`` + weights) names its target; the command's own target
(``--checkpoint`` captioner or ``--model`` causal LM) must have the drafter's width and
vocabulary. Output lines equal the plain greedy command's; acceptance statistics go to stderr or
``--stats FILE`` (JSON).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vltrain.config.core import ConfigError
from vltrain.core.files import check_not_input, check_output_path
from vltrain.data.draft_data import chat_prompt_ids, read_prompts, require_chat_template
from vltrain.inference import spec_cost
from vltrain.inference.captioner_target import CaptionerTarget
from vltrain.inference.captioning import left_pad
from vltrain.inference.decoding import generate
from vltrain.inference.hf_target import load_hf_causal_lm
from vltrain.inference.native_llama import causal_lm_target
from vltrain.inference.speculative import SpecStats, speculative_generate
from vltrain.inference.target import DecodeTarget
from vltrain.models import dflash_format
from vltrain.models.drafter import Drafter, SharedParts, check_target_config, config_sha256
from vltrain.models.drafter_checkpoint import load_drafter


def attach(drafter: Drafter, target: DecodeTarget) -> Drafter:
    """Share the target's embeddings and head; refuse a drafter made for another model."""
    c = drafter.cfg
    if (c.width, c.vocab_size) != (target.width, target.vocab_size) or max(
        c.target_layer_ids
    ) >= target.num_layers:
        raise ConfigError(
            f"the drafter (width {c.width}, vocab {c.vocab_size}, layers {c.target_layer_ids}) "
            f"was not trained for this target (width {target.width}, vocab "
            f"{target.vocab_size}, {target.num_layers} layers)"
        )
    return drafter.share(SharedParts(target.embed, target.head, target.head_params))


DEFAULT_TREE_BUDGET = 16
"""--spec tree with neither --tree-budget nor a measured tree budget (bench/RESULTS.md's best
on SmolLM2-135M)."""


def pick_spec(
    args: Any, drafter: Drafter, meta: dict, target: Any, inputs: dict, sha: str
) -> tuple[str, int]:
    """(none / chain / tree, tree budget) for ``--spec`` (module doc of `spec_cost`); auto
    prices the first batch ``inputs`` as the command decodes it and prints one line saying what
    it picked and why."""
    measured = meta.get("eval") or {}
    asked = getattr(args, "spec", "auto")
    own = int(measured.get("tree_budget") or 0)
    budget = args.tree_budget or own or DEFAULT_TREE_BUDGET
    if asked != "auto":
        return asked, budget if asked == "tree" else 0
    # the speed follows the tokens a round emits: the measured rate after EOS / length cuts
    # where the run recorded it (tau counts accepted tokens past them: drafter.json before it)
    tau_chain = float(measured.get("kept_decode") or measured.get("tau_decode") or 0.0)
    if tau_chain <= 0:
        way = "tree" if args.tree_budget else "chain"
        print(
            f"vltrain: --spec auto: {args.draft} records no measured tau (a drafter run "
            "evaluated with drafter.eval_prompts > 0 does, and its exports carry it; a "
            f"checkpoint published elsewhere does not): {way} as asked; --spec none "
            "decodes without it",
            file=sys.stderr,
        )
        return way, args.tree_budget
    tree_rate = measured.get("kept_decode_tree") or measured.get("tau_decode_tree") or 0.0
    tau_tree = float(tree_rate) if budget == own else 0.0
    batch = len(inputs["input_ids"])
    tree = budget if tau_tree > 0 else 0
    key = spec_cost.machine_key(
        sha, type(target).__name__, drafter.cfg.to_dict(), f"batch {batch}", f"tree {tree}"
    )
    t0 = time.perf_counter()
    costs, fresh = spec_cost.cached_costs(
        key,
        lambda: spec_cost.measure_costs(
            target, drafter, inputs, tree, max_new_tokens=args.max_new_tokens
        ),
    )
    where = spec_cost.cache_path()
    when = f"measured now in {time.perf_counter() - t0:.1f} s" if fresh else "measured before"
    taus = {"chain": tau_chain, "tree": tau_tree}
    predicted = spec_cost.predict(costs, taus)
    way = spec_cost.choose(predicted)
    fed = {"chain": drafter.cfg.block_size, "tree": budget + 1}
    line = spec_cost.explain(way, predicted, costs, taus, fed)
    print(f"vltrain: {line} [costs {when}, cached in {where}]", file=sys.stderr)
    return way, budget if way == "tree" else 0


def report(stats: list[SpecStats], seconds: float, tokens: int, path: str, spec: str = "") -> None:
    """Acceptance statistics as JSON on stderr, or into ``path``."""
    rows = [r for s in stats for r in zip(s.accepted, s.kept, strict=True)]
    every = SpecStats([a for a, _ in rows], [k for _, k in rows])  # the batches' rows as one run
    out = {
        **({"spec": spec} if spec else {}),
        "tau": every.tau,
        # what the output gained per round (tau counts tokens accepted past EOS / the limit)
        "tokens_per_round": every.tokens_per_round,
        "rounds": every.rounds,
        "target_calls": sum(s.target_calls for s in stats),
        "new_tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": tokens / max(seconds, 1e-9),
        "row_tau": every.row_tau(),
    }
    text = json.dumps(out)
    if path:
        Path(path).write_text(text + "\n")
    else:
        print(text, file=sys.stderr)


def caption_speculative(
    model: Any,
    tok: Any,
    images: torch.Tensor,
    prompt: list[int],
    args: Any,
    drafter: Drafter,
    stats: list[SpecStats],
) -> list[str]:
    """Greedy captions of a batch of images through the drafter (== plain greedy captions)."""
    target = CaptionerTarget(model, drafter.cfg.target_layer_ids)
    attach(drafter, target)
    ids, mask = left_pad([prompt] * len(images), tok.pad_id)
    room = model.max_text_len - ids.shape[1] - drafter.cfg.block_size
    if room < 1:
        raise ConfigError("the prompt leaves no room for a draft block in the decoder context")
    rows, st = speculative_generate(
        target,
        drafter,
        {"images": images, "input_ids": ids, "attention_mask": mask},
        max_new_tokens=min(args.max_new_tokens, room),
        tree_budget=args.tree_budget,
        tree_shape=args.tree_shape,
    )
    stats.append(st)
    eos = tok.eos_id
    return tok.decode_batch([r[: r.index(eos) + 1] if eos in r else r for r in rows])


def decode_batch(
    target: DecodeTarget,
    drafter: Any,
    inputs: dict[str, Any],
    args: Any,
    sampling: dict[str, Any],
    stats: list[Any],
) -> list[list[int]]:
    """New tokens per row (EOS included) of a batch: the strategy's (`args.strategy`, `--beams`,
    `sampling`), or speculative greedy's when a drafter is given (its stats go to `stats`)."""
    if drafter is None:
        out = generate(
            target,
            inputs,
            args.strategy,
            max_new_tokens=args.max_new_tokens,
            num_beams=args.beams,
            **sampling,
        )
        return [s[: int(n)].tolist() for s, n in zip(out.sequences, out.lengths, strict=True)]
    seqs, st = speculative_generate(
        target,
        drafter,
        inputs,
        args.max_new_tokens,
        tree_budget=args.tree_budget,
        tree_shape=args.tree_shape,
    )
    stats.append(st)
    return seqs


def lm_command(args: Any, sampling: dict[str, Any] | None = None) -> int:
    """``--model DIR_OR_GGUF --prompts FILE.jsonl [--strategy S] [--draft D] [--tree-budget N]``;
    ``sampling``: temperature / top_k / top_p of ``--strategy sample``."""
    if args.out:
        check_output_path(args.out)
        check_not_input(args.out, [args.prompts])
    drafter, meta = load_drafter(args.draft) if args.draft else (None, {})  # refused first
    model, tok = load_hf_causal_lm(args.model)
    require_chat_template(tok, args.model)
    dflash_format.check_verifier(meta, model, args.draft)
    sha = config_sha256(model.config)
    if drafter is not None:
        check_target_config(meta, sha, args.draft)
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and args.max_new_tokens >= limit:  # decoding would never end well
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens} does not fit {args.model}: its "
            f"max_position_embeddings is {limit} (prompt + completion); give fewer"
        )
    recs = read_prompts(args.prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    layer_ids = drafter.cfg.target_layer_ids if drafter is not None else []
    target = causal_lm_target(model, layer_ids, getattr(args, "forward", "auto"), pad)
    bs = max(1, args.batch_size)
    batches = [recs[lo : lo + bs] for lo in range(0, len(recs), bs)]

    def encode(batch: list[dict]) -> dict[str, torch.Tensor]:
        ids, mask = left_pad([chat_prompt_ids(tok, r["prompt"]) for r in batch], pad)
        return {"input_ids": ids, "attention_mask": mask}

    way = ""
    if drafter is not None:
        attach(drafter, target)
        first = encode(batches[0])  # priced as it will be decoded
        way, args.tree_budget = pick_spec(args, drafter, meta, target, first, sha)
        drafter = None if way == "none" else drafter
    lines, stats, n_tok, t0 = [], [], 0, time.perf_counter()
    for batch in batches:
        rows = decode_batch(target, drafter, encode(batch), args, sampling or {}, stats)
        for r, comp in zip(batch, rows, strict=True):
            n_tok += len(comp)
            text = tok.decode(comp, skip_special_tokens=True)
            lines.append(json.dumps({"id": r["id"], "prompt": r["prompt"], "completion": text}))
    seconds = time.perf_counter() - t0
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    if way:
        report(stats, seconds, n_tok, args.stats, way)
    return 0
