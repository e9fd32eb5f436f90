"""Collate image-text samples into the inputs of an HF embedder, using the model's own processor.

`HFCollate(path, kind, ...)` loads the tokenizer, image processor and model config from the same
local directory as the embedder (`vltrain.models.hf_embedders`), lazily and once per process,
so it pickles cheaply into DataLoader workers. Image processors always use the PIL backend
(no torchvision). For VLMs the composite HF processor is not used (in transformers 5.x the
Qwen-VL processors need torchvision for their video half); this module does its one job for
images instead: chat-template prompt, image-token expansion, ``mm_token_type_ids``.

Batch keys (`vltrain.data.batches.ImageTextBatch`, which `ContrastiveModel.embed` reads):

- ``images``: CLIP/SigLIP: pixel values (B, 3, S, S). VLM: a dict of image-side inputs
  (``input_ids``, ``attention_mask``, ``pixel_values``, and for Qwen-VL ``image_grid_thw`` and
  ``mm_token_type_ids``) for `VLMEmbedder.encode_image`.
- ``input_ids`` / ``attention_mask``: (B, T) text side; ``neg_ids`` / ``neg_mask``: (M, T) hard
  negatives when any sample has them; ``pair_ids`` / ``pair_mask``: (B, T) every sample's second
  caption (``text2``) when all have one (``objective.caption_contrast``).
- ``visual_tokens``: (B,) LongTensor, language-model tokens (VLM) or patches (CLIP/SigLIP) each
  image costs, for logging. With ``max_visual_tokens`` set (patch-grid VLMs only) every entry is
  ``<= max_visual_tokens`` by construction (see `vltrain.data.visual_tokens`).
- ``index``: (B,) sample indices when samples carry them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from vltrain.data.batches import ImageTextBatch
from vltrain.data.collate import add_text_extras
from vltrain.data.images import load_image_native
from vltrain.data.visual_tokens import PatchGrid, read_patch_grid, resize_for_budget

# How each embedder kind pads text: SigLIP pools the last position, so it needs max_length.
TEXT_PADDING = {"hf_clip": "longest", "hf_siglip": "max_length", "vlm": "longest"}
#: where a VLM's instruction goes (`HFCollate._words`)
INSTRUCTION_ROLES = ("user", "system")
# VLM families by config.model_type: how many placeholder tokens one image takes.
GRID_VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FIXED_VLMS = ("llava",)


def to_pil(image: Any) -> Image.Image:
    """RGB PIL image from a PIL image, a (3, H, W) float tensor in [0, 1], or a file path."""
    if isinstance(image, Image.Image):
        return image.convert("RGB") if image.mode != "RGB" else image
    if torch.is_tensor(image):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"image tensor must be (3, H, W) in [0, 1], got {tuple(image.shape)}")
        arr = (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)  # (3, H, W)
        return Image.fromarray(np.ascontiguousarray(arr.permute(1, 2, 0).cpu().numpy()))
    if isinstance(image, (str, os.PathLike)):
        return load_image_native(image)  # raises BadSample for undecodable files
    raise TypeError(f"image must be a PIL image, a (3, H, W) tensor or a path, got {type(image)}")


class HFCollate:
    """Picklable collate for `EMBEDDERS` kinds; options must match the embedder's."""

    def __init__(
        self,
        path: str | Path,
        kind: str,
        max_text_len: int = 64,
        max_visual_tokens: int | None = None,
        instruction_query: str = "",
        instruction_doc: str = "",
        local_files_only: bool = True,
        instruction_role: str = "user",
    ) -> None:
        if kind not in TEXT_PADDING:
            raise KeyError(f"unknown embedder kind {kind!r}; known: {sorted(TEXT_PADDING)}")
        if max_text_len <= 0:
            raise ValueError(f"max_text_len must be positive, got {max_text_len}")
        if max_visual_tokens is not None and max_visual_tokens <= 0:
            raise ValueError(f"data.max_visual_tokens must be positive, got {max_visual_tokens}")
        if instruction_role not in INSTRUCTION_ROLES:
            raise ValueError(f"instruction_role must be one of {INSTRUCTION_ROLES}")
        self.path, self.kind = str(path), kind
        self.max_text_len = max_text_len
        self.max_visual_tokens = max_visual_tokens
        self.instruction_query = instruction_query
        self.instruction_doc = instruction_doc
        self.local_files_only = local_files_only
        self.instruction_role = instruction_role
        self._loaded: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loaded": None}  # workers reload from the local dir

    # ---- loading -----------------------------------------------------------------------

    def _load(self) -> dict[str, Any]:
        if self._loaded is not None:
            return self._loaded
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

        kw = {"local_files_only": self.local_files_only}
        cfg = AutoConfig.from_pretrained(self.path, **kw)
        st: dict[str, Any] = {
            "config": cfg,
            "tok": AutoTokenizer.from_pretrained(self.path, **kw),
            "ip": AutoImageProcessor.from_pretrained(self.path, backend="pil", **kw),
            "grid": None,
        }
        if self.kind == "vlm":
            self._check_vlm(cfg, st)
        elif self.max_visual_tokens is not None:
            raise ValueError(self._budget_error(cfg.model_type))
        self._loaded = st
        return st

    def _budget_error(self, model_type: str) -> str:
        return (
            f"data.max_visual_tokens={self.max_visual_tokens} is set, but {self.path} "
            f"({model_type}) has a fixed image size; the budget only applies to patch-grid "
            f"VLMs ({', '.join(GRID_VLMS)}). Unset data.max_visual_tokens."
        )

    def _check_vlm(self, cfg: Any, st: dict[str, Any]) -> None:
        mt = cfg.model_type
        if mt not in GRID_VLMS + FIXED_VLMS:
            raise ValueError(
                f"{self.path}: VLM type {mt!r} is not supported; supported: "
                f"{', '.join(GRID_VLMS + FIXED_VLMS)}."
            )
        tok = st["tok"]
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                f"{self.path}: the tokenizer has no chat template; VLM prompts are "
                "built with it. Add chat_template.jinja to the model directory."
            )
        image_id = getattr(cfg, "image_token_id", None)
        if image_id is None:
            image_id = cfg.image_token_index
        st["image_token_id"] = int(image_id)
        st["image_token"] = tok.convert_ids_to_tokens(int(image_id))
        if mt in GRID_VLMS:
            st["grid"] = read_patch_grid(st["ip"])
        elif self.max_visual_tokens is not None:
            raise ValueError(self._budget_error(mt))
        else:
            v = cfg.vision_config
            n = (v.image_size // v.patch_size) ** 2
            st["fixed_tokens"] = n + (1 if cfg.vision_feature_select_strategy == "full" else 0)

    # ---- batches -----------------------------------------------------------------------

    def __call__(self, samples: list[dict[str, Any]]) -> ImageTextBatch:
        """Samples ``{"image", "text", "negatives"?, "index"?}`` -> batch (see module doc)."""
        images, tokens = self.image_batch([s["image"] for s in samples])
        ids, mask = self.text_batch([s["text"] for s in samples])
        batch: ImageTextBatch = {
            "images": images,
            "input_ids": ids,
            "attention_mask": mask,
            "visual_tokens": tokens,
        }
        if all("index" in s for s in samples):
            batch["index"] = torch.tensor([s["index"] for s in samples])
        return add_text_extras(batch, samples, self.text_batch)

    def _instructions(self, n: int, instructions: list[str] | None, role: str) -> list[str]:
        """Per-row VLM instructions: a record's own, else the configured one of `role`."""
        default = self.instruction_query if role == "query" else self.instruction_doc
        return [
            (instructions[i] if instructions and instructions[i] else default) for i in range(n)
        ]

    def text_batch(
        self, texts: list[str], instructions: list[str] | None = None, role: str = "query"
    ) -> tuple[Tensor, Tensor]:
        """Token ids (N, T) and mask (N, T) for a text side. VLMs: the chat prompt holds the
        row's instruction (else `instruction_query` / `instruction_doc` by `role`)."""
        st = self._load()
        tok = st["tok"]
        if self.kind != "vlm":
            enc = tok(
                list(texts),
                padding=TEXT_PADDING[self.kind],
                truncation=True,
                max_length=self.max_text_len,
                return_tensors="pt",
            )
            return enc["input_ids"], enc["attention_mask"]
        instr = self._instructions(len(texts), instructions, role)
        words, systems = self._words(instr, [self._clip_text(tok, t) for t in texts])
        prompts = [
            self._chat(tok, None, w, system) for w, system in zip(words, systems, strict=True)
        ]
        enc = tok(prompts, padding="longest", add_special_tokens=False, return_tensors="pt")
        return enc["input_ids"], enc["attention_mask"]

    def image_batch(
        self,
        images: list[Any],
        texts: list[str] | None = None,
        instructions: list[str] | None = None,
        role: str = "doc",
    ) -> tuple[Any, Tensor]:
        """Image-side inputs and per-image visual-token counts (B,).

        VLMs: one chat prompt per row, the image then the row's instruction (else the
        configured one of `role`) and, for an image+text side, its text (`texts`)."""
        st = self._load()
        pils = [to_pil(im) for im in images]
        if texts is not None and self.kind != "vlm":
            raise ValueError(f"{self.kind} encodes images or texts, not image+text inputs")
        words = systems = None
        if self.kind == "vlm":
            tok = st["tok"]
            instr = self._instructions(len(pils), instructions, role)
            extra = [self._clip_text(tok, t) for t in texts] if texts else [""] * len(pils)
            words, systems = self._words(instr, extra)
        if self.kind != "vlm":
            pix = st["ip"](images=pils, return_tensors="pt")["pixel_values"]  # (B, 3, S, S)
            v = st["config"].vision_config
            n = (v.image_size // v.patch_size) ** 2
            return pix, torch.full((len(pils),), n, dtype=torch.long)
        if st["grid"] is not None:
            return self._grid_images(st, pils, words, systems)
        pix = st["ip"](images=pils, return_tensors="pt")["pixel_values"]  # (B, 3, S, S)
        counts = [st["fixed_tokens"]] * len(pils)
        inputs = self._image_prompts(st, counts, words, systems)
        inputs["pixel_values"] = pix
        return inputs, torch.tensor(counts, dtype=torch.long)

    def _grid_images(
        self, st: dict[str, Any], pils: list[Image.Image], words: list[str], systems: list[str]
    ) -> tuple[Any, Tensor]:
        g: PatchGrid = st["grid"]
        kw: dict[str, Any] = {}
        if self.max_visual_tokens is not None:
            pils = [
                resize_for_budget(
                    im, g.patch_size, g.merge_size, self.max_visual_tokens, g.min_pixels
                )[0]
                for im in pils
            ]
            kw["do_resize"] = False  # the budget already fixed the size; no second rule
        out = st["ip"](images=pils, return_tensors="pt", **kw)
        grid_thw = out["image_grid_thw"]  # (B, 3) patches, before merging
        counts = [int(t.prod()) // g.merge_size**2 for t in grid_thw]
        inputs = self._image_prompts(st, counts, words, systems)
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == st["image_token_id"]).to(torch.int)
        inputs["pixel_values"] = out["pixel_values"]  # (sum patches, C * t * p * p)
        inputs["image_grid_thw"] = grid_thw
        return inputs, torch.tensor(counts, dtype=torch.long)

    def _words(self, instr: list[str], texts: list[str]) -> tuple[list[str], list[str]]:
        """Per row, the user turn's text and the system message: the instruction heads the
        text (`instruction_role` user) or is the system message (system: Qwen3-VL-Embedding's
        layout, "Represent the user's input." by default there)."""
        if self.instruction_role == "system":
            return texts, instr
        return [i + t for i, t in zip(instr, texts, strict=True)], [""] * len(texts)

    def _image_prompts(
        self, st: dict[str, Any], counts: list[int], words: list[str], systems: list[str]
    ) -> dict[str, Tensor]:
        """Chat-template prompts (image, then the row's words; its system message) with the
        image placeholder repeated to each image's count."""
        tok, image_token = st["tok"], st["image_token"]
        prompts = []
        for n, text, system in zip(counts, words, systems, strict=True):
            base = self._chat(tok, image_token, text, system)
            if base.count(image_token) != 1:
                raise ValueError(
                    f"{self.path}: the chat template rendered {base.count(image_token)} image "
                    f"placeholders ({image_token!r}) for one image; expected exactly 1."
                )
            prompts.append(base.replace(image_token, image_token * n))
        enc = tok(prompts, padding="longest", add_special_tokens=False, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    @staticmethod
    def _chat(tok: Any, image_token: str | None, text: str, system: str = "") -> str:
        content: list[dict[str, str]] = [{"type": "image"}] if image_token else []
        if text:
            content.append({"type": "text", "text": text})
        head: list[dict[str, Any]] = (
            [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
        )
        msgs = [*head, {"role": "user", "content": content}]
        out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if image_token and image_token not in out:
            # a text-only template (a causal LM's, as model.kind=llava runs keep): the image is
            # a "<image>\n" line before the text, the LLaVA-1.5 convention the llava kind uses
            head = [{"role": "system", "content": system}] if system else []
            msgs = [*head, {"role": "user", "content": f"{image_token}\n{text}"}]
            out = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return out

    def _clip_text(self, tok: Any, text: str) -> str:
        """Cut a caption to max_text_len tokens BEFORE templating, so the prompt's end
        (where EOS pooling reads) is never truncated away."""
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return text if len(ids) <= self.max_text_len else tok.decode(ids[: self.max_text_len])


def move_to(batch: Any, device: torch.device | str) -> Any:
    """Tensors of a (nested) batch onto `device`; VLM batches hold a dict under ``images``."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch
