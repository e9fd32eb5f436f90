"""Prompt/target segments, the chat template, and token ids + loss labels built from them.

Every caption-stage sample is a list of *segments* ``(text, is_target)``. Segments are
tokenized one by one and concatenated after ``<bos>``, so the boundary between prompt and target
tokens is exact (no offset mapping). Each target segment is followed by ``<eos>``; target tokens
and that ``<eos>`` carry labels, everything else is ``IGNORE_INDEX``.

Chat template (plain-text markers, tokenized by the BPE tokenizer like any other text, so a
tokenizer trained on captions needs no new ids and checkpoints stay loadable)::

    <bos> <user> {user 1} <assistant> {assistant 1} <eos> <user> {user 2} <assistant> ... <eos>

Only ``{assistant i}`` and the ``<eos>`` after it are labelled. At generation time the prompt
is everything up to and including the last ``<assistant>`` marker; decoding stops at ``<eos>``.
A plain caption is the degenerate case ``<bos> [{prompt}] {caption} <eos>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vltrain.data.images import check_text
from vltrain.data.tokenizer import TextTokenizer

IGNORE_INDEX = -100
"""Label of tokens without loss (same value as vltrain.models.captioner.IGNORE_INDEX)."""
USER = "<user>"
ASSISTANT = "<assistant>"
ROLES = ("user", "assistant")

Segment = tuple[str, bool]
"""(text, is_target): one piece of a training sequence."""


def check_messages(messages: object, where: str) -> list[dict[str, Any]]:
    """Validate the structure of a chat (a DataError-worthy mistake raises ValueError).

    A chat is a non-empty list of ``{"role": "user"|"assistant", "content": str}`` with at
    least one assistant turn. Content *values* (empty, invalid UTF-8) are checked later per
    sample and become ``bad_text`` samples instead.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list, got {messages!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or "content" not in m:
            raise ValueError(
                f"{where}: messages[{i}] must be {{'role': 'user' or 'assistant', 'content': "
                f"...}}, got {m!r}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: the chat has no assistant turn, so nothing to learn")
    return list(messages)


def _content(m: dict[str, Any], label: str) -> str:
    return check_text(m["content"], label)


def chat_segments(messages: Sequence[dict[str, Any]], label: str = "") -> list[Segment]:
    """The template's segments for a whole chat; raises BadSample for empty/invalid content."""
    out: list[Segment] = []
    for m in messages:
        if m["role"] == "user":
            out.append((f"{USER} {_content(m, label)}", False))
        else:
            out += [(ASSISTANT, False), (_content(m, label), True)]
    return out


def chat_prompt_and_reference(
    messages: Sequence[dict[str, Any]], label: str = ""
) -> tuple[list[Segment], str]:
    """Prompt segments (all turns before the last assistant turn, then ``<assistant>``) and
    the last assistant content as the reference for evaluation."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = chat_segments(messages[:last], label) + [(ASSISTANT, False)]
    return prompt, _content(messages[last], label)


def caption_segments(caption: str, prompt: str = "") -> list[Segment]:
    """``[prompt] caption`` with only the caption as target."""
    return ([(prompt, False)] if prompt else []) + [(caption, True)]


def instruction_segments(caption: str, instruction: str) -> list[Segment]:
    """A caption as a one-turn chat: ``<user> {instruction} <assistant> {caption}``."""
    return [(f"{USER} {instruction}", False), (ASSISTANT, False), (caption, True)]


def encode_segments(
    tokenizer: TextTokenizer, segments: Sequence[Segment], max_len: int
) -> tuple[list[int], list[int]]:
    """Token ids and labels (same length, at most ``max_len``) of ``<bos>`` + segments.

    Over-long sequences are cut at the end; if the cut lands inside a target, its last kept
    token becomes ``<eos>`` (as ``TextTokenizer.encode_batch`` keeps ``<eos>``), so a
    truncated caption still teaches the model to stop.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (bos + one token), got {max_len}")
    ids, labels = [tokenizer.bos_id], [IGNORE_INDEX]
    for text, target in segments:
        toks = tokenizer.encode(text) if text else []
        ids += toks
        labels += toks if target else [IGNORE_INDEX] * len(toks)
        if target:
            ids.append(tokenizer.eos_id)
            labels.append(tokenizer.eos_id)
    if len(ids) > max_len:
        ids, labels = ids[:max_len], labels[:max_len]
        if labels[-1] != IGNORE_INDEX:
            ids[-1] = labels[-1] = tokenizer.eos_id
    return ids, labels


def encode_prompt(tokenizer: TextTokenizer, segments: Sequence[Segment]) -> list[int]:
    """Token ids of ``<bos>`` + ``segments`` (earlier assistant turns keep their ``<eos>``,
    exactly as in training): what generation continues."""
    ids, _ = encode_segments(tokenizer, segments, max_len=10**9)
    return ids


def segments_text(segments: Sequence[Segment]) -> str:
    """All segment texts joined by spaces (tokenizer training data)."""
    return " ".join(t for t, _ in segments if t)


__all__ = [
    "ASSISTANT",
    "IGNORE_INDEX",
    "USER",
    "Segment",
    "caption_segments",
    "chat_prompt_and_reference",
    "chat_segments",
    "check_messages",
    "encode_prompt",
    "encode_segments",
    "instruction_segments",
    "segments_text",
]
