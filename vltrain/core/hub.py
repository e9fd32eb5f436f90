"""Hub ids in the HF cache: where a model id or a hub dataset is on this machine, and the
pre-flight check that every one a run reads is there when nothing may be downloaded.

A model id is checked here and loaded by transformers from the HF hub cache
(``$HF_HOME/hub/models--org--name``); it downloads only with ``model.local_files_only=false``
and without ``HF_HUB_OFFLINE=1``. A hub dataset reads its snapshot in the hub cache
(``datasets--org--name``, e.g. from ``hf download --repo-type dataset``), else goes through
``datasets.load_dataset(org/name, split=...)``, which reads its own cache offline
(``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``) and downloads otherwise. Value syntax:
`vltrain.config.hub_ids`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vltrain.config import extras
from vltrain.config.core import ConfigError
from vltrain.config.hub_ids import is_model_id, parse_dataset


def offline() -> bool:
    """True when HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) forbids downloads."""
    from huggingface_hub import constants

    flag = os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or flag


def cache_folder(repo_id: str, repo_type: str) -> Path:
    """The hub-cache folder of a repository (it may not exist)."""
    from huggingface_hub import constants

    name = "--".join([f"{repo_type}s", *repo_id.split("/")])
    return Path(constants.HF_HUB_CACHE) / name


def cached_snapshot(repo_id: str, repo_type: str = "model") -> Path | None:
    """The cached snapshot folder of the repository's main revision; None when not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except LocalEntryNotFoundError:
        return None


def not_cached(key: str, value: str, where: list[Path], switch: str = "") -> ConfigError:
    """The one-line error for a hub id missing from the cache: where it was looked for, what
    forbids the download (HF_HUB_OFFLINE, else the config key `switch`, else: `key` is read from
    the cache only), and what to set."""
    from huggingface_hub import constants

    repo_id, kind = (value, "model") if is_model_id(value) else (parse_dataset(value)[0], "dataset")
    home = os.environ.get("HF_HOME") or str(Path(constants.HF_HUB_CACHE).parent)
    looked = " or ".join(str(p) for p in where)
    fix = f"download it once where there is network (`hf download {repo_id}"
    fix += " --repo-type dataset`)" if kind == "dataset" else "`)"
    fix += f", or set HF_HOME (now {home}) to the cache that holds it"
    if offline():
        forbids, fix = "HF_HUB_OFFLINE=1 forbids downloading it", fix + ", or unset HF_HUB_OFFLINE"
    elif switch:
        forbids = f"{switch}=true forbids downloading it"
        fix += f", or set {switch}=false to download it at the start of the run"
    else:
        forbids = f"{key} is read from the cache only"
    return ConfigError(
        f"'{key}'={value!r} is not a local path and the hub {kind} {repo_id} is not in the HF "
        f"cache ({looked}), and {forbids}: {fix}"
    )


def check_model_id(value: str, key: str, local_files_only: bool) -> None:
    """A ConfigError when the hub model id `value` is not in the HF cache and may not be
    downloaded (`local_files_only`, HF_HUB_OFFLINE=1). transformers then loads the id itself:
    from the cache, or downloading only the files it needs."""
    extras.require("huggingface_hub", f"'{key}'={value!r} (a hub id)")
    if (local_files_only or offline()) and cached_snapshot(value) is None:
        switch = "model.local_files_only" if key == "model.path" else ""
        raise not_cached(key, value, [cache_folder(value, "model")], switch)


def dataset_cache_folders(repo_id: str) -> list[Path]:
    """Where a hub dataset may be cached: a snapshot in the hub cache, datasets' prepared copy."""
    from datasets import config

    prepared = Path(config.HF_DATASETS_CACHE) / repo_id.replace("/", "___")
    return [cache_folder(repo_id, "dataset"), prepared]


def dataset_splits(snapshot: Path) -> list[str]:
    """The split names of a dataset folder, by datasets' own file-layout rules (README configs,
    ``data/train-*.parquet``, ``train/``, ...)."""
    import datasets

    return list(datasets.load_dataset_builder(str(snapshot)).config.data_files or {})


def load_dataset(value: str) -> tuple[Any, Path | None]:
    """(the `datasets.Dataset` of a pinned ``hf://datasets/org/name:split``, the snapshot folder
    it was read from, or None where `datasets` read or downloaded it itself)."""
    import datasets

    repo_id, split = parse_dataset(value) or (None, None)
    if repo_id is None or split is None:
        raise ValueError(f"{value!r} is not a hub dataset with its split (hf://datasets/ID:SPLIT)")
    snapshot = cached_snapshot(repo_id, "dataset")
    try:
        if snapshot is not None:
            return datasets.load_dataset(str(snapshot), split=split), snapshot
        return datasets.load_dataset(repo_id, split=split), None
    except ValueError as e:  # an unknown split: datasets names the ones there are
        raise ConfigError(f"{value}: {e}") from None


def check_sources(cfg: Any) -> None:
    """Pre-flight: every hub id the run reads is in the HF cache or may be downloaded, a cached
    dataset has the split asked for, and the packages they need are installed; a one-line
    ConfigError otherwise."""
    m = cfg.model
    if m.path and is_model_id(m.path):
        check_model_id(m.path, "model.path", m.local_files_only)
    if m.kind == "hf_lm" and m.target:
        if m.target.endswith(".gguf"):
            extras.require("gguf", f"'model.target'={m.target!r} (a GGUF file)")
        elif is_model_id(m.target):
            check_model_id(m.target, "model.target", True)
    for key in ("train", "eval", "test"):
        value = getattr(cfg.data, key)
        parsed = parse_dataset(value)
        if parsed is None:
            continue
        extras.require("datasets", f"'data.{key}'={value!r} (a hub dataset)")
        repo_id, split = parsed
        folders = dataset_cache_folders(repo_id)
        if offline() and not any(p.is_dir() for p in folders):
            raise not_cached(f"data.{key}", value, folders)
        snapshot = cached_snapshot(repo_id, "dataset")
        names = dataset_splits(snapshot) if snapshot is not None else []
        if names and split and split.split("[")[0] not in names:
            raise ConfigError(
                f"'data.{key}'={value!r}: the dataset has no split {split!r} (it has "
                f"{', '.join(names)}); name one as hf://datasets/{repo_id}:SPLIT"
            )
