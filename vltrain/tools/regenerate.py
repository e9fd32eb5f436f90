"""`vltrain data regenerate`: make the target answer a dataset's prompts (drafter training data).

A drafter must predict the target, not the dataset: this writes the target's own answers.

- HF causal LM (``--model DIR_OR_GGUF``): prompts JSONL (``{"prompt", "id"?}``) -> one line per
  prompt ``{"id", "prompt", "completion", "completion_ids"}`` (the exact generated ids, EOS
  included when generated), the prompt wrapped in the tokenizer's chat template.
- Captioner (``--checkpoint RUN``): caption records -> ``{"id", "image", "text"}`` with the
  target's caption; written next to the source file so image paths stay valid.

Batched (left-padded prompts), greedy or sampled (``--strategy sample``, the generator seeded
per batch from ``--seed`` and its first record's id). Resumable, exactly: ids already in the
output are skipped and new lines appended (flushed each batch); the batches are those of an
uninterrupted run, and one that a kill cut short is decoded whole again, so a resumed run
writes the answers an uninterrupted one would (sampled ones included; the same
``--batch-size`` and ``--world-size``: they decide the batches). Sharded: with
``--world-size W`` (or the RANK / WORLD_SIZE of torchrun) rank r answers records r, r + W,
... into ``OUT.rank{r}``.
``--device auto`` puts the target on ``cuda:LOCAL_RANK`` when CUDA is available (else the CPU);
sampled answers then draw from a generator on that device (so they differ from a CPU run's).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import torch

from vltrain.config.core import ConfigError
from vltrain.core.files import check_not_input, check_output_path
from vltrain.data.draft_data import chat_prompt_ids, read_prompts, require_chat_template
from vltrain.engine.runtime import resolve_device
from vltrain.inference.captioner_target import load_captioner
from vltrain.inference.captioning import decode_captions, left_pad
from vltrain.inference.decoding import generate
from vltrain.inference.hf_target import load_hf_causal_lm
from vltrain.inference.native_llama import causal_lm_target


def _done_ids(out: Path) -> set[str]:
    if not out.is_file():
        return set()
    ids = set()
    for line in out.read_text().splitlines():
        try:
            ids.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut by a kill: answered again
    return ids


def _drop_cut_line(out: Path) -> None:
    """A kill while a line was written leaves it without its newline: it goes (answered again),
    else the resumed run's first line would be appended to it and both lost."""
    if not out.is_file() or out.stat().st_size == 0:
        return
    with out.open("r+b") as f:
        f.seek(-1, 2)
        if f.read(1) != b"\n":  # only then is the whole file read
            f.seek(0)
            f.truncate(f.read().rfind(b"\n") + 1)


def _shard(out: Path, rank: int, world: int) -> Path:
    return out if world == 1 else out.with_name(f"{out.name}.rank{rank}")


def _answer_lm(model: Any, tok: Any, recs: list[dict], args: Any) -> list[dict]:
    pad = tok.pad_token_id or tok.eos_token_id
    target = causal_lm_target(model, [], getattr(args, "forward", "auto"), pad)
    ids, mask = left_pad([chat_prompt_ids(tok, r["prompt"]) for r in recs], target.pad_token_id)
    dev = next(model.parameters()).device
    ids, mask = ids.to(dev), mask.to(dev)
    g = torch.Generator(device=dev).manual_seed(
        args.seed * 1_000_003 + zlib.crc32(str(recs[0]["id"]).encode())
    )
    out = generate(
        target,
        {"input_ids": ids, "attention_mask": mask},
        args.strategy,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        generator=g,
    )
    rows = []
    for r, seq, n in zip(recs, out.sequences, out.lengths, strict=True):
        comp = seq[: int(n)].tolist()
        text = tok.decode(comp, skip_special_tokens=True)
        rows.append(
            {"id": r["id"], "prompt": r["prompt"], "completion": text, "completion_ids": comp}
        )
    return rows


def regenerate(args: Any) -> int:
    """Answer every record not yet in the output; returns how many were written now."""
    rank = int(os.environ.get("RANK", args.rank))
    world = int(os.environ.get("WORLD_SIZE", args.world_size))
    if not 0 <= rank < world:
        raise ConfigError(f"--rank {rank} is not one of the {world} shards (0..{world - 1})")
    out = _shard(Path(args.out), rank, world)
    check_output_path(str(out), "--out")
    check_not_input(str(out), [args.data], "--out")
    done = _done_ids(out)
    if bool(args.model) == bool(args.checkpoint):
        raise ConfigError("vltrain data regenerate needs exactly one of --model or --checkpoint")
    dev = resolve_device(getattr(args, "device", "auto"), "--device")
    if args.model:
        recs = read_prompts(args.data)
        model, tok = load_hf_causal_lm(args.model)
        require_chat_template(tok, args.model)
        limit = getattr(model.config, "max_position_embeddings", None)
        if isinstance(limit, int) and args.max_new_tokens >= limit:
            raise ConfigError(
                f"--max-new-tokens {args.max_new_tokens} does not fit {args.model}: its "
                f"max_position_embeddings is {limit} (prompt + completion); give fewer"
            )
        model = model.to(dev)
    else:
        model, tok, cfg = load_captioner(args.checkpoint)
        model = model.to(dev)
        if Path(args.out).resolve().parent != Path(args.data).resolve().parent:
            raise ConfigError(
                "captioner regenerate writes next to --data (image paths are relative)"
            )
        recs = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()]
        for i, r in enumerate(recs):
            r.setdefault("id", str(i))
    mine = [r for i, r in enumerate(recs) if i % world == rank]
    todo = [r for r in mine if str(r["id"]) not in done]
    torch.manual_seed(args.seed)
    _drop_cut_line(out)
    with out.open("a") as f:
        # the batches of an uninterrupted run, whatever is done: a batch cut by a kill is
        # decoded whole again (its sampled draws and padding are the batch's), its missing
        # lines written
        for lo in range(0, len(mine), args.batch_size):
            batch = mine[lo : lo + args.batch_size]
            if all(str(r["id"]) in done for r in batch):
                continue
            rows = (
                _answer_lm(model, tok, batch, args)
                if args.model
                else _answer_captions(model, tok, cfg, batch, args)
            )
            for row in rows:
                if str(row["id"]) not in done:
                    f.write(json.dumps(row) + "\n")
            f.flush()
    print(f"regenerated {len(todo)} records into {out} ({len(done)} were there)", file=sys.stderr)
    return len(todo)


def _answer_captions(model: Any, tok: Any, cfg: Any, recs: list[dict], args: Any) -> list[dict]:
    from vltrain.data.images import load_image

    folder = Path(args.data).resolve().parent
    dev = next(model.parameters()).device
    images = torch.stack([load_image(str(folder / r["image"]), cfg.data.image_size) for r in recs])
    images = images.to(dev)
    prompt = [tok.bos_id] + (tok.encode(cfg.caption.prompt) if cfg.caption.prompt else [])
    g = torch.Generator(device=dev).manual_seed(args.seed)
    caps = decode_captions(
        model,
        tok,
        images,
        [prompt] * len(recs),
        strategy=args.strategy,
        max_new_tokens=args.max_new_tokens,
        generator=g,
    )
    return [
        {"id": r["id"], "image": r["image"], "text": c} for r, c in zip(recs, caps, strict=True)
    ]
