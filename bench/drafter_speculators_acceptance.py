"""Acceptance of an exported drafter as speculators loads it, against vltrain's on the same prompts.

Run in the bench venv that has `speculators` 0.9.0 (docs/drafters.md, "Export to vLLM / SGLang"):

    PYTHONPATH=. python bench/drafter_speculators_acceptance.py --export EXPORT --model TARGET

EXPORT is a `vltrain export RUN --format speculators` folder, TARGET the HF folder of its
target (the export names it by a path relative to itself). Two decodings of the same prompts
(bench_drafter's 16 timing prompts by default), greedy, batch 1, a chain of block - 1 drafts:

- vltrain: `vltrain generate --model TARGET --prompts P --draft EXPORT --spec chain --stats S`,
  the command a user runs (the import path: vltrain reads the speculators checkpoint);
- the consumer: the drafts come from speculators' own `DFlashDraftModel.from_pretrained(EXPORT)`
  (its `_backbone_forward`, one anchor per round: the round's first token, fed the target's
  `hidden_states[id]` of every earlier position for its `aux_hidden_state_layer_ids`), verified by
  a loop written here on the consumer's target (transformers' forward over the whole sequence
  each round, no cache): the drafts agreeing with the target's argmax are kept, then the target's
  own next token (the rule vLLM's greedy verification applies).

Per prompt the two must give the same tokens per round (accepted drafts + 1) and the same
completion; the consumer's completion must equal transformers' greedy `generate`. No timing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def load_consumer(export: Path):
    """speculators' model of the export (read from inside it: the verifier path is relative)."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    old = os.getcwd()
    os.chdir(export)
    try:
        config = DFlashSpeculatorConfig.from_pretrained(".")
        config.transformer_layer_config._attn_implementation = "eager"  # CPU, no compile
        return DFlashDraftModel.from_pretrained(".", config=config).eval()
    finally:
        os.chdir(old)


@torch.no_grad()
def consumer_drafts(drafter, hidden: tuple, ids: list[int], anchor: int) -> list[int]:
    """block - 1 greedy drafts after ``anchor`` (at position len(ids)) from speculators' forward,
    the context being the target's ``hidden`` states of ``ids``."""
    k = drafter.block_size
    p = len(ids)
    total = p + 1 + k  # select_anchors never picks the last block: the anchor needs k after it
    feats = torch.cat([hidden[i] for i in drafter.config.aux_hidden_state_layer_ids], -1)
    ctx = torch.zeros(1, total, feats.shape[-1])
    ctx[:, :p] = feats[:, :p]  # only the positions before the anchor are known when drafting
    seq = torch.tensor([ids + [anchor] + [drafter.mask_token_id] * k])
    loss_mask = torch.zeros(1, total)
    loss_mask[0, p] = 1  # the one anchor
    width = hidden[0].shape[-1]
    _, logits, _, _, _ = drafter._backbone_forward(
        ctx,
        seq,
        loss_mask,
        torch.zeros(1, total, width),
        torch.zeros(1, total, dtype=torch.long),
        max_anchors=1,
    )
    slots = logits[0].view(k, -1)
    shift = 1 if drafter.config.sample_from_anchor else 0  # the slot that drafts anchor + j
    best = slots[1 - shift : k - shift].argmax(-1)
    if getattr(drafter, "d2t", None) is not None:
        best = best + drafter.d2t[best]
    return best.tolist()


@torch.no_grad()
def consumer_decode(
    target, drafter, prompt: list[int], max_new: int, stops: set[int]
) -> tuple[list[int], list[int]]:
    """(completion, tokens per round) of chain speculative decoding with the consumer's drafts."""
    out = target(torch.tensor([prompt]), output_hidden_states=True)
    root = int(out.logits[0, -1].argmax())
    new, rounds = [root], []
    done = root in stops or max_new <= 1
    while not done:
        ctx = prompt + new[:-1]  # the anchor (new[-1]) has not been through the target yet
        drafts = consumer_drafts(drafter, out.hidden_states, ctx, new[-1])
        seq = ctx + [new[-1]] + drafts
        out = target(torch.tensor([seq]), output_hidden_states=True)
        choice = out.logits[0, len(ctx) :].argmax(-1).tolist()  # after the anchor, each draft
        a = 0
        while a < len(drafts) and drafts[a] == choice[a]:
            a += 1
        rounds.append(a + 1)
        for t in drafts[:a] + [choice[a]]:
            new.append(t)
            if t in stops or len(new) >= max_new:
                done = True
                break
        # the next round's context (prompt + new[:-1]) is this forward's prefix: causal, so its
        # states do not see the rejected drafts after it (consumer_drafts reads that prefix)
    return new, rounds


def prompt_ids(tok, prompt: str) -> list[int]:
    """The chat template's user turn + generation prompt, as `vltrain generate` encodes it."""
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def flipped_control(export: Path, target, tok, prompts, ours: dict, args, stops) -> dict:
    """The negative control: the export with ``sample_from_anchor`` flipped, read by the consumer
    (vltrain refuses such a checkpoint), must accept differently from vltrain on some prompt:
    the comparison above can fail."""
    import shutil

    if not prompts:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / export.name
        shutil.copytree(export, copy)
        cfg = json.loads((copy / "config.json").read_text())
        cfg["sample_from_anchor"] = not cfg["sample_from_anchor"]
        verifier = cfg["speculators_config"]["verifier"]  # a relative path: from the export
        verifier["name_or_path"] = str((export / verifier["name_or_path"]).resolve())
        (copy / "config.json").write_text(json.dumps(cfg, indent=1))
        drafter = load_consumer(copy)
        taus = []
        for q in prompts:
            _, rounds = consumer_decode(target, drafter, prompt_ids(tok, q), args.max_new, stops)
            taus.append(sum(rounds) / max(len(rounds), 1))
    theirs = ours["stats"]["row_tau"][: len(prompts)]
    return {
        "prompts": len(prompts),
        "flipped_consumer_row_tau": taus,
        "vltrain_row_tau": theirs,
        "detected": any(a != b for a, b in zip(taus, theirs, strict=True)),
    }


def vltrain_decode(model: str, export: Path, prompts: list[str], max_new: int, tmp: Path) -> dict:
    """`vltrain generate ... --draft EXPORT --spec chain` as a user runs it: lines and stats."""
    src = tmp / "prompts.jsonl"
    src.write_text(
        "".join(json.dumps({"id": i, "prompt": q}) + "\n" for i, q in enumerate(prompts))
    )
    cmd = [sys.executable, "-m", "vltrain", "generate", "--model", model, "--prompts", str(src)]
    cmd += ["--max-new-tokens", str(max_new), "--batch-size", "1", "--draft", str(export)]
    cmd += ["--spec", "chain", "--stats", str(tmp / "stats.json"), "--out", str(tmp / "out.jsonl")]
    subprocess.run(cmd, check=True)
    lines = [json.loads(x) for x in (tmp / "out.jsonl").read_text().splitlines()]
    return {"stats": json.loads((tmp / "stats.json").read_text()), "lines": lines}


def main() -> int:
    import transformers
    from bench_drafter import timing_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", required=True, help="a vltrain export --format speculators folder")
    p.add_argument("--model", required=True, help="the target's HF folder")
    p.add_argument("--max-new", type=int, default=96)
    p.add_argument("--prompts", type=int, default=16, help="the first N timing prompts")
    p.add_argument("--out", default="", help="write the comparison as JSON here")
    p.add_argument(
        "--control",
        type=int,
        default=4,
        help="prompts decoded by the negative control (sample_from_anchor flipped; 0: none)",
    )
    args = p.parse_args()
    export = Path(args.export).resolve()
    prompts = timing_prompts()[: args.prompts]
    with tempfile.TemporaryDirectory() as tmp:
        ours = vltrain_decode(args.model, export, prompts, args.max_new, Path(tmp))
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    target = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    drafter = load_consumer(export)
    eos = target.generation_config.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for i, q in enumerate(prompts):
        ids = prompt_ids(tok, q)
        new, rounds = consumer_decode(target, drafter, ids, args.max_new, stops)
        ref = target.generate(
            torch.tensor([ids]), max_new_tokens=args.max_new, do_sample=False, num_beams=1
        )[0, len(ids) :].tolist()
        ref = ref[: next((j + 1 for j, t in enumerate(ref) if t in stops), len(ref))]
        tau = sum(rounds) / max(len(rounds), 1)
        row = {
            "prompt": q,
            "consumer_tau": tau,
            "vltrain_tau": ours["stats"]["row_tau"][i],
            "rounds": len(rounds),
            "same_completion": tok.decode(new, skip_special_tokens=True)
            == ours["lines"][i]["completion"],
            "consumer_equals_greedy": new == ref,
        }
        rows.append(row)
        print(json.dumps(row))
    control = flipped_control(export, target, tok, prompts[: args.control], ours, args, stops)
    n_c = sum(r["consumer_tau"] * r["rounds"] for r in rows)
    total_rounds = sum(r["rounds"] for r in rows)
    summary = {
        "export": str(export),
        "prompts": len(rows),
        "consumer_tau": n_c / max(total_rounds, 1),
        "vltrain_tau": ours["stats"]["tau"],
        "vltrain_rounds": ours["stats"]["rounds"],
        "consumer_rounds": total_rounds,
        "same_tau_every_prompt": all(r["consumer_tau"] == r["vltrain_tau"] for r in rows),
        "same_completion_every_prompt": all(r["same_completion"] for r in rows),
        "consumer_equals_greedy_every_prompt": all(r["consumer_equals_greedy"] for r in rows),
        "control": control,
        "versions": {
            "speculators": __import__("importlib.metadata").metadata.version("speculators"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    ok = summary["same_tau_every_prompt"] and summary["same_completion_every_prompt"]
    ok = ok and (not control or control["detected"])
    return 0 if ok and summary["consumer_equals_greedy_every_prompt"] else 1


if __name__ == "__main__":
    sys.exit(main())
