"""Exact visual-token budgets for patch-grid VLMs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL style).

These models cut an image into ``patch_size`` (p) pixel patches and merge ``merge_size`` (m) x m
neighbouring patches into one language-model token, so an image resized to a multiple of the
cell size ``f = p * m`` costs ``(H / f) * (W / f)`` tokens. The HF processor bounds *pixels*
(``min_pixels`` / ``max_pixels``), not tokens: a budget in tokens converted to pixels with the
wrong cell size, or the processor's own default ``max_pixels``, lets an image through with more
tokens than ``data.max_visual_tokens``. `fit_to_token_budget` computes the size directly in
grid cells, so the token count is bounded by construction.

The rule (``x, y`` = the image's height and width in cells, scaled together by one factor ``s``):

- If the image at its natural size (each side rounded to the grid like the processor does,
  upscaled to ``min_pixels`` if below it) fits the budget, that size is kept: small images are
  never blown up to fill the budget.
- Otherwise each side is ``s * H / f`` rounded up or down to a whole cell (so each side is at
  most one cell off the exact aspect ratio), never more cells than cover the image
  (``ceil(H / f)``), and among those sizes with ``rows * cols <= max_tokens`` the one with the
  most tokens wins (ties: the smallest aspect-ratio error).

Guarantee (proved in the docstring of `fit_to_token_budget`, checked by the tests): if the image
covers at least ``max_tokens`` cells (``(H / f) * (W / f) >= N``) and its short side spans at
least 9 cells at the budget's exact scale (``min(x, y) >= 9`` with ``x * y = N``), the result
uses at least ``0.9 * N`` tokens.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image


class PatchGrid(NamedTuple):
    """Geometry of a patch-grid image processor; unpacks as (p, m, min_pixels, max_pixels)."""

    patch_size: int
    merge_size: int
    min_pixels: int | None
    max_pixels: int | None

    @property
    def factor(self) -> int:
        """Side of one language-model token in pixels (``patch_size * merge_size``)."""
        return self.patch_size * self.merge_size


def count_visual_tokens(height: int, width: int, patch_size: int, merge_size: int) -> int:
    """Tokens of an image already resized to a multiple of ``patch_size * merge_size``."""
    f = patch_size * merge_size
    if height % f or width % f or height <= 0 or width <= 0:
        raise ValueError(
            f"image size {height}x{width} is not a positive multiple of the {f}-pixel cell "
            f"(patch_size={patch_size} * merge_size={merge_size}); resize it with "
            "fit_to_token_budget first."
        )
    return (height // f) * (width // f)


def natural_size(
    height: int, width: int, factor: int, min_pixels: int | None = None
) -> tuple[int, int]:
    """The processor's own size with no pixel cap: sides rounded to the grid, then up to min_pixels.

    Matches transformers' ``smart_resize`` when its ``max_pixels`` does not bind (it also never
    returns a zero side, which ``smart_resize`` does not guard against without min_pixels).
    """
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if min_pixels and h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def _check_args(height: int, width: int, patch_size: int, merge_size: int, max_tokens: int) -> None:
    for name, v in (
        ("height", height),
        ("width", width),
        ("patch_size", patch_size),
        ("merge_size", merge_size),
        ("max_tokens", max_tokens),
    ):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"fit_to_token_budget: {name} must be a positive int, got {v!r}")


def _best_grid(height: int, width: int, factor: int, max_tokens: int) -> tuple[int, int]:
    """Largest (rows, cols), each within one cell of a common scaling, with rows * cols <= N.

    With ``r = width / height``, ``rows`` is admissible with ``cols`` iff some scale s has
    ``|rows - s*h| < 1`` and ``|cols - s*w| < 1`` (h, w in cells), i.e. ``cols`` lies strictly
    inside ``((rows-1)*r - 1, (rows+1)*r + 1)``; compared in integers, so exact. Only short-side
    lengths near the exact budget scale can win, so a short window of them is searched (the
    tests check this against a brute-force search).
    """
    if height > width:  # search along the short side, where one step changes little
        cols, rows = _best_grid(width, height, factor, max_tokens)
        return rows, cols
    x = math.sqrt(max_tokens * height / width)  # exact rows at the budget's scale
    max_rows, max_cols = -(-height // factor), -(-width // factor)  # cells covering the image
    hi = min(max_rows, max_tokens, math.ceil(x) + 2)
    lo = max(1, min(math.floor(x), hi) - 2)
    best: tuple[int, float, int, int] | None = None
    for rows in range(lo, hi + 1):
        # largest cols with cols * height < (rows + 1) * width + height
        upper = ((rows + 1) * width + height - 1) // height
        cols = min(max_tokens // rows, max_cols, upper)
        if cols < 1 or cols * height <= (rows - 1) * width - height:
            continue
        key = (rows * cols, -abs(math.log(cols * height / (rows * width))))
        if best is None or key > best[:2]:
            best = (*key, rows, cols)
    if best is None:  # the image is under one cell on its short side: only 1 x 1 is left
        return 1, 1
    return best[2], best[3]


def fit_to_token_budget(
    height: int,
    width: int,
    patch_size: int,
    merge_size: int,
    max_tokens: int,
    min_pixels: int | None = None,
) -> tuple[int, int]:
    """(new_h, new_w), multiples of ``patch_size * merge_size``, costing at most ``max_tokens``.

    See the module docstring for the rule. Bound on the result when the image covers at least
    N cells: with ``x <= y`` the exact rows and cols at the budget's scale (``x * y = N``) and
    ``p = floor(x)``, the candidate ``rows = p`` admits ``cols >= min(N // p, floor(y) + 1)``,
    so tokens >= ``min(N - p + 1, p * y) >= N * min(1 - (x - 1) / N, p / (p + 1))``, which is
    >= 0.9 N once ``x >= 9`` (then N >= 81 and ``x - 1 <= sqrt(N) - 1 <= 0.1 N``).
    ``min_pixels`` only governs images already under the budget; the budget always wins.
    """
    _check_args(height, width, patch_size, merge_size, max_tokens)
    f = patch_size * merge_size
    h, w = natural_size(height, width, f, min_pixels)
    if (h // f) * (w // f) <= max_tokens:
        return h, w
    rows, cols = _best_grid(height, width, f, max_tokens)
    return rows * f, cols * f


def resize_for_budget(
    image: Image.Image,
    patch_size: int,
    merge_size: int,
    max_tokens: int,
    min_pixels: int | None = None,
    resample: Image.Resampling = Image.Resampling.BICUBIC,
) -> tuple[Image.Image, int]:
    """Resize a PIL image with `fit_to_token_budget`; returns (image, its visual-token count).

    Pass the result to the HF image processor with ``do_resize=False`` so it is not resized
    again (its min/max_pixels would otherwise apply a second, pixel-based rule).
    """
    w, h = image.size
    new_h, new_w = fit_to_token_budget(h, w, patch_size, merge_size, max_tokens, min_pixels)
    if (new_w, new_h) != (w, h):
        image = image.resize((new_w, new_h), resample)
    return image, count_visual_tokens(new_h, new_w, patch_size, merge_size)


def _grid_from_dict(cfg: dict[str, Any], where: str) -> PatchGrid:
    if "merge_size" not in cfg or "patch_size" not in cfg:
        raise ValueError(
            f"{where}: image processor config has no patch_size/merge_size (keys: {sorted(cfg)}); "
            "data.max_visual_tokens only applies to patch-grid processors (Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL). Unset it for fixed-size models (CLIP, SigLIP, LLaVA)."
        )
    size = cfg.get("size") or {}
    min_px = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    max_px = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    return PatchGrid(
        int(cfg["patch_size"]),
        int(cfg["merge_size"]),
        int(min_px) if min_px else None,
        int(max_px) if max_px else None,
    )


def _config_from_dir(path: Path) -> dict[str, Any]:
    pre = path / "preprocessor_config.json"
    if pre.is_file():
        return json.loads(pre.read_text(encoding="utf-8"))
    proc = path / "processor_config.json"
    if proc.is_file():
        cfg = json.loads(proc.read_text(encoding="utf-8"))
        if isinstance(cfg.get("image_processor"), dict):
            return cfg["image_processor"]
    raise FileNotFoundError(
        f"{path}: no preprocessor_config.json (or processor_config.json with an "
        "'image_processor' entry); point at the model directory saved by save_pretrained."
    )


def read_patch_grid(processor_or_dir: Any) -> PatchGrid:
    """(patch_size, merge_size, min_pixels, max_pixels) of an HF image processor.

    Accepts a model/processor directory, a config dict, an image processor, or a composite
    processor holding one in ``.image_processor``. In transformers 5.x the pixel limits live in
    ``size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}``; older configs kept
    top-level ``min_pixels`` / ``max_pixels``, which take precedence when present.
    """
    if isinstance(processor_or_dir, (str, os.PathLike)):
        return _grid_from_dict(_config_from_dir(Path(processor_or_dir)), str(processor_or_dir))
    if isinstance(processor_or_dir, dict):
        return _grid_from_dict(processor_or_dir, "config dict")
    ip = getattr(processor_or_dir, "image_processor", processor_or_dir)
    cfg = {
        k: getattr(ip, k)
        for k in ("patch_size", "merge_size", "min_pixels", "max_pixels")
        if getattr(ip, k, None) is not None
    }
    size = getattr(ip, "size", None)
    if size is not None:
        cfg["size"] = {
            k: size.get(k) if hasattr(size, "get") else getattr(size, k, None)
            for k in ("shortest_edge", "longest_edge", "min_pixels", "max_pixels")
        }
    return _grid_from_dict(cfg, type(ip).__name__)
