"""Drafter training data: target-regenerated chats for HF LMs, anchors, the batch collate.

A causal-LM record (what ``vltrain data regenerate`` writes) is one JSON line
``{"id", "prompt", "completion", "completion_ids"}``: the prompt, and the target's own answer
as text and as the exact token ids it generated (re-tokenizing the text may give other ids).
The training sequence is the chat template's prompt (user turn + generation prompt) followed
by ``completion_ids``; only the completion is supervised (``chat_example``), so the supervised
tokens are exactly the ones the target produced after its generation prompt.

``DraftDataset`` wraps a base dataset (these records, or the caption dataset for a captioner
target) and samples the row's anchors from (seed, epoch, index): never from the world size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vltrain.data.batches import DraftBatch
from vltrain.data.chat import IGNORE_INDEX
from vltrain.data.readers import DataError
from vltrain.data.records import as_key
from vltrain.data.rng import sample_generator


def sample_anchors(loss_mask: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
    """Up to ``n`` sorted anchor positions (J,) of one row with ``loss_mask`` (T,) bool.

    A position t is a candidate iff t and t + 1 are both supervised; ``n <= 0`` takes all.
    """
    ok = loss_mask[:-1] & loss_mask[1:]  # (T - 1,)
    cand = torch.nonzero(ok).flatten()
    if n > 0 and len(cand) > n:
        pick = torch.randperm(len(cand), generator=generator)[:n]
        cand = cand[pick]
    return cand.sort().values


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of the chat template's user turn + generation prompt (an HF tokenizer)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_example(
    tokenizer: Any, prompt: str, completion_ids: list[int]
) -> tuple[list[int], list[int]]:
    """(ids, labels) of one chat: labels are -100 on the prompt, the ids on the completion."""
    p = chat_prompt_ids(tokenizer, prompt)
    return p + list(completion_ids), [IGNORE_INDEX] * len(p) + list(completion_ids)


def require_chat_template(tokenizer: Any, model: str | Path) -> None:
    """A DataError naming `model` when its tokenizer has no chat template to wrap prompts in."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{model} has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja): prompts are wrapped in it as a user turn; use a chat/"
            "instruct model, or add the template its base model was trained with"
        )


def read_prompts(path: str | Path) -> list[dict[str, Any]]:
    """JSONL records with a "prompt" (str); "id" defaults to the line number."""
    rows = []
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (offset {e.start}); save it as UTF-8") from None
    for n, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n + 1}: not valid JSON ({e.msg}); fix or delete it") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise DataError(f"{path}:{n + 1}: each line needs a 'prompt' string, got {line[:80]!r}")
        rec.setdefault("id", str(n))
        rows.append(rec)
    if not rows:
        raise DataError(f"{path}: no prompts")
    return rows


class ChatRecords:
    """Target-regenerated chat records as (ids, labels) samples, truncated to ``max_len``."""

    def __init__(self, path: str | Path, tokenizer: Any, max_len: int) -> None:
        self.records = read_prompts(path)
        self.tokenizer, self.max_len = tokenizer, max_len
        for i, r in enumerate(self.records):
            if "completion_ids" not in r and "completion" not in r:
                raise DataError(
                    f"{path}: record {i} has no 'completion_ids' / 'completion'; make the "
                    "target answer the prompts first (vltrain data regenerate)"
                )

    def __len__(self) -> int:
        return len(self.records)

    def encode(self, index: int) -> tuple[list[int], list[int]]:
        r = self.records[index]
        comp = r.get("completion_ids")
        if comp is None:
            comp = self.tokenizer(r["completion"], add_special_tokens=False)["input_ids"]
        ids, labels = chat_example(self.tokenizer, r["prompt"], comp)
        return ids[: self.max_len], labels[: self.max_len]

    def token_length(self, index: int) -> int:
        return len(self.encode(index)[0])

    def label_ids(self, index: int) -> list[int]:
        """The supervised token ids of record ``index`` (what a drafter learns to propose)."""
        return [t for t in self.encode(index)[1] if t != IGNORE_INDEX]

    def __getitem__(self, key: Any) -> dict[str, Any]:
        _, _, index = as_key(key)
        ids, labels = self.encode(index)
        return {"input_ids": ids, "labels": labels, "index": index, "key": key}


class DraftDataset:
    """A base dataset's samples plus ``anchors`` (J,) drawn from (seed, epoch, index)."""

    def __init__(self, base: Any, n_anchors: int, seed: int) -> None:
        self.base, self.n_anchors, self.seed = base, n_anchors, seed

    def __len__(self) -> int:
        return len(self.base)

    def token_length(self, index: int) -> int:
        return self.base.token_length(index)

    def __getitem__(self, key: Any) -> dict[str, Any]:
        s = self.base[key]
        if "bad" in s:
            return s
        epoch, _, index = as_key(key)
        mask = torch.tensor(s["labels"]) != IGNORE_INDEX
        g = sample_generator(self.seed, epoch, index, salt="anchors")
        s["anchors"] = sample_anchors(mask, self.n_anchors, g).tolist()
        return s


class DraftCollate:
    """Right-pad ids (pad id), labels (-100), anchors (0, invalid); stack images if any."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, Any]]) -> DraftBatch:
        b = len(samples)
        t = max(len(s["input_ids"]) for s in samples)
        j = max(1, max(len(s["anchors"]) for s in samples))
        ids = torch.full((b, t), self.pad_id, dtype=torch.long)
        labels = torch.full((b, t), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((b, t), dtype=torch.long)
        anchors = torch.zeros((b, j), dtype=torch.long)
        valid = torch.zeros((b, j), dtype=torch.bool)
        for i, s in enumerate(samples):
            n, a = len(s["input_ids"]), len(s["anchors"])
            ids[i, :n], labels[i, :n], mask[i, :n] = (
                torch.tensor(s["input_ids"]),
                torch.tensor(s["labels"]),
                1,
            )
            if a:
                anchors[i, :a], valid[i, :a] = torch.tensor(s["anchors"]), True
        out: DraftBatch = {
            "input_ids": ids,
            "labels": labels,
            "attention_mask": mask,
            "anchors": anchors,
            "anchor_valid": valid,
            "index": torch.tensor([s["index"] for s in samples]),
        }
        if "image" in samples[0]:
            out["images"] = torch.stack([s["image"] for s in samples])
        return out
