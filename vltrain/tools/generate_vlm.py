"""`vltrain generate --model VLM_DIR --images ...`: caption image files with an HF
image-text-to-text model directory (``AutoModelForImageTextToText``), through `HFVLMTarget`.

Prompts are the model's chat template with the image then ``--prompt`` (the user turn), built by
``data.hf_collate.HFCollate`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA: the families whose image
tokens it expands without torchvision), left-padded. Every batch is prepared (and the prompt
length checked against the model's positions) before the first is decoded; output lines are
``{"image", "caption"}`` (or ``{"image", "error", "detail"}`` for an unreadable file), as for a
captioner. ``--draft`` decodes speculatively (greedy, lossless) with a drafter of this model.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from vltrain.config.core import ConfigError
from vltrain.core.files import atomic_write_text, check_not_input, check_output_path
from vltrain.data.hf_collate import HFCollate, to_pil
from vltrain.data.images import BadSample
from vltrain.inference.vlm_target import HFVLMTarget, load_hf_vlm, max_positions, vlm_inputs
from vltrain.tools.speculate import decode_batch

DEFAULT_PROMPT = "describe the image."  # caption.instruction's default (a drafter's prompts)


def vlm_command(args: Any, sampling: dict[str, Any]) -> int:
    """Caption ``args.images`` with the HF VLM ``args.model`` (JSON lines; module doc)."""
    if args.prompts or args.eval_data:
        raise ConfigError(
            f"{args.model} is an image-text-to-text model: caption --images with it "
            "(--prompts is for causal LMs, --eval-data for captioner runs)"
        )
    if not args.images:
        raise ConfigError(f"vltrain generate --model {args.model} needs --images FILE ...")
    if args.out:
        check_output_path(args.out)
        check_not_input(args.out, list(args.images))
    from transformers import AutoTokenizer

    collate = HFCollate(args.model, "vlm")
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    paths = list(args.images)
    rows: dict[int, dict[str, str]] = {}
    batches = _batches(args, collate, paths, rows)
    _check_room(args, max((b[1]["input_ids"].shape[1] for b in batches), default=0))
    drafter, meta = load_draft(args)
    model = load_hf_vlm(args.model)
    if drafter is not None:
        from vltrain.models import dflash_format

        dflash_format.check_verifier(meta, model, args.draft)
    target = HFVLMTarget(model, drafter.cfg.target_layer_ids if drafter is not None else ())
    if drafter is not None:
        from vltrain.tools.speculate import attach

        attach(drafter, target)
    stats, n_tok, t0 = [], 0, time.perf_counter()
    for good, inputs in batches:
        seqs = decode_batch(target, drafter, inputs, args, sampling, stats)
        n_tok += sum(map(len, seqs))
        caps = [c.strip() for c in tok.batch_decode(seqs, skip_special_tokens=True)]
        rows.update({i: {"image": paths[i], "caption": c} for i, c in zip(good, caps, strict=True)})
    write_rows(rows, len(paths), args.out)
    if drafter is not None:
        from vltrain.tools.speculate import report

        report(stats, time.perf_counter() - t0, n_tok, args.stats)
    return 0


def write_rows(rows: dict[int, dict[str, str]], n: int, out: str) -> None:
    """The captions as JSON lines in image order: to `out` (atomically) or to stdout."""
    text = "".join(json.dumps(rows[i]) + "\n" for i in range(n))
    if out:
        atomic_write_text(out, text)
        print(f"wrote {n} captions to {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _batches(
    args: Any, collate: HFCollate, paths: list[str], rows: dict[int, dict[str, str]]
) -> list[tuple[list[int], dict[str, Any]]]:
    """(image indices, left-padded inputs) of every batch; unreadable images go to ``rows``."""
    prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    batches = []
    for start in range(0, len(paths), args.batch_size):
        good, pils = [], []
        for i in range(start, min(start + args.batch_size, len(paths))):
            try:
                pils.append(to_pil(paths[i]))
                good.append(i)
            except BadSample as e:
                rows[i] = {"image": paths[i], "error": e.reason, "detail": e.detail}
        if good:
            try:  # HFCollate checks the model family and its chat template
                batches.append((good, vlm_inputs(collate, pils, prompt)))
            except ValueError as e:
                raise ConfigError(str(e)) from None
    return batches


def load_draft(args: Any) -> tuple[Any, dict]:
    """The ``--draft`` drafter and its metadata (None, {} without one)."""
    if not args.draft:
        return None, {}
    from vltrain.models.drafter_checkpoint import load_drafter

    return load_drafter(args.draft)


def _check_room(args: Any, prompt_len: int) -> None:
    """Refuse a caption length past the model's positions (prompt + caption), before loading."""
    from transformers import AutoConfig

    limit = max_positions(AutoConfig.from_pretrained(args.model, local_files_only=True))
    if limit is not None and prompt_len + args.max_new_tokens > limit:
        raise ConfigError(
            f"--max-new-tokens {args.max_new_tokens} does not fit {args.model}: the longest "
            f"prompt takes {prompt_len} of its {limit} positions (max_position_embeddings); "
            f"give at most {max(limit - prompt_len, 0)}"
        )
