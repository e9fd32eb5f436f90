"""Caption and chat records for the caption and rl stages.

Sources are every kind `vltrain.data.sources.read_source` reads (JSONL, COCO json, captions
CSV, an image folder with a captions file, HF `datasets` folders and parquet files); in JSONL a
record is either a caption record ``{"image": "rel.png", "text": str or [str, ...], "id": ...}``
or a chat record ``{"image": ..., "messages": [{"role": "user", "content": ...},
{"role": "assistant", "content": ...}, ...]}`` (both may mix in one file).

`CaptionDataset` turns a record into token ids and loss labels (see `vltrain.data.chat`), and
`CaptionCollate` pads a batch of them. A training sample draws one caption from
``sample_generator(seed, epoch, index)``; an eval sample keeps every reference. Bad content
(undecodable image, empty caption) never raises: it becomes the marker dict
``{"bad": reason, ...}`` that the engine drops and counts.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from torch.utils.data import Dataset

from vltrain.data import chat
from vltrain.data.batches import CaptionBatch
from vltrain.data.images import BadSample, check_text
from vltrain.data.readers import DataError, normalise_record
from vltrain.data.records import as_key, caption_index
from vltrain.data.sources import Source, load_source_image, read_source
from vltrain.data.tokenizer import TextTokenizer

MODES = ("pretrain", "finetune", "sft")


# --------------------------------------------------------------------------------- readers


def _caption_or_chat(obj: object, where: str, default_id: str) -> dict[str, Any]:
    if isinstance(obj, dict) and ("messages" in obj or "conversations" in obj):
        return _chat_record(obj, where, default_id)
    try:
        return normalise_record(obj, where, default_id)
    except DataError as e:
        if isinstance(obj, dict) and "text" not in obj:  # the caption stages read chats too
            raise DataError(
                f'{e} A chat record has "messages" (or LLaVA\'s "conversations") instead.'
            ) from None
        raise


#: LLaVA / ShareGPT ``conversations`` speakers -> chat roles
SPEAKERS = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
#: LLaVA's placeholder for where the image goes (with the newline that sets it apart)
IMAGE_TAG = re.compile(r"\n?<image>\n?")


def _chat_record(obj: dict[str, Any], where: str, default_id: str) -> dict[str, Any]:
    if not isinstance(obj.get("image"), str):
        raise DataError(f"{where}: a chat record needs an 'image' path string, got {obj!r}")
    try:
        if "messages" in obj:
            messages = chat.check_messages(obj["messages"], where)
        else:
            messages = chat.check_messages(_from_conversations(obj["conversations"], where), where)
        messages = _without_image_tags(messages, where)
    except ValueError as e:
        raise DataError(str(e)) from None
    rid = str(obj["id"]) if obj.get("id") is not None else default_id
    return {"image": obj["image"], "messages": messages, "id": rid}


def _from_conversations(turns: object, where: str) -> list[dict[str, Any]]:
    """LLaVA's ``[{"from": "human"|"gpt", "value": ...}]`` as ``messages``."""
    if not isinstance(turns, list):
        raise ValueError(f"{where}: 'conversations' must be a list, got {turns!r}")
    out = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or SPEAKERS.get(t.get("from")) is None or "value" not in t:
            raise ValueError(
                f"{where}: conversations[{i}] must be {{'from': 'human' or 'gpt', 'value': "
                f"...}}, got {t!r}"
            )
        out.append({"role": SPEAKERS[t["from"]], "content": t["value"]})
    return out


def _without_image_tags(messages: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """The chat without LLaVA's ``<image>`` placeholder: the stages put the record's one image
    in the first user turn themselves (a placeholder left in would be read as text, or, by a
    LLaVA model, as a second image). A placeholder elsewhere, or two, is refused."""
    out = []
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, str) and "<image>" in content:
            first_user = m["role"] == "user" and all(x["role"] != "user" for x in messages[:i])
            if not first_user or content.count("<image>") > 1:
                raise ValueError(
                    f"{where}: '<image>' in messages[{i}]: a record has one image, placed in "
                    "the first user turn (write '<image>' there once, or not at all)"
                )
            content = IMAGE_TAG.sub("", content, count=1)
        out.append({**m, "content": content})
    return out


def read_caption_source(
    path: str | os.PathLike[str], image_column: str = "image", text_column: str = "text"
) -> Source:
    """Read any supported source (`vltrain.data.sources`), chat records allowed in JSONL."""
    return read_source(path, image_column, text_column, parse=_caption_or_chat)


# --------------------------------------------------------------------------------- dataset


class _KnownIds:
    """A tokenizer whose `encode` looks up the ids of `texts`, encoded in one batch call (the
    lengths of every caption of a dataset: 1.8 s instead of 2.9 s for 48,000 captions); other
    texts go to `tokenizer.encode`."""

    def __init__(self, tokenizer: TextTokenizer, texts: list[str]) -> None:
        self.tokenizer, self.bos_id, self.eos_id = tokenizer, tokenizer.bos_id, tokenizer.eos_id
        unique = list(dict.fromkeys(texts))
        self.ids = dict(zip(unique, tokenizer.encode_many(unique), strict=True))

    def encode(self, text: str) -> list[int]:
        ids = self.ids.get(text)
        return list(ids) if ids is not None else self.tokenizer.encode(text)


class CaptionDataset(Dataset):
    """Image + token ids + labels for the caption stage; never raises for bad content.

    Train sample: ``{"image", "input_ids", "labels", "index", "key"}`` with one caption drawn
    per (seed, epoch, index). Eval sample adds ``prompt_ids`` (what decoding starts from) and
    ``refs`` (every reference), and scores the loss on the first caption.
    """

    def __init__(
        self,
        source: Source,
        tokenizer: TextTokenizer,
        *,
        image_size: int,
        max_len: int,
        seed: int,
        mode: str = "pretrain",
        prompt: str = "",
        instruction: str = "describe the image.",
        train: bool = True,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "sft" and any("messages" in r for r in source.records):
            raise DataError(
                f"{source.path} holds chat records ('messages'); train them with caption.mode=sft"
            )
        self.source, self.tokenizer = source, tokenizer
        self.image_size, self.max_len, self.seed = image_size, max_len, seed
        self.mode, self.prompt, self.instruction, self.train = mode, prompt, instruction, train
        self._caption_lengths: list[list[int]] | None = None  # tokens per caption per record

    @property
    def records(self) -> list[dict[str, Any]]:
        """The records (assignable, e.g. to keep only the first N)."""
        return self.source.records

    @records.setter
    def records(self, value: list[dict[str, Any]]) -> None:
        self.source.records = value
        self._caption_lengths = None

    def __len__(self) -> int:
        return len(self.source.records)

    def _label(self, rec: dict[str, Any]) -> str:
        return f"{self.source.path}:id={rec['id']}"

    def segments(self, rec: dict[str, Any], caption: str | None = None) -> list[chat.Segment]:
        """Training segments of a record (``caption``: which caption; default the first)."""
        label = self._label(rec)
        if "messages" in rec:
            return chat.chat_segments(rec["messages"], label)
        if not rec["text"]:
            raise BadSample("bad_text", label, "record has no captions")
        caption = check_text(rec["text"][0] if caption is None else caption, label)
        if self.mode == "sft":
            return chat.instruction_segments(caption, self.instruction)
        return chat.caption_segments(caption, self.prompt)

    def prompt_and_refs(self, rec: dict[str, Any]) -> tuple[list[chat.Segment], list[str]]:
        """What decoding starts from, and the references its output is scored against."""
        label = self._label(rec)
        if "messages" in rec:
            prompt, ref = chat.chat_prompt_and_reference(rec["messages"], label)
            return prompt, [ref]
        refs = [check_text(t, label) for t in rec["text"]]
        if not refs:
            raise BadSample("bad_text", label, "record has no captions")
        if self.mode == "sft":
            return [(f"{chat.USER} {self.instruction}", False), (chat.ASSISTANT, False)], refs
        return ([(self.prompt, False)] if self.prompt else []), refs

    def token_length(self, index: int, caption: str | None = None, tokenizer: Any = None) -> int:
        """Tokens of the record's first caption (or `caption`, or its chat); 1 for a record
        with bad text. `tokenizer`: one that encodes like this dataset's (`_KnownIds`)."""
        try:
            segs = self.segments(self.source.records[index], caption)
        except BadSample:
            return 1
        return len(chat.encode_segments(tokenizer or self.tokenizer, segs, self.max_len)[0])

    def label_ids(self, index: int) -> list[int]:
        """The supervised token ids of every caption (or the chat) of record ``index``."""
        rec = self.source.records[index]
        many = "messages" not in rec and len(rec.get("text") or []) > 1
        out: list[int] = []
        for caption in rec["text"] if many else [None]:
            try:
                labels = chat.encode_segments(
                    self.tokenizer, self.segments(rec, caption), self.max_len
                )[1]
            except BadSample:
                continue
            out += [t for t in labels if t != chat.IGNORE_INDEX]
        return out

    def caption_choice(self, rec: dict[str, Any], epoch: int, index: int) -> int | None:
        """Which of the record's captions training draws at (seed, epoch, index); None: the
        first (eval, chat records, a single caption)."""
        if not self.train or "messages" in rec or len(rec["text"]) <= 1:
            return None
        return caption_index(len(rec["text"]), self.seed, epoch, index)

    def epoch_token_lengths(self, epoch: int) -> list[int]:
        """Tokens of what each sample trains on in `epoch` (its drawn caption), for length
        bucketing; every caption is tokenised once, on the first call."""
        if self._caption_lengths is None:
            texts = [self.prompt] if self.prompt else []
            for rec in self.source.records:
                if isinstance(rec.get("text"), list):
                    texts += [t for t in rec["text"] if isinstance(t, str)]
            tok = _KnownIds(self.tokenizer, texts)
            self._caption_lengths = [
                [self.token_length(i, tokenizer=tok)]
                if "messages" in rec or len(rec["text"]) <= 1
                else [self.token_length(i, t, tok) for t in rec["text"]]
                for i, rec in enumerate(self.source.records)
            ]
        out = []
        for i, (rec, lens) in enumerate(
            zip(self.source.records, self._caption_lengths, strict=True)
        ):
            choice = self.caption_choice(rec, epoch, i)
            out.append(lens[0 if choice is None else choice])
        return out

    def __getitem__(self, key: Any) -> dict[str, Any]:
        epoch, _, index = as_key(key)
        if not 0 <= index < len(self.source.records):
            raise IndexError(f"index {index} out of range for {len(self.source.records)} records")
        rec = self.source.records[index]
        try:
            return self._sample(rec, epoch, index, key)
        except BadSample as e:
            where = e.path or str(rec["image"])
            return {"bad": e.reason, "path": where, "detail": e.detail, "key": key, "index": index}

    def _sample(self, rec: dict[str, Any], epoch: int, index: int, key: Any) -> dict[str, Any]:
        choice = self.caption_choice(rec, epoch, index)
        segs = self.segments(rec, None if choice is None else rec["text"][choice])
        out: dict[str, Any] = {"index": index, "key": key}
        if not self.train:
            prompt, out["refs"] = self.prompt_and_refs(rec)
            out["prompt_ids"] = chat.encode_prompt(self.tokenizer, prompt)
        out["input_ids"], out["labels"] = chat.encode_segments(self.tokenizer, segs, self.max_len)
        label = self._label(rec)
        out["image"] = load_source_image(self.source, rec["image"], self.image_size, label)
        return out


def training_texts(source: Source, prompt: str, instruction: str) -> list[str]:
    """Every text the tokenizer should learn from (captions, prompts, chat turns, markers).

    The chat markers are included in every mode, so a tokenizer trained for pretraining keeps
    the template short when the run is later continued with SFT (init_from reuses it).
    """
    texts: list[str] = []
    extra = [prompt] if prompt else []
    extra += [f"{chat.USER} {instruction}", chat.ASSISTANT]
    for rec in source.records:
        if "messages" in rec:
            texts += [str(m["content"]) for m in rec["messages"] if isinstance(m["content"], str)]
        else:
            texts += [t for t in rec["text"] if isinstance(t, str)]
    return texts + extra * len(source.records)  # as frequent as in training


class CaptionCollate:
    """Pad token ids (right; pad id), labels (right; -100) and eval prompts (left); picklable."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, Any]]) -> CaptionBatch:
        t = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), t), self.pad_id, dtype=torch.long)  # (B, T)
        labels = torch.full((len(samples), t), chat.IGNORE_INDEX, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(samples), t), dtype=torch.long)  # (B, T)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.tensor(s["input_ids"])
            labels[i, :n] = torch.tensor(s["labels"])
            mask[i, :n] = 1
        batch: CaptionBatch = {
            "images": torch.stack([s["image"] for s in samples]),  # (B, 3, S, S)
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "index": torch.tensor([s["index"] for s in samples]),
        }
        if "prompt_ids" in samples[0]:
            batch["prompt_ids"] = [s["prompt_ids"] for s in samples]
            batch["refs"] = [s["refs"] for s in samples]
        return batch
