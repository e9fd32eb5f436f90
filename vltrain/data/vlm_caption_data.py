"""Caption and chat records as inputs of a Hugging Face VLM (model kinds hf_vlm and llava).

`VLMCaptionDataset` reads the records the caption stage reads (`read_caption_source`) and
yields the image at its native size plus a chat: a chat record's ``messages``, or a caption as
a one-turn chat (user: ``caption.instruction`` in sft, ``caption.prompt`` otherwise; assistant:
the caption drawn for (seed, epoch, index)). `VLMCaptionCollate` turns a batch into model inputs
with the model's own tokenizer and image processor, loaded lazily from a local folder:

- ``chat`` format (sft; every mode of hf_vlm): the model's chat template; loss on the assistant
  turns only, by TRL's rule (`vlm_sft_labels`, `chat_segments`).
- ``plain`` format (llava pretrain/finetune): ``[bos] <image tokens>\\n{prompt}{caption}{eos}``;
  loss on the caption and its eos.

Image placeholders are expanded to each image's count of visual tokens by the processor's own
rule (patch-grid VLMs: `vltrain.data.visual_tokens`, with ``data.max_visual_tokens`` enforced
by construction). A chat is tokenised whole (as decoding, transformers and TRL tokenise it; a
fast tokenizer's offsets place each token in its prompt or target span); the plain format, and
chats under a slow tokenizer, segment by segment (prompt / target).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from vltrain.data.batches import CaptionBatch
from vltrain.data.caption_data import read_caption_source
from vltrain.data.chat import IGNORE_INDEX
from vltrain.data.hf_collate import to_pil
from vltrain.data.images import BadSample, check_text
from vltrain.data.readers import DataError
from vltrain.data.records import as_key, caption_index
from vltrain.data.sources import Source, load_source_image
from vltrain.data.visual_tokens import read_patch_grid, resize_for_budget

GRID_VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
Message = dict[str, str]


class VLMCaptionDataset(Dataset):
    """``{"image": PIL, "messages", "index", "key"}``; eval samples add ``refs``. Bad content
    becomes the ``{"bad": reason, ...}`` marker the engine counts."""

    def __init__(
        self,
        source: Source,
        *,
        seed: int,
        mode: str,
        prompt: str = "",
        instruction: str = "describe the image.",
        train: bool = True,
    ) -> None:
        if mode != "sft" and any("messages" in r for r in source.records):
            raise DataError(
                f"{source.path} holds chat records ('messages'); train them with caption.mode=sft"
            )
        self.source, self.seed, self.mode, self.train = source, seed, mode, train
        self.user_text = instruction if mode == "sft" else prompt

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.source.records

    @records.setter
    def records(self, value: list[dict[str, Any]]) -> None:
        self.source.records = value

    def __len__(self) -> int:
        return len(self.source.records)

    def messages(self, epoch: int, index: int) -> tuple[list[Message], list[str]]:
        """Record `index`'s chat as epoch `epoch` trains on it, and its references; raises
        BadSample for bad text."""
        rec = self.source.records[index]
        label = f"{self.source.path}:id={rec['id']}"
        if "messages" in rec:
            msgs = [
                {"role": m["role"], "content": check_text(m["content"], label)}
                for m in rec["messages"]
            ]
            last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
            return msgs, [msgs[last]["content"]]
        refs = [check_text(t, label) for t in rec["text"]]
        if not refs:
            raise BadSample("bad_text", label, "record has no captions")
        pick = 0
        if self.train and len(refs) > 1:
            pick = caption_index(len(refs), self.seed, epoch, index)
        msgs = [
            {"role": "user", "content": self.user_text},
            {"role": "assistant", "content": refs[pick]},
        ]
        return msgs, refs

    def __getitem__(self, key: Any) -> dict[str, Any]:
        epoch, _, index = as_key(key)
        rec = self.source.records[index]
        label = f"{self.source.path}:id={rec['id']}"
        try:
            out: dict[str, Any] = {"index": index, "key": key}
            out["messages"], refs = self.messages(epoch, index)
            if not self.train:
                out["refs"] = refs
            out["image"] = load_source_image(self.source, rec["image"], 0, label, native=True)
            return out
        except BadSample as e:
            where = e.path or str(rec["image"])
            return {"bad": e.reason, "path": where, "detail": e.detail, "key": key, "index": index}


def read_vlm_dataset(path: str | os.PathLike[str], **kw: Any) -> VLMCaptionDataset:
    """A `VLMCaptionDataset` over any source the caption stage reads."""
    return VLMCaptionDataset(read_caption_source(path), **kw)


# ---- chat rendering and labels -----------------------------------------------------------


def _conversation(messages: Sequence[Message], image_markup: str | None) -> list[dict[str, Any]]:
    """`messages` as a chat template reads them, the image in the first user turn: a content
    list ``[{"type": "image"}, {"type": "text"}]`` (VLM templates), or, when `image_markup` is
    a string, that text prepended to the first user turn (text-LM templates)."""
    conv: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        first = i == 0
        if image_markup is None:
            content: Any = [{"type": "image"}] if first else []
            if m["content"]:
                content.append({"type": "text", "text": m["content"]})
        else:
            content = (image_markup if first else "") + m["content"]
        conv.append({"role": m["role"], "content": content})
    return conv


def _render(tok: Any, messages: Sequence[Message], image_markup: str | None, gen: bool) -> str:
    """The chat template over `messages` (see `_conversation`)."""
    conv = _conversation(messages, image_markup)
    return tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)


GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _generation_spans(
    tok: Any, messages: Sequence[Message], image_markup: str | None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of its ``{% generation %}`` blocks (as
    transformers marks assistant tokens for ``return_assistant_tokens_mask``)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, spans = render_jinja_template(
        [_conversation(messages, image_markup)],
        chat_template=tok.chat_template,
        return_assistant_tokens_mask=True,
        **tok.special_tokens_map,
    )
    return rendered[0], [(a, b) for a, b in spans[0] if b > a]


def chat_segments(
    tok: Any, messages: Sequence[Message], image_markup: str | None = None
) -> list[tuple[str, bool]]:
    """The rendered chat cut into (text, is_target) segments: each assistant turn is a target,
    from the end of its generation prompt to the start of the next turn (found by rendering the
    chat's prefixes, so any template whose prefixes render as prefixes of the whole works; where
    the rendered turn does not repeat the generation prompt's end, from where the two part),
    less the whitespace at its end that the tokenizer reads as the start of what follows
    (`turn_end`). A template with ``{% generation %}`` blocks marks its targets itself: they
    are those blocks (TRL's rule and transformers')."""
    if isinstance(tok.chat_template, str) and GENERATION_BLOCK.search(tok.chat_template):
        full, spans = _generation_spans(tok, messages, image_markup)
        return _cut(full, spans)
    full = _render(tok, messages, image_markup, gen=False)
    spans, pos = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tok, messages[:i], image_markup, gen=True)
        prefix = _render(tok, messages[: i + 1], image_markup, gen=False)
        # a generation prompt the rendered turn does not repeat (DeepSeek-R1's "<think>\n"
        # after "<｜Assistant｜>"): the answer starts where the two part
        start = len(os.path.commonprefix([prompt, prefix]))
        if start < len(prompt):  # not past an answer that starts as the prompt's end does
            at = prefix.rfind(m["content"].strip())
            start = at if pos <= at < start else start
        if not full.startswith(prefix) or start < pos or start > len(prefix):
            raise ValueError(
                "the chat template does not render a conversation's prefixes as prefixes of it "
                "(it rewrites earlier turns), so assistant tokens cannot be told apart; use a "
                "template without history rewriting"
            )
        spans.append((start, len(prefix)))
        pos = len(prefix)
    text = full + _continuation(tok, messages, image_markup, full)
    words = word_spans(tok, text)
    return _cut(full, [(a, turn_end(text, words, a, b)) for a, b in spans])


def _cut(full: str, spans: Sequence[tuple[int, int]]) -> list[tuple[str, bool]]:
    """`full` as (text, is_target) segments, the targets at `spans` (sorted, disjoint)."""
    segments, pos = [], 0
    for start, end in spans:
        segments += [(full[pos:start], False), (full[start:end], True)]
        pos = end
    segments.append((full[pos:], False))
    return [s for s in segments if s[0]]


def _continuation(
    tok: Any, messages: Sequence[Message], image_markup: str | None, full: str
) -> str:
    """What the template renders after `full` when a user turn follows a chat that ends with
    an assistant turn (so its end is judged as every other turn's); '' where none can be."""
    if not messages or messages[-1]["role"] != "assistant":
        return ""
    try:
        more = _render(tok, [*messages, {"role": "user", "content": "next"}], image_markup, False)
    except Exception:  # a template that refuses the probe: the chat's end stays as rendered
        return ""
    return more[len(full) :] if more.startswith(full) else ""


def word_spans(tok: Any, text: str) -> list[tuple[int, int]]:
    """Character spans of the pieces a fast tokenizer merges within and never across: its added
    tokens, then its pre-tokenizer's words between them (one piece per stretch without a
    pre-tokenizer); [] for a slow tokenizer."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return []
    pre = backend.pre_tokenizer
    added = sorted(tok.get_added_vocab(), key=len, reverse=True)
    cuts = [(m.start(), m.end()) for m in re.finditer("|".join(map(re.escape, added)), text)]
    out, pos = [], 0
    for a, b in [*cuts, (len(text), len(text))] if added else [(len(text), len(text))]:
        if a > pos:
            chunk = text[pos:a]
            words = pre.pre_tokenize_str(chunk) if pre is not None else [(chunk, (0, len(chunk)))]
            out += [(pos + s, pos + e) for _, (s, e) in words]
        if b > a:
            out.append((a, b))
        pos = b
    return out


def turn_end(text: str, words: Sequence[tuple[int, int]], start: int, end: int) -> int:
    """Where an assistant turn's target ends: `end`, or the start of the whitespace at its end
    when that whitespace begins a piece that runs past `end` into the next turn (LLaVA-NeXT's
    space after ``</s>`` before ``[INST]``: ``▁[INST]`` or `` [`` is the next turn's first
    word), so no token of the next turn is learned as the answer's. Whitespace the tokenizer
    keeps apart (Qwen's ``\\n`` before ``<|im_start|>``) stays in the target. This is where
    TRL's training templates put their ``{% generation %}`` blocks' ends."""
    a, b = next(((a, b) for a, b in words if a < end <= b), (end, end))  # holds end - 1
    return a if b > end and a >= start and text[a:end].isspace() else end


def encode_segments(tok: Any, segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 off target) of segments tokenised one by one."""
    ids: list[int] = []
    labels: list[int] = []
    for text, target in segments:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids += t
        labels += t if target else [IGNORE_INDEX] * len(t)
    return ids, labels


def vlm_sft_labels(
    tok: Any,
    messages: Sequence[Message],
    image_token: str,
    image_replacement: str,
    image_markup: str | None = None,
) -> tuple[list[int], list[int]]:
    """SFT input ids and labels of one chat with one image: the model's chat template, the
    image placeholder expanded to `image_replacement` (its visual tokens), labels on the
    assistant turns only (IGNORE_INDEX elsewhere). `image_markup`: None for VLM templates
    (content lists), else the text an image is in a text-LM template (llava kind)."""
    segs = chat_segments(tok, messages, image_markup)
    segs = [(t.replace(image_token, image_replacement, 1), g) for t, g in segs]
    if not getattr(tok, "is_fast", False):  # no offsets
        return encode_segments(tok, segs)
    return encode_whole(tok, segs)


def encode_whole(tok: Any, segments: Sequence[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """Token ids of the segments' text tokenised whole, labels on the tokens lying entirely
    inside a target segment (by the fast tokenizer's offsets). Unlike `encode_segments`, the ids
    are those of the whole chat even where a tokenizer joins text across a turn boundary
    (a Metaspace tokenizer's ``</s> [INST]`` is ``</s>``, ``▁[INST]``, not ``</s>``, ``▁``,
    ``▁[INST]``); a token straddling a boundary is not a target."""
    spans, pos = [], 0
    for text, target in segments:
        if target:
            spans.append((pos, pos + len(text)))
        pos += len(text)
    enc = tok(
        "".join(t for t, _ in segments), add_special_tokens=False, return_offsets_mapping=True
    )
    labels = [
        t if any(s <= a and b <= e for s, e in spans) else IGNORE_INDEX
        for t, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
    ]
    return list(enc["input_ids"]), labels


# ---- collate -----------------------------------------------------------------------------


class VLMCaptionCollate:
    """Picklable collate: samples -> ``images`` (dict of pixel inputs), ``input_ids``,
    ``attention_mask``, ``labels`` (right-padded), ``index``, ``visual_tokens``; eval samples
    add ``prompt_ids`` and ``refs``."""

    def __init__(
        self,
        processor_dir: str,
        model_type: str,
        fmt: str,
        max_text_len: int,
        max_visual_tokens: int | None = None,
        image_markup: str | None = None,
    ) -> None:
        self.dir, self.model_type, self.fmt = str(processor_dir), model_type, fmt
        self.image_markup = image_markup
        self.max_text_len, self.max_visual_tokens = max_text_len, max_visual_tokens
        self._st: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_st": None}

    def _load(self) -> dict[str, Any]:
        if self._st is None:
            self._st = load_processor(self.dir, self.model_type)
        return self._st

    def images(self, pils: list[Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
        """Pixel inputs of a batch of images and each image's placeholder expansion."""
        st = self._load()
        pils = [to_pil(p) for p in pils]
        if st["grid"] is not None:
            g, kw = st["grid"], {}
            if self.max_visual_tokens:
                pils = [
                    resize_for_budget(
                        im, g.patch_size, g.merge_size, self.max_visual_tokens, g.min_pixels
                    )[0]
                    for im in pils
                ]
                kw["do_resize"] = False
            out = st["image_processor"](images=pils, return_tensors="pt", **kw)
            counts = [int(t.prod()) // g.merge_size**2 for t in out["image_grid_thw"]]
            reps = [st["image_token"] * n for n in counts]
            return {
                "pixel_values": out["pixel_values"],
                "image_grid_thw": out["image_grid_thw"],
            }, reps
        proc = st["processor"]
        kw = proc._merge_kwargs(
            tokenizer_init_kwargs=proc.tokenizer.init_kwargs, return_tensors="pt"
        )["images_kwargs"]
        inputs, reps = proc._process_images([[p] for p in pils], **kw)
        keep = {k: v for k, v in inputs.items() if torch.is_tensor(v)}
        return keep, reps

    def encode(self, messages: Sequence[Message], replacement: str) -> tuple[list[int], list[int]]:
        """Ids and labels of one sample (see the module doc for the two formats)."""
        st = self._load()
        tok = st["tokenizer"]
        if self.fmt == "chat":
            return vlm_sft_labels(tok, messages, st["image_token"], replacement, self.image_markup)
        prompt = (tok.bos_token or "") + replacement + "\n" + messages[0]["content"]
        caption = messages[-1]["content"] + (tok.eos_token or "")
        return encode_segments(tok, [(prompt, False), (caption, True)])

    def _text_start(self, ids: list[int]) -> int:
        """Where the text after the last image token starts (0 without an image token)."""
        image_id = self._load()["image_token_id"]
        return next((i + 1 for i in range(len(ids) - 1, -1, -1) if ids[i] == image_id), 0)

    def cut(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
        """Ids and labels kept: `max_text_len` text tokens after the last image token (the
        text before it, a template's system prompt, is kept whole; the image never cut)."""
        end = self._text_start(ids) + self.max_text_len
        return ids[:end], labels[:end]

    def text_lengths(self, dataset: VLMCaptionDataset, n: int = 256) -> tuple[int, int, int]:
        """(samples checked, samples whose answers `cut` shortens, the most text tokens after
        the image) over `dataset`'s first `n` records as epoch 0 draws them. Raises ValueError
        for a chat template that cannot label them."""
        image_token = self._load()["image_token"]
        checked, shortened, longest = 0, 0, 0
        for index in range(min(n, len(dataset))):
            try:
                messages, _ = dataset.messages(0, index)
            except BadSample:
                continue
            ids, labels = self.encode(messages, image_token)
            kept = self.cut(ids, labels)[1]
            checked += 1
            longest = max(longest, len(ids) - self._text_start(ids))
            shortened += sum(x != IGNORE_INDEX for x in kept) < sum(
                x != IGNORE_INDEX for x in labels
            )
        return checked, shortened, longest

    def prompt_ids(self, messages: Sequence[Message], replacement: str) -> list[int]:
        """What decoding continues: everything before the last assistant turn's content."""
        st = self._load()
        tok = st["tokenizer"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if self.fmt == "chat":
            text = _render(tok, messages[:last], self.image_markup, gen=True)
        else:
            text = (tok.bos_token or "") + st["image_token"] + "\n" + messages[0]["content"]
        text = text.replace(st["image_token"], replacement, 1)
        return tok(text, add_special_tokens=False)["input_ids"]

    def __call__(self, samples: list[dict[str, Any]]) -> CaptionBatch:
        st = self._load()
        pixel, reps = self.images([s["image"] for s in samples])
        rows, visual = [], []
        for s, rep in zip(samples, reps, strict=True):
            ids, labels = self.encode(s["messages"], rep)
            rows.append(self.cut(ids, labels))
            visual.append(rep.count(st["image_token"]))
        t = max(len(r[0]) for r in rows)
        pad = st["tokenizer"].pad_token_id or 0
        ids = torch.full((len(rows), t), pad, dtype=torch.long)  # (B, T)
        labels = torch.full((len(rows), t), IGNORE_INDEX, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(rows), t), dtype=torch.long)  # (B, T)
        for i, (row_ids, row_labels) in enumerate(rows):
            ids[i, : len(row_ids)] = torch.tensor(row_ids)
            labels[i, : len(row_labels)] = torch.tensor(row_labels)
            mask[i, : len(row_ids)] = 1
        batch: CaptionBatch = {
            "images": pixel,
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "index": torch.tensor([s["index"] for s in samples]),
            "visual_tokens": torch.tensor(visual),
        }
        if "refs" in samples[0]:
            batch["prompt_ids"] = [
                self.prompt_ids(s["messages"], r) for s, r in zip(samples, reps, strict=True)
            ]
            batch["refs"] = [s["refs"] for s in samples]
        return batch


def load_processor(path: str, model_type: str) -> dict[str, Any]:
    """Tokenizer, image side and image token of a VLM's processor folder, without torchvision:
    patch-grid VLMs read their PIL image processor (the Qwen-VL processors need torchvision
    for their video half), the others their own ``AutoProcessor``."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    kw = {"local_files_only": True}
    st: dict[str, Any] = {"grid": None}
    if model_type in GRID_VLMS:
        tok = AutoTokenizer.from_pretrained(path, **kw)
        st["image_processor"] = AutoImageProcessor.from_pretrained(path, backend="pil", **kw)
        st["grid"] = read_patch_grid(st["image_processor"])
        st["image_token"] = "<|image_pad|>"
    else:
        proc = AutoProcessor.from_pretrained(path, **kw)
        tok, st["processor"], st["image_token"] = proc.tokenizer, proc, proc.image_token
    st["tokenizer"] = tok
    st["image_token_id"] = tok.convert_tokens_to_ids(st["image_token"])
    return st
