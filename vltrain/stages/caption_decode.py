"""Captioner from a config, batched caption decoding, BLEU/CIDEr-D scoring, `vltrain generate`.

Shared by the caption stage's evaluation and the `generate` command, so a checkpoint decodes
the same way in both places.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config, load_config
from vltrain.data import chat as C
from vltrain.data.images import BadSample, load_image
from vltrain.data.tokenizer import TextTokenizer
from vltrain.engine.checkpoint import load_weights, resolve_checkpoint
from vltrain.eval.caption_metrics import Bleu, CiderD, ptb_tokenize
from vltrain.inference.decoding import generate
from vltrain.models.captioner import Captioner
from vltrain.models.presets import vision_config


def build_captioner(cfg: Config, tokenizer: TextTokenizer) -> Captioner:
    """The captioner that `cfg.model` describes, sized for `tokenizer` and `data.max_text_len`."""
    m = cfg.model
    side = vision_config(m.vision).image_size
    if side != cfg.data.image_size:
        raise ConfigError(
            f"'data.image_size' is {cfg.data.image_size} but the '{m.vision}' vision preset "
            f"takes {side}x{side} images; set data.image_size={side}"
        )
    try:
        return Captioner.from_config(
            m.vision,
            m.text,
            vocab_size=tokenizer.vocab_size,
            connector=m.connector,
            connector_options=m.connector_options,
            max_text_len=cfg.data.max_text_len,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            pad_id=tokenizer.pad_id,
            dropout=m.dropout,
        )
    except ValueError as e:  # connector options and sizes are user config
        raise ConfigError(f"model.connector / model.connector_options: {e}") from None


def load_initial_weights(model: Captioner, ckpt: Path) -> None:
    """Load a checkpoint into `model`, explaining an architecture mismatch."""
    try:
        load_weights(model, ckpt)
    except RuntimeError as e:
        raise ConfigError(
            f"model.init_from={ckpt} does not fit this model ({str(e)[:300]}...); model.vision, "
            "model.text, model.connector(_options) and data.max_text_len must match the "
            "source run's config.yaml"
        ) from None


def load_vision_tower(model: Captioner, source: str) -> None:
    """Initialise `model.vision` from a contrastive run's image tower (`encoder.vision.*`)."""
    from safetensors.torch import load_file

    try:
        ckpt = resolve_checkpoint(source)
    except FileNotFoundError as e:
        raise ConfigError(f"model.vision_init_from: {e}") from None
    weights = load_file(str(ckpt / "model.safetensors"))
    prefix = "encoder.vision."
    tower = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
    if not tower:
        raise ConfigError(
            f"model.vision_init_from={ckpt} holds no {prefix}* weights: pass a "
            "checkpoint of the contrastive stage's built-in dual encoder"
        )
    try:
        model.vision.load_state_dict(tower, strict=True)
    except RuntimeError as e:
        raise ConfigError(
            f"model.vision_init_from={ckpt} does not fit model.vision "
            f"({str(e)[:200]}...): use the same model.vision preset"
        ) from None


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-padded (B, T) ids and mask: prompts end at the last column, as prefill wants."""
    t = max(len(r) for r in rows)
    ids = torch.full((len(rows), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), t), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, t - len(r) :] = torch.tensor(list(r))
            mask[i, t - len(r) :] = 1
    return ids, mask


def decode_captions(
    model: Captioner,
    tokenizer: TextTokenizer,
    images: Tensor,
    prompt_ids: Sequence[Sequence[int]],
    *,
    strategy: str = "greedy",
    num_beams: int = 3,
    max_new_tokens: int = 24,
    length_penalty: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[str]:
    """Captions for images (B, 3, S, S) continuing each prompt (``<bos>`` + prompt tokens)."""
    ids, mask = left_pad(prompt_ids, tokenizer.pad_id)
    room = model.max_text_len - ids.shape[1]
    if room < 1:
        raise ValueError(
            f"the prompt takes {ids.shape[1]} of the decoder's {model.max_text_len} text "
            "positions; shorten it or train with a larger data.max_text_len"
        )
    dev = images.device
    out = generate(
        model,
        {"images": images, "input_ids": ids.to(dev), "attention_mask": mask.to(dev)},
        strategy=strategy,
        max_new_tokens=min(max_new_tokens, room),
        num_beams=num_beams,
        length_penalty=length_penalty,
        generator=generator,
    )
    rows = [s[: int(n)].tolist() for s, n in zip(out.sequences, out.lengths, strict=True)]
    return tokenizer.decode_batch(rows)


def caption_scores(hyps: Mapping[Any, str], refs: Mapping[Any, Sequence[str]]) -> dict[str, float]:
    """BLEU-1/4 and CIDEr-D (pycocoevalcap numbers) after PTB tokenization."""
    if not refs:
        return {}
    keys = sorted(refs)
    gts = ptb_tokenize({k: list(refs[k]) for k in keys})
    res = ptb_tokenize({k: [hyps[k]] for k in keys})
    bleu, _ = Bleu(4).compute_score(gts, res)
    cider, _ = CiderD().compute_score(gts, res)
    return {"BLEU-1": float(bleu[0]), "BLEU-4": float(bleu[3]), "CIDEr-D": float(cider)}


# ----------------------------------------------------------------------------- vltrain generate


def generation_prompt(cfg: Config, text: str | None) -> list[C.Segment]:
    """The prompt a run of `cfg` was trained with: its caption prompt, or a chat user turn."""
    if cfg.caption.mode == "sft":
        user = text if text is not None else cfg.caption.instruction
        return [(f"{C.USER} {user}", False), (C.ASSISTANT, False)]
    text = cfg.caption.prompt if text is None else text
    return [(text, False)] if text else []


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
    if bool(args.images) == bool(args.eval_data):
        raise ConfigError("vltrain generate needs exactly one of --images or --eval-data")
    model, tok, cfg = load_for_generation(args.checkpoint, args.config)
    if args.eval_data:
        decode = {"strategy": args.strategy, "num_beams": args.beams}
        decode["max_new_tokens"] = args.max_new_tokens
        scores = score_records(model, tok, cfg, args.eval_data, args.batch_size, **decode)
        print(json.dumps(scores))
        return 0
    prompt = C.encode_prompt(tok, generation_prompt(cfg, args.prompt))
    paths = list(args.images)
    rows: dict[int, dict[str, str]] = {}
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
        caps = decode_captions(
            model,
            tok,
            torch.stack(images),
            [prompt] * len(good),
            strategy=args.strategy,
            num_beams=args.beams,
            max_new_tokens=args.max_new_tokens,
        )
        rows.update({i: {"image": paths[i], "caption": c} for i, c in zip(good, caps, strict=True)})
    lines = [json.dumps(rows[i]) for i in range(len(paths))]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {len(lines)} captions to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_generate_options(p: Any) -> None:
    """Arguments of `vltrain generate` (argparse parser)."""
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoints/ or step folder")
    p.add_argument("--images", nargs="*", default=[], help="image files to caption")
    p.add_argument("--eval-data", default="", help="instead: score BLEU/CIDEr-D on a caption file")
    p.add_argument("--strategy", default="greedy", choices=("greedy", "beam", "sample"))
    p.add_argument("--beams", type=int, default=5, help="beam width (--strategy beam)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="longest caption in tokens")
    p.add_argument("--prompt", default=None, help="prompt text (sft: the user turn)")
    p.add_argument("--batch-size", type=int, default=16, help="images decoded together")
    p.add_argument("--seed", type=int, default=0, help="seed for --strategy sample")
    p.add_argument("--config", default="", help="run config (default: the checkpoint's run)")
    p.add_argument("--out", default="", help="write JSON lines here instead of stdout")
