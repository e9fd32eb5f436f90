"""`load_run`: a trained run, or one checkpoint of it, as a Python object.

    run = load_run("runs/clip")                     # the run's best checkpoint, else its newest
    run.embed_texts(["a red circle"])               # (1, D) float32, unit norm
    run.embed_images(["cat.png", pil_image])        # (2, D) float32, unit norm
    load_run("runs/caption").generate(["cat.png"])  # ["a cat on a mat"]

Embeddings go through the run's own evaluation path, the one `vltrain eval` and `vltrain mine`
embed with: the model and batcher its stage builds from the checkpoint (the run's tokenizer and
`data.max_text_len`, an HF backbone's processor, a VLM's instructions and visual-token budget)
and images decoded by `vltrain.data.images` at the run's `data.image_size` (at their native
size for HF backbones). So `run.embed_images(paths)` is what evaluation computed for those
images, up to float rounding across batch sizes. Captions use `vltrain generate`'s prompt
(`caption.prompt`, or the SFT instruction) and its decoding (`vltrain.inference`).

One process, no gradients; `device` picks where the model runs.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageOps
from torch import Tensor, nn

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config, load_config
from vltrain.core.checkpoint import resolve_loadable
from vltrain.data import chat
from vltrain.data.batches import to_device
from vltrain.data.images import (
    DEFAULT_MAX_PIXELS,
    BadSample,
    check_text,
    load_image,
    load_image_native,
)
from vltrain.data.pairs import encode_side, side_inputs
from vltrain.engine.task import Stage
from vltrain.inference.captioning import decode_captions
from vltrain.inference.decoding import generate
from vltrain.inference.vlm_captioning import caption_target, prompt_inputs
from vltrain.models.backbones import HF_KINDS
from vltrain.stages.caption_hf_checks import HF_CAPTION_KINDS
from vltrain.tools.generate import generation_prompt
from vltrain.tools.generate_vlm_run import caption_chat
from vltrain.tools.loading import load_trained, run_config_for

__all__ = ["ImageInput", "TrainedRun", "load_run"]

#: an image to embed or caption: a file path, or a PIL image (used as its pixels)
ImageInput = str | os.PathLike[str] | Image.Image

#: stage -> what a run of it does here
EMBEDS, GENERATES = ("contrastive",), ("caption", "rl")
ROLES = ("query", "doc")
#: modes a PNG stores losslessly; any other mode (F, I;16, CMYK, ...) travels as TIFF
PNG_MODES = ("1", "L", "LA", "P", "RGB", "RGBA")


class TrainedRun:
    """A trained run loaded for inference (built by `load_run`).

    Attributes:
        cfg: the run's resolved config (its ``config.yaml``).
        model: the trained module in eval mode: a contrastive run's ``ContrastiveModel``
            (``model.encoder`` is the dual encoder or HF embedder), a caption or rl run's
            captioner.
        checkpoint: the checkpoint folder the weights came from.
    """

    def __init__(self, cfg: Config, stage: Stage, model: nn.Module, checkpoint: Path) -> None:
        self.cfg, self.model, self.checkpoint = cfg, model, checkpoint
        self._stage = stage

    def __repr__(self) -> str:
        return f"TrainedRun({str(self.checkpoint)!r}, stage={self.cfg.stage!r})"

    @property
    def device(self) -> torch.device:
        """Where the model's weights are."""
        return next(self.model.parameters()).device

    # ---- embedding ----------------------------------------------------------------------

    def embed_texts(
        self,
        texts: Sequence[str],
        *,
        role: str = "query",
        instruction: str | None = None,
        batch_size: int = 0,
    ) -> Tensor:
        """Unit-norm float32 embeddings (N, D) of `texts`, in order (on the CPU).

        Texts are stripped of surrounding whitespace, as evaluation reads them. `role`
        (``query`` or ``doc``) and `instruction` matter to VLM embedders only: the prompt holds
        `instruction`, else the run's ``model.instruction_query`` / ``model.instruction_doc``.
        `batch_size`: texts encoded together (0: the run's ``data.eval_batch_size``, else
        ``data.batch_size``). Raises ValueError for an empty or invalid text.
        """
        rows = _inputs(texts, "texts", "embed_texts")
        self._require(EMBEDS, "embed_texts")
        _check_role(role, "embed_texts")
        sides = []
        for i, text in enumerate(rows):
            try:
                sides.append({"text": check_text(text, f"texts[{i}]"), "image": None})
            except BadSample as e:
                raise ValueError(f"embed_texts: {e}") from None
        return self._embed(sides, "text", role, instruction, batch_size)

    def embed_images(
        self,
        images: Sequence[ImageInput],
        *,
        role: str = "doc",
        instruction: str | None = None,
        batch_size: int = 0,
    ) -> Tensor:
        """Unit-norm float32 embeddings (N, D) of `images` (paths or PIL images), in order.

        A file is decoded as training and evaluation decode it (EXIF orientation, alpha over
        white, the run's ``data.image_size``; a JPEG may be decoded at a reduced DCT scale
        first); a PIL image is used as the pixels it holds. `role`, `instruction` and
        `batch_size` as in `embed_texts`. Raises ValueError naming an image that cannot be
        used (missing, truncated, not an image, ...).
        """
        rows = _inputs(images, "images", "embed_images")
        self._require(EMBEDS, "embed_images")
        _check_role(role, "embed_images")
        bs = self._batch_size(batch_size)
        parts = []
        for start in range(0, len(rows), bs):  # decode one batch at a time
            sides = [
                {"text": None, "image": self._decode(image, start + i, "embed_images")}
                for i, image in enumerate(rows[start : start + bs])
            ]
            parts.append(self._embed(sides, "image", role, instruction, bs))
        return torch.cat(parts)

    def _embed(
        self,
        sides: list[dict[str, Any]],
        kind: str,
        role: str,
        instruction: str | None,
        batch_size: int,
    ) -> Tensor:
        """(N, D) through `vltrain eval`'s corpus path: `side_inputs` + `encode_side`."""
        bs = self._batch_size(batch_size)
        encoder, batcher = self.model.encoder, self._stage.batcher  # type: ignore[attr-defined]
        out = []
        with torch.no_grad(), self._stage.ctx.autocast():  # as the run's evaluation embeds
            for start in range(0, len(sides), bs):
                part = sides[start : start + bs]
                instructions = [instruction or ""] * len(part)  # '' = the run's default
                inputs, _ = side_inputs(batcher, role, kind, part, instructions)
                emb = encode_side(encoder, kind, to_device(inputs, self.device))  # (b, D)
                out.append(emb.float().cpu())
        return torch.cat(out)

    # ---- captioning ---------------------------------------------------------------------

    def generate(
        self,
        images: Sequence[ImageInput],
        *,
        prompt: str | None = None,
        strategy: str = "greedy",
        num_beams: int = 5,
        max_new_tokens: int = 24,
        batch_size: int = 16,
        seed: int = 0,
    ) -> list[str]:
        """One caption per image (paths or PIL images), as `vltrain generate` writes them.

        `prompt`: the text the caption continues (an SFT run: the user turn); None: the one the
        run was trained with. `strategy`: ``greedy``, ``beam`` (`num_beams` wide) or
        ``sample`` (nucleus sampling seeded by `seed`, from a generator of its own).
        Raises ValueError naming an image that cannot be used.
        """
        rows = _inputs(images, "images", "generate")
        self._require(GENERATES, "generate")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        generator = torch.Generator(self.device).manual_seed(seed)
        options = {"strategy": strategy, "num_beams": num_beams, "generator": generator}
        options["max_new_tokens"] = max_new_tokens
        if self.cfg.model.kind in HF_CAPTION_KINDS:
            return self._generate_vlm(rows, prompt, batch_size, options)
        tokenizer = self._stage.tokenizer  # type: ignore[attr-defined]
        prompt_ids = chat.encode_prompt(tokenizer, generation_prompt(self.cfg, prompt))
        captions: list[str] = []
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                part = rows[start : start + batch_size]
                pixels = torch.stack(
                    [self._decode(im, start + i, "generate") for i, im in enumerate(part)]
                )  # (b, 3, S, S)
                captions += decode_captions(
                    self.model,  # type: ignore[arg-type]
                    tokenizer,
                    pixels.to(self.device),
                    [prompt_ids] * len(part),
                    **options,
                )
        return captions

    def _generate_vlm(
        self, rows: list[Any], prompt: str | None, batch_size: int, options: dict[str, Any]
    ) -> list[str]:
        """`generate` for the HF VLM kinds: the run's collate builds the prompts (the image,
        then the user turn) and the one decoder loop runs over the model, as `vltrain generate
        --checkpoint` does (`tools.generate_vlm_run`)."""
        core = self._stage.core  # type: ignore[attr-defined]
        turns = caption_chat(self.cfg, prompt)
        pad = core.tokenizer.pad_token_id if core.tokenizer.pad_token_id is not None else 0
        target = caption_target(self.model, pad)
        captions: list[str] = []
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                samples = [
                    {"image": self._decode(im, start + i, "generate", native=True)}
                    for i, im in enumerate(rows[start : start + batch_size])
                ]
                for i, sample in enumerate(samples):  # refs: the collate builds eval prompts
                    sample.update(messages=turns, index=start + i, refs=["-"])
                batch = core.collate(samples)
                inputs = prompt_inputs(self.model, batch["images"], batch["prompt_ids"], pad)
                out = generate(target, inputs, **options)
                seqs = [
                    s[: int(n)].tolist() for s, n in zip(out.sequences, out.lengths, strict=True)
                ]
                texts = core.tokenizer.batch_decode(seqs, skip_special_tokens=True)
                captions += [t.strip() for t in texts]
        return captions

    # ---- helpers ------------------------------------------------------------------------

    def _require(self, stages: tuple[str, ...], method: str) -> None:
        """A clear error when `method` does not apply to this run's stage."""
        if self.cfg.stage in stages:
            return
        does = (
            "embeds texts and images (run.embed_texts, run.embed_images)"
            if self.cfg.stage in EMBEDS
            else "captions images (run.generate)"
        )
        raise ConfigError(
            f"{method} needs a {' or '.join(stages)} run; {self.checkpoint} is a "
            f"'{self.cfg.stage}' run, which {does}"
        )

    def _batch_size(self, batch_size: int) -> int:
        if batch_size < 0:
            raise ValueError(f"batch_size must be >= 0 (0: the run's), got {batch_size}")
        d = self.cfg.data
        return batch_size or d.eval_batch_size or d.batch_size

    def _decode(self, image: ImageInput, index: int, method: str, native: bool = False) -> Any:
        """(3, S, S) in [0, 1], or a native-size RGB PIL image for HF backbones (`native`: the
        HF VLM captioners, whose processors resize too)."""
        if isinstance(image, Image.Image):
            label, data = f"images[{index}] (a PIL image)", _encoded(image)
        elif isinstance(image, (str, os.PathLike)):
            label, data = os.fspath(image), None
        else:
            raise TypeError(
                f"{method}: images[{index}] is a {type(image).__name__}; pass file paths or "
                "PIL images"
            )
        try:
            if native or self.cfg.model.kind in HF_KINDS:  # their processors resize
                return load_image_native(label, DEFAULT_MAX_PIXELS, data=data)
            return load_image(label, self.cfg.data.image_size, DEFAULT_MAX_PIXELS, data=data)
        except BadSample as e:
            raise ValueError(f"{method}: images[{index}] cannot be used: {e}") from None


def _inputs(items: Any, name: str, method: str) -> list[Any]:
    """`items` as a non-empty list; one bare string is refused (it is not N inputs)."""
    if isinstance(items, (str, bytes, os.PathLike, Image.Image)):
        raise TypeError(f"{method} takes a list of {name}; wrap the single one in a list")
    rows = list(items)
    if not rows:
        raise ValueError(f"{method}: no {name} given")
    return rows


def _check_role(role: str, method: str) -> None:
    if role not in ROLES:
        raise ValueError(f"{method}: role must be one of {ROLES}, got {role!r}")


def _encoded(image: Image.Image) -> bytes:
    """A PIL image as lossless file bytes, EXIF orientation applied, so it goes through the
    same checked decoder as an image file."""
    upright = ImageOps.exif_transpose(image)
    buf = io.BytesIO()
    upright.save(buf, format="PNG" if upright.mode in PNG_MODES else "TIFF")
    return buf.getvalue()


def load_run(
    run: str | os.PathLike[str], device: str = "cpu", overrides: list[str] | None = None
) -> TrainedRun:
    """Load a trained contrastive, caption or rl run for embedding or captioning.

    `run`: a run folder (its best checkpoint, else its newest; one that does not load falls
    back to the newest that does, said on stderr), its ``checkpoints/`` folder, or one
    checkpoint folder (``checkpoints/step_<N>``, ``checkpoints/best``, or a copy of one: it
    carries its tokenizer). `overrides`: dotted config keys applied to the run's config, e.g.
    ``["data.eval_batch_size=64"]``. Nothing is downloaded, trained or written.
    """
    ckpt, skipped = resolve_loadable(run)
    if skipped:
        print(f"vltrain: {skipped}", file=sys.stderr)
    stage = load_config(run_config_for(ckpt), overrides).stage
    if stage not in EMBEDS + GENERATES:
        raise ConfigError(
            f"{ckpt} is a '{stage}' run; load_run loads {', '.join(EMBEDS + GENERATES)} runs "
            "(a drafter speeds up a target's decoding: `vltrain generate --draft`)"
        )
    cfg, stage_obj, model = load_trained(ckpt, overrides, device)
    return TrainedRun(cfg, stage_obj, model, ckpt)
