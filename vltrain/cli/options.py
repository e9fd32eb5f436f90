"""Argument types for the command line: a bad value is a parser error that names the option.

argparse calls `type(text)` and, on `argparse.ArgumentTypeError`, prints
``vltrain <command>: error: argument --beams: must be an integer >= 1, got '0'`` and exits 2,
so a mistake never reaches the code (no unbounded `mine --k 0`, no `generate --beams 0`).
"""

from __future__ import annotations

import argparse
import math


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (counts, sizes, widths)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (0 usually means "none" or "skip")."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def finite_float(text: str) -> float:
    """A finite float (no inf, no nan)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (budgets, rates, deltas, temperatures)."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated integers, e.g. ``0,1,2``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers like 0,1,2, got {text!r}"
        ) from None


def probability(text: str) -> float:
    """A float in [0, 1]."""
    value = finite_float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return value


def positive_probability(text: str) -> float:
    """A float in (0, 1] (a nucleus mass: 0 would keep no token)."""
    value = finite_float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def path_arg(text: str) -> str:
    """A non-empty path (an empty one would silently mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must be a path, got an empty string")
    return text


#: the largest synthetic image side and record count: beyond them a set is a typo, not a plan
MAX_SYNTH_SIDE = 4096
MAX_SYNTH_RECORDS = 10_000_000


def image_size(text: str) -> int:
    """An image side in pixels, in [32, 4096] (the synthetic scenes need room for three shapes;
    a larger one is a typo that would allocate gigabytes per image)."""
    value = _int(text)
    if not 32 <= value <= MAX_SYNTH_SIDE:
        raise argparse.ArgumentTypeError(
            f"must be an integer in [32, {MAX_SYNTH_SIDE}] (pixels), got {text!r}"
        )
    return value


def record_count(text: str) -> int:
    """A synthetic record count, in [0, 10,000,000]."""
    value = non_negative_int(text)
    if value > MAX_SYNTH_RECORDS:
        raise argparse.ArgumentTypeError(
            f"must be at most {MAX_SYNTH_RECORDS:,} records (write larger sets in parts with "
            f"--seed), got {text!r}"
        )
    return value


def add_forward_option(p: argparse.ArgumentParser) -> None:
    """``--forward``: how an HF causal LM runs (``inference.native_llama.causal_lm_target``)."""
    p.add_argument(
        "--forward",
        default="auto",
        choices=("auto", "native", "hf"),
        help="--model: the target's forward; auto = native for Llama/Mistral/Qwen2/Qwen3",
    )
