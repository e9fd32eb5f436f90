"""Planted duplicates for labelled curation benchmarks: image transforms and caption noise.

`transform(img, kind, rng)` makes one near-duplicate of a picture; the kinds are the classes the
benchmark measures recall on. `noisy_caption(text, rng, edits)` applies word-level edits
(drop, duplicate, swap neighbours, replace with a filler word). Both are deterministic in `rng`.
"""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw, ImageEnhance, ImageOps

#: near-duplicate kinds; "exact" is a byte copy under another name, "rerender" is the same scene
#: drawn again by the generator (only the generator can do that; see `vltrain.data.synth`)
KINDS: tuple[str, ...] = ("exact", "resized", "jpeg30", "crop90", "flip", "jitter", "text")
_FILLERS = ("photo", "image", "nice", "very", "the", "a", "of", "with")


def transform(img: Image.Image, kind: str, rng: random.Random) -> Image.Image:
    """One near-duplicate of `img` of the given kind (a new RGB image)."""
    img = img.convert("RGB")
    w, h = img.size
    if kind == "exact":
        return img.copy()
    if kind == "resized":
        f = rng.choice((0.5, 0.75, 1.5))
        return img.resize((max(8, round(w * f)), max(8, round(h * f))), Image.Resampling.BICUBIC)
    if kind == "jpeg30":
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=30)
        return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    if kind == "crop90":
        cw, ch = round(w * 0.9), round(h * 0.9)
        x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
        return img.crop((x0, y0, x0 + cw, y0 + ch))
    if kind == "flip":
        return ImageOps.mirror(img)
    if kind == "jitter":
        out = ImageEnhance.Brightness(img).enhance(rng.uniform(0.8, 1.2))
        out = ImageEnhance.Contrast(out).enhance(rng.uniform(0.8, 1.2))
        return ImageEnhance.Color(out).enhance(rng.uniform(0.7, 1.3))
    if kind == "text":
        out = img.copy()
        draw = ImageDraw.Draw(out)
        y = rng.randint(0, max(0, h - h // 8))
        draw.text((w // 20, y), "(c) stock photo 2024", fill=(255, 255, 255))
        return out
    raise ValueError(f"unknown near-duplicate kind {kind!r}; use one of {KINDS}")


def noisy_caption(text: str, rng: random.Random, edits: int = 1) -> str:
    """`text` with `edits` random word edits (drop, duplicate, swap, replace)."""
    toks = text.split()
    for _ in range(edits):
        if len(toks) < 3:
            break
        i = rng.randrange(len(toks) - 1)
        op = rng.randrange(4)
        if op == 0:
            del toks[i]
        elif op == 1:
            toks.insert(i, toks[i])
        elif op == 2:
            toks[i], toks[i + 1] = toks[i + 1], toks[i]
        else:
            toks[i] = rng.choice(_FILLERS)
    return " ".join(toks)
