"""`vltrain generate --checkpoint RUN` for caption runs of the HF VLM kinds (``hf_vlm``,
``llava``; LoRA runs included, rl runs load as the captioner they are).

The run is rebuilt by `tools.loading.load_trained` (its processor folder, its weights, LoRA
injected as it trained) and prompts are built by the run's own collate: the image, then the
run's prompt (``caption.instruction`` for sft runs, ``caption.prompt`` otherwise) or
``--prompt``. Decoding is the caption stage's own: the one decoder loop over the
``HFVLMTarget`` that `inference.vlm_captioning.caption_target` makes of the model, so greedy
captions are the stage's evaluation captions and the exported folder's plain-transformers
``generate`` token for token (tests/stages/test_caption_hf.py). ``--eval-data`` scores a
caption file (BLEU/CIDEr-D); ``--draft`` decodes speculatively (greedy, lossless) with a
drafter trained for this run.
"""

from __future__ import annotations

import json
import time
from typing import Any

from vltrain.config.core import ConfigError
from vltrain.core.files import check_not_input, check_output_path
from vltrain.data.hf_collate import to_pil
from vltrain.data.images import BadSample
from vltrain.eval.caption_metrics import caption_scores
from vltrain.inference.vlm_captioning import caption_target, prompt_inputs
from vltrain.inference.vlm_target import vlm_run
from vltrain.tools.generate_vlm import load_draft, write_rows
from vltrain.tools.loading import load_trained
from vltrain.tools.speculate import decode_batch


def is_vlm_run(checkpoint: str) -> bool:
    """Whether ``checkpoint`` (a run dir, checkpoints/ or a step folder) is a caption or rl run
    of an HF VLM kind (by its run's config.yaml)."""
    return bool(checkpoint) and vlm_run(checkpoint) is not None


def vlm_run_command(args: Any, sampling: dict[str, Any]) -> int:
    """Caption ``args.images`` (JSON lines) or score ``args.eval_data`` with a VLM caption run."""
    if bool(args.images) == bool(args.eval_data):
        raise ConfigError("vltrain generate needs exactly one of --images or --eval-data")
    if args.draft and args.eval_data:
        raise ConfigError("--draft captions --images; drop it with --eval-data")
    if args.config:
        raise ConfigError(
            f"--config is for built-in captioner runs; {args.checkpoint} (model.kind hf_vlm or "
            "llava) is rebuilt from its own config.yaml: drop --config"
        )
    if args.out:
        check_output_path(args.out)
        check_not_input(args.out, [*args.images, *([args.eval_data] if args.eval_data else [])])
    cfg, stage, model = load_trained(args.checkpoint)
    if cfg.stage not in ("caption", "rl"):
        raise ConfigError(f"{args.checkpoint} is a '{cfg.stage}' run, not a caption or rl run")
    core = stage.core
    pad = core.tokenizer.pad_token_id if core.tokenizer.pad_token_id is not None else 0
    drafter, meta = load_draft(args)
    if drafter is not None:
        from vltrain.models import dflash_format
        from vltrain.tools.speculate import attach

        dflash_format.check_verifier(meta, model.base_model(), args.draft)
    target = caption_target(model, pad, drafter.cfg.target_layer_ids if drafter else ())
    if drafter is not None:
        attach(drafter, target)
    if args.eval_data:
        ds = core.dataset(args.eval_data, train=False)
        samples = [ds[i] for i in range(len(ds))]
    else:
        samples, rows = _image_samples(args.images, caption_chat(cfg, args.prompt))
    hyps: dict[int, str] = {}
    stats: list[Any] = []
    n_tok, t0 = 0, time.perf_counter()
    for start in range(0, len(samples), args.batch_size):
        good = [s for s in samples[start : start + args.batch_size] if "bad" not in s]
        if not good:
            continue
        batch = core.collate(good)
        inputs = prompt_inputs(model, batch["images"], batch["prompt_ids"], pad)
        _check_room(target, inputs["input_ids"].shape[1], args.max_new_tokens)
        seqs = decode_batch(target, drafter, inputs, args, sampling, stats)
        n_tok += sum(map(len, seqs))
        caps = [c.strip() for c in core.tokenizer.batch_decode(seqs, skip_special_tokens=True)]
        hyps.update({s["index"]: c for s, c in zip(good, caps, strict=True)})
    if args.eval_data:
        refs = {s["index"]: s["refs"] for s in samples if "bad" not in s}
        print(json.dumps({**caption_scores(hyps, refs), "n_images": float(len(refs))}))
        return 0
    rows.update({i: {"image": args.images[i], "caption": c} for i, c in hyps.items()})
    write_rows(rows, len(args.images), args.out)
    if drafter is not None:
        from vltrain.tools.speculate import report

        report(stats, time.perf_counter() - t0, n_tok, args.stats)
    return 0


def caption_chat(cfg: Any, prompt: str | None) -> list[dict[str, str]]:
    """The chat the collate builds a captioning prompt from: the user turn (`prompt`, else the
    run's caption.instruction for sft runs, caption.prompt otherwise), then a placeholder
    assistant turn the prompt stops before."""
    c = cfg.caption
    user = prompt if prompt is not None else (c.instruction if c.mode == "sft" else c.prompt)
    return [{"role": "user", "content": user}, {"role": "assistant", "content": "-"}]


def _image_samples(
    paths: list[str], chat: list[dict[str, str]]
) -> tuple[list[dict[str, Any]], dict[int, dict[str, str]]]:
    """Collate samples of image files (with `caption_chat`'s chat) and error rows of
    unreadable ones."""
    samples: list[dict[str, Any]] = []
    rows: dict[int, dict[str, str]] = {}
    for i, path in enumerate(paths):
        try:
            samples.append({"image": to_pil(path), "messages": chat, "index": i, "refs": ["-"]})
        except BadSample as e:
            rows[i] = {"image": path, "error": e.reason, "detail": e.detail}
            samples.append({"bad": e.reason, "index": i})
    return samples, rows


def _check_room(target: Any, prompt_len: int, max_new_tokens: int) -> None:
    room = target.room(prompt_len)
    if room is not None and max_new_tokens > room:
        raise ConfigError(
            f"--max-new-tokens {max_new_tokens} does not fit the run's model: the prompt takes "
            f"{prompt_len} of its {target.max_positions} positions; give at most {max(room, 0)}"
        )
