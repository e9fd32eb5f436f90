"""Shared pieces of the speculative-decoding tests: tiny targets, drafters, an oracle drafter."""

from __future__ import annotations

import torch

from vltrain.inference.decoding import generate
from vltrain.models.drafter import Drafter, DrafterConfig, SharedParts

V, PAD, BOS, EOS = 96, 0, 1, 2  # the tiny HF causal LMs' vocabulary and special tokens


def left_padded_prompts(b: int = 3) -> dict:
    """BOS + 6 random tokens per row; row 1 left-padded by two."""
    g = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.full((b, 1), BOS), torch.randint(3, V, (b, 6), generator=g)], 1)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask}


def random_drafter(
    target,
    block_size: int = 4,
    seed: int = 0,
    vocab: list[int] | None = None,
) -> Drafter:
    """A random drafter of ``target``; ``vocab``: a reduced draft vocabulary of these ids."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(
        width=target.width,
        vocab_size=target.vocab_size,
        target_layer_ids=target.layer_ids,
        heads=2,
        block_size=block_size,
        draft_vocab=len(vocab or []),
    )
    d = Drafter(cfg).share(SharedParts(target.embed, target.head, target.head_params))
    if vocab:
        d.set_vocab(torch.tensor(vocab))
    return d.eval()


def greedy_reference(model, inputs: dict, max_new: int) -> list[list[int]]:
    out = generate(model, inputs, "greedy", max_new_tokens=max_new)
    return [s[: int(n)].tolist() for s, n in zip(out.sequences, out.lengths, strict=True)]


def oracle_draft(
    refs: list[list[int]], first_pos: list[int], vocab: int, p_top: float, seed: int = 0
):
    """A stand-in for `speculative._draft` that knows the target's greedy continuation.

    Slot k of the block rooted at position p proposes ref[p - first_pos + k] as its top token
    with probability p_top, else as its second (a random token ranks first): chains accept
    often, trees (which hold second choices) accept more. Decoding drops finished rows from the
    batch: a row is known by its prompt's features (the first call's context), so the batch's
    row j may stand for prompt i > j (every prompt must decode a round: none may end at its
    first token).
    """
    g = torch.Generator().manual_seed(seed)
    prompt_feats: list[torch.Tensor] = []

    def prompt_of(feats: torch.Tensor) -> int:
        first = prompt_feats[0]
        return next(i for i in range(len(first)) if torch.equal(first[i], feats[: first.shape[1]]))

    def draft(drafter, ctx, root, anchor, cache=None):
        if not prompt_feats:
            prompt_feats.append(ctx.features.clone())
        k = drafter.cfg.block_size - 1
        logits = torch.randn(len(root), k, vocab, generator=g)
        for j in range(len(root)):
            i = prompt_of(ctx.features[j])
            base = int(anchor[j]) - first_pos[i]
            for s in range(k):
                at = base + 1 + s
                if at >= len(refs[i]):
                    continue
                true = refs[i][at]
                logits[j, s, true] = 8.0
                if float(torch.rand((), generator=g)) > p_top:
                    wrong = (true + 1 + int(torch.randint(vocab - 1, (), generator=g))) % vocab
                    logits[j, s, wrong] = 9.0
        return torch.log_softmax(logits, -1)

    return draft
