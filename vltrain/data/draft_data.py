"""Drafter training data: target-regenerated chats for HF LMs, anchors, the batch collate.

A causal-LM record (what ``vltrain data regenerate`` writes) is one JSON line
``{"id", "prompt", "completion", "completion_ids"}``: the prompt, and the target's own answer
as text and as the exact token ids it generated (re-tokenizing the text may give other ids).
The training sequence is the chat template's prompt (user turn + generation prompt) followed
by ``completion_ids``; only the completion is supervised (``chat_example``), so the supervised
tokens are exactly the ones the target produced after its generation prompt.

``VLMCaptionRecords`` are caption records for an HF image-text-to-text target: the model's chat
prompt (the image, then an instruction; ``data.hf_collate.HFCollate`` expands the image tokens),
then the caption and EOS, with only the caption and EOS supervised; the image inputs travel
under the sample's ``vision`` key.

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
from vltrain.data.images import BadSample
from vltrain.data.readers import DataError
from vltrain.data.records import as_key
from vltrain.data.rng import sample_generator
from vltrain.data.sources import load_source_image


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


# image inputs aligned with the tokens (padded like them); the others are concatenated
SEQUENCE_VISION_KEYS = ("mm_token_type_ids", "token_type_ids")


class VLMCaptionRecords:
    """Caption records (``{"image", "text"}``) as an HF VLM target reads them (module doc)."""

    def __init__(
        self, source: Any, collate: Any, tokenizer: Any, instruction: str, max_len: int
    ) -> None:
        self.source, self.collate, self.tokenizer = source, collate, tokenizer
        self.instruction, self.max_len = instruction, max_len
        self.eos_id = int(tokenizer.eos_token_id)

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.source.records

    @records.setter
    def records(self, value: list[dict[str, Any]]) -> None:
        self.source.records = value

    def __len__(self) -> int:
        return len(self.source.records)

    def caption_ids(self, index: int) -> list[int]:
        """The first caption's ids, cut to ``max_len - 1``, then EOS."""
        text = (self.source.records[index].get("text") or [""])[0]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: self.max_len - 1]
        return [*ids, self.eos_id]

    def token_length(self, index: int) -> int:
        """Caption tokens (the image prompt, about the same for every record, is not counted:
        its image tokens are known once the image is read)."""
        return len(self.caption_ids(index))

    def label_ids(self, index: int) -> list[int]:
        return self.caption_ids(index)

    def image(self, index: int) -> Any:
        """The record's image at its own size (RGB PIL); BadSample when unusable."""
        rec = self.source.records[index]
        return load_source_image(self.source, rec["image"], 0, f"id={rec['id']}", native=True)

    def __getitem__(self, key: Any) -> dict[str, Any]:
        _, _, index = as_key(key)
        try:
            pil = self.image(index)
        except BadSample as e:
            return {"bad": e.reason, "path": e.path, "detail": e.detail, "key": key, "index": index}
        inputs, _ = self.collate.image_batch([pil], instructions=[self.instruction])
        prompt = inputs.pop("input_ids")[0].tolist()
        inputs.pop("attention_mask")
        cap = self.caption_ids(index)
        ids, labels = prompt + cap, [IGNORE_INDEX] * len(prompt) + cap
        return {"input_ids": ids, "labels": labels, "vision": inputs, "index": index, "key": key}


def collate_vision(samples: list[dict[str, Any]], t: int) -> dict[str, Tensor]:
    """The samples' image inputs as one batch's: token-aligned keys right-padded to ``t`` with
    0, the others (pixel values, grids) concatenated along their first dim."""
    out = {}
    for key in samples[0]["vision"]:
        parts = [s["vision"][key] for s in samples]
        if key in SEQUENCE_VISION_KEYS:
            pad = [torch.nn.functional.pad(v, (0, t - v.shape[1])) for v in parts]
            out[key] = torch.cat(pad)  # (B, T)
        else:
            out[key] = torch.cat(parts)
    return out


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
    """Right-pad ids (pad id), labels (-100), anchors (0, invalid); stack images (a
    captioner's) or batch image inputs (an HF VLM's, `collate_vision`) if any."""

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
        if "vision" in samples[0]:
            out["vision"] = collate_vision(samples, t)
        return out
