"""`vltrain generate`: caption image files with a trained captioner, or score a caption file."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config, load_config
from vltrain.core.checkpoint import load_weights, resolve_checkpoint
from vltrain.core.files import atomic_write_text, check_not_input, check_output_path
from vltrain.data import chat
from vltrain.data.images import BadSample, load_image
from vltrain.data.tokenizer import TextTokenizer, require_tokenizer
from vltrain.eval.caption_metrics import caption_scores
from vltrain.inference.captioning import decode_captions
from vltrain.models.backbones import build_captioner
from vltrain.models.captioner import Captioner


def generation_prompt(cfg: Config, text: str | None) -> list[chat.Segment]:
    """The prompt a run of `cfg` was trained with: its caption prompt, or a chat user turn."""
    if cfg.caption.mode == "sft":
        user = text if text is not None else cfg.caption.instruction
        return [(f"{chat.USER} {user}", False), (chat.ASSISTANT, False)]
    text = cfg.caption.prompt if text is None else text
    return [(text, False)] if text else []


def sampling_options(args: Any) -> dict[str, Any]:
    """``temperature``, ``top_k``, ``top_p`` of the command line (defaults: no warping), refused
    unless ``--strategy sample`` uses them."""
    given = {
        "--temperature": args.temperature,
        "--top-k": args.top_k,
        "--top-p": args.top_p,
    }
    named = [flag for flag, value in given.items() if value is not None]
    if named and args.strategy != "sample":
        raise ConfigError(
            f"{', '.join(named)} apply to --strategy sample only (got --strategy "
            f"{args.strategy}); add --strategy sample or drop them"
        )
    return {
        "temperature": 1.0 if args.temperature is None else args.temperature,
        "top_k": 0 if args.top_k is None else args.top_k,
        "top_p": 1.0 if args.top_p is None else args.top_p,
    }


def load_for_generation(
    checkpoint: str, config: str = ""
) -> tuple[Captioner, TextTokenizer, Config]:
    """Model, tokenizer and run config of a caption checkpoint (its run's config.yaml)."""
    ckpt = resolve_checkpoint(checkpoint)
    cfg_path = Path(config) if config else ckpt.parent.parent / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"no config.yaml for {ckpt} (looked at {cfg_path}); pass --config RUN/config.yaml"
        )
    cfg = load_config(cfg_path)
    if cfg.stage not in ("caption", "rl"):
        raise ConfigError(f"{cfg_path} is a '{cfg.stage}' run, not a caption or rl run")
    require_tokenizer(ckpt / "tokenizer")
    tokenizer = TextTokenizer.load(ckpt / "tokenizer")
    model = build_captioner(cfg, tokenizer)
    load_weights(model, ckpt)
    return model.eval(), tokenizer, cfg


def score_records(
    model: Captioner, tok: TextTokenizer, cfg: Config, path: str, batch_size: int, **decode: Any
) -> dict[str, float]:
    """BLEU/CIDEr-D of a checkpoint on a caption file (single process, all references)."""
    from vltrain.data.caption_data import CaptionDataset, read_caption_source
    from vltrain.data.records import split_bad

    d, c = cfg.data, cfg.caption
    ds = CaptionDataset(
        read_caption_source(path, d.image_column, d.text_column),
        tok,
        image_size=d.image_size,
        max_len=d.max_text_len,
        seed=cfg.run.seed,
        mode=c.mode,
        prompt=c.prompt,
        instruction=c.instruction,
        train=False,
    )
    hyps: dict[int, str] = {}
    refs: dict[int, list[str]] = {}
    for start in range(0, len(ds), batch_size):
        good, _ = split_bad([ds[i] for i in range(start, min(start + batch_size, len(ds)))])
        if not good:
            continue
        images = torch.stack([s["image"] for s in good])  # (b, 3, S, S)
        caps = decode_captions(model, tok, images, [s["prompt_ids"] for s in good], **decode)
        for s, cap in zip(good, caps, strict=True):
            hyps[s["index"]], refs[s["index"]] = cap, s["refs"]
    return {**caption_scores(hyps, refs), "n_images": float(len(refs))}


def generate_command(args: Any) -> int:
    """`vltrain generate`: caption image files (JSON lines), or score a caption file."""
    torch.manual_seed(args.seed)
    sampling = sampling_options(args)
    if getattr(args, "spec", "auto") != "auto" and not args.draft:
        raise ConfigError(
            f"--spec {args.spec} chooses how --draft decodes: give --draft or drop it"
        )
    if args.draft and args.strategy != "greedy":
        raise ConfigError("--draft decodes greedily (lossless); drop --strategy")
    if args.model:
        from vltrain.inference.vlm_target import is_hf_vlm
        from vltrain.tools.speculate import lm_command

        if is_hf_vlm(args.model):
            from vltrain.tools.generate_vlm import vlm_command

            return vlm_command(args, sampling)
        if not args.prompts and args.images:
            raise ConfigError(
                f"--images captions with an image-text-to-text model, and --model {args.model} "
                "is none (a folder whose config.json names a VLM); an LM decodes --prompts "
                "FILE.jsonl"
            )
        if not args.prompts:
            raise ConfigError("vltrain generate --model needs --prompts FILE.jsonl")
        return lm_command(args, sampling)
    if not args.checkpoint:
        raise ConfigError("vltrain generate needs --checkpoint (a captioner) or --model (an LM)")
    from vltrain.tools.generate_vlm_run import is_vlm_run, vlm_run_command

    if is_vlm_run(args.checkpoint):
        return vlm_run_command(args, sampling)
    if bool(args.images) == bool(args.eval_data):
        raise ConfigError("vltrain generate needs exactly one of --images or --eval-data")
    if args.out:
        check_output_path(args.out)
        check_not_input(args.out, [*args.images, *([args.eval_data] if args.eval_data else [])])
    model, tok, cfg = load_for_generation(args.checkpoint, args.config)
    if args.eval_data:
        decode = {"strategy": args.strategy, "num_beams": args.beams, **sampling}
        decode["max_new_tokens"] = args.max_new_tokens
        scores = score_records(model, tok, cfg, args.eval_data, args.batch_size, **decode)
        print(json.dumps(scores))
        return 0
    prompt = chat.encode_prompt(tok, generation_prompt(cfg, args.prompt))
    paths = list(args.images)
    rows: dict[int, dict[str, str]] = {}
    drafter, stats, t0 = None, [], time.perf_counter()
    if args.draft:
        from vltrain.models.drafter import check_target_config, run_config_sha256
        from vltrain.models.drafter_checkpoint import load_drafter
        from vltrain.tools.speculate import caption_speculative, pick_spec, report

        drafter, meta = load_drafter(args.draft)
        check_target_config(meta, run_config_sha256(cfg), args.draft)
        spec = getattr(args, "spec", "auto")  # a captioner's auto decodes as asked
        if spec != "auto":
            args.tree_budget = pick_spec(args, drafter, meta, None, {}, "")[1]
            drafter = None if spec == "none" else drafter
    for start in range(0, len(paths), args.batch_size):
        good, images = [], []
        for i in range(start, min(start + args.batch_size, len(paths))):
            try:
                images.append(load_image(paths[i], cfg.data.image_size))
                good.append(i)
            except BadSample as e:
                rows[i] = {"image": paths[i], "error": e.reason, "detail": e.detail}
        if not good:
            continue
        if drafter is not None:
            caps = caption_speculative(
                model, tok, torch.stack(images), prompt, args, drafter, stats
            )
        else:
            caps = decode_captions(
                model,
                tok,
                torch.stack(images),
                [prompt] * len(good),
                strategy=args.strategy,
                num_beams=args.beams,
                max_new_tokens=args.max_new_tokens,
                **sampling,
            )
        rows.update({i: {"image": paths[i], "caption": c} for i, c in zip(good, caps, strict=True)})
    lines = [json.dumps(rows[i]) for i in range(len(paths))]
    text = "\n".join(lines) + "\n"
    if args.out:
        atomic_write_text(args.out, text)
        print(f"wrote {len(lines)} captions to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if drafter is not None:
        n_tok = sum(len(tok.encode(r.get("caption", ""))) for r in rows.values())
        report(stats, time.perf_counter() - t0, n_tok, args.stats)
    return 0
