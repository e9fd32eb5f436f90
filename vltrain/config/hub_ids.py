"""How config values name Hugging Face Hub repositories (syntax only; `vltrain.core.hub` finds
them in the HF cache).

- A model key (``model.path``, ``model.target``) takes a local folder or a hub id ``org/name``.
  A local path that exists always wins: ``org/name`` may be a relative folder.
- A data key (``data.train``, ``data.eval``, ``data.test``) takes ``hf://datasets/org/name``,
  optionally with its split: ``hf://datasets/org/name:validation`` (a split may slice, as in
  ``datasets``: ``train[:10%]``). Loading a config pins the split of a value without one:
  ``data.split`` for data.train, ``validation`` for data.eval and ``test`` for data.test, so the
  resolved config.yaml names every split it read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vltrain.config.core import ConfigError

DATASET_PREFIX = "hf://datasets/"
#: a repository id: ``org/name`` (letters, digits, ``-``, ``_``, ``.``; not starting with one)
_REPO_ID = r"[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*"
_MODEL_ID = re.compile(_REPO_ID)
_DATASET = re.compile(re.escape(DATASET_PREFIX) + rf"({_REPO_ID})(?::(.+))?")
#: the split a data key reads when its hub value names none (data.train: data.split)
DEFAULT_SPLITS = {"eval": "validation", "test": "test"}


def is_model_id(value: str) -> bool:
    """True when `value` reads as a hub model id (``org/name``) and is no existing local path."""
    value = str(value)
    if not _MODEL_ID.fullmatch(value) or value.endswith(".gguf"):
        return False
    return not Path(value).exists()


def parse_dataset(value: str) -> tuple[str, str | None] | None:
    """(repo id, split or None) of ``hf://datasets/org/name[:split]``; None for anything else
    (a local path that exists, a deeper ``hf://`` path such as tar shards in a dataset repo)."""
    m = _DATASET.fullmatch(str(value))
    if m is None or Path(str(value)).exists():
        return None
    return m.group(1), m.group(2)


def dataset_spec(repo_id: str, split: str) -> str:
    """``hf://datasets/org/name:split``."""
    return f"{DATASET_PREFIX}{repo_id}:{split}"


def pin_splits(data: Any) -> None:
    """Write the split into every hub-dataset value of `data` (a DataConfig) that names none;
    refuse a non-default data.split that no hub value of data.train would read."""
    for key in ("train", "eval", "test"):
        parsed = parse_dataset(getattr(data, key))
        if parsed is None:
            continue
        repo_id, split = parsed
        if split is None:
            split = data.split if key == "train" else DEFAULT_SPLITS[key]
            setattr(data, key, dataset_spec(repo_id, split))
    train = parse_dataset(data.train)
    if data.split != "train" and (train is None or train[1] != data.split):
        raise ConfigError(
            f"'data.split'={data.split!r} names the split of a hub dataset in data.train "
            f"({DATASET_PREFIX}org/name), but data.train={data.train!r} reads "
            + ("another split" if train else "no hub dataset")
            + f"; drop data.split or name the split in the value ({DATASET_PREFIX}org/name:SPLIT)"
        )
