"""Named model sizes as data. Architecture code never looks at these names.

``tiny`` trains on a 2-core CPU in seconds; ``tiny_cnn`` is a CNN of the same size behind the
same tower interface (conv stem, flatten head, no transformer blocks), the quickstart's image
tower; ``small`` is about twice as wide and deep;
``base`` matches CLIP ViT-B/16 (vision) and CLIP's 12-layer 512-wide text transformer.
"""

from __future__ import annotations

import difflib
from typing import Any

from vltrain.config.core import ConfigError
from vltrain.models.text import TextTowerConfig
from vltrain.models.vit import NORMS, POOLS, STEMS, VisionTowerConfig

VISION_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"image_size": 64, "patch_size": 8, "width": 128, "layers": 2, "heads": 4},
    # a small CNN with the tower interface: conv stem to an 8x8 grid, flatten head, no blocks
    # (stem channels 16-32-64: the same accuracy per step as 32-64-128 on the quickstart data
    # at half the cost; bench/quickstart_reference.py)
    "tiny_cnn": {
        "image_size": 64,
        "patch_size": 8,
        "width": 128,
        "layers": 0,
        "heads": 4,
        "stem": "conv",
        "stem_channels": (16, 32, 64),
        "pool": "flatten",
    },
    "small": {"image_size": 96, "patch_size": 8, "width": 256, "layers": 4, "heads": 4},
    "base": {"image_size": 224, "patch_size": 16, "width": 768, "layers": 12, "heads": 12},
}

TEXT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"context_length": 32, "width": 128, "layers": 2, "heads": 4},
    "small": {"context_length": 64, "width": 256, "layers": 4, "heads": 4},
    "base": {"context_length": 77, "width": 512, "layers": 12, "heads": 8},
}

#: vision tower fields that take one of a few names (VisionTowerConfig checks the same)
VISION_CHOICES: dict[str, tuple[str, ...]] = {"stem": STEMS, "stem_norm": NORMS, "pool": POOLS}

# Projection size a dual encoder of this text preset usually uses.
EMBED_DIMS: dict[str, int] = {"tiny": 128, "small": 256, "base": 512}


def _lookup(table: dict[str, dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    if name not in table:
        close = difflib.get_close_matches(name, list(table), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown {kind} preset {name!r}; choose one of {sorted(table)}.{hint}")
    return dict(table[name])


def vision_config(name: str, **overrides: Any) -> VisionTowerConfig:
    """The ``VisionTowerConfig`` of preset ``name`` with ``overrides`` applied; a value the
    tower refuses is a ConfigError (a ValueError) naming the config keys that set it."""
    for field, allowed in VISION_CHOICES.items():  # only model.vision_options sets these
        if field in overrides and overrides[field] not in allowed:
            raise ConfigError(
                f"model.vision_options: {field} must be one of {list(allowed)}, got "
                f"{overrides[field]!r}"
            )
    dims = {**_lookup(VISION_PRESETS, "vision", name), **overrides}
    return _tower(VisionTowerConfig, "vision", name, dims)


def text_config(name: str, vocab_size: int, **overrides: Any) -> TextTowerConfig:
    """The ``TextTowerConfig`` of preset ``name`` for a tokenizer with ``vocab_size`` ids; a
    value the tower refuses is a ConfigError, as in `vision_config`."""
    dims = {**_lookup(TEXT_PRESETS, "text", name), **overrides, "vocab_size": vocab_size}
    return _tower(TextTowerConfig, "text", name, dims)


def _tower(make: type, side: str, name: str, dims: dict[str, Any]) -> Any:
    """``make(**dims)``; its ValueError becomes a ConfigError naming the keys a user sets. The
    config check builds the towers (`preflight.check_memory`) and passes a ConfigError on, so
    a bad option fails at load instead of as a traceback after the tokenizer trained."""
    try:
        return make(**dims)
    except ValueError as e:
        reason = str(e).removeprefix(f"{make.__name__}: ")
        raise ConfigError(
            f"the {side} tower (model.{side}={name!r} with model.{side}_options, "
            f"model.{side}_layers, model.{side}_width): {reason}"
        ) from None
