"""Typed config machinery: documented dataclass fields, YAML + dotted overrides, validation.

A config is a tree of dataclasses. Every field is declared with `option(default, doc, ...)`
so that its type, documentation, range and choices live where it is declared. Loading merges
defaults -> YAML -> dotted overrides once, then validates every key and value before any
compute, naming the offending key and the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user mistake in a config file or override; the message says what to change."""


def option(
    default: Any,
    doc: str,
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    choices: tuple | None = None,
) -> Any:
    """Declare a config field with its documentation and constraints."""
    meta = {"doc": doc, "ge": ge, "le": le, "gt": gt, "choices": choices}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def check_choice(key: str, value: str, table: Any, what: str = "") -> None:
    """Raise a ConfigError naming `key` when `value` is not a key of the registry `table`.

    Registry-backed keys (stage, model.kind, objective.loss, model.connector) are declared
    without fixed choices here; the layer that owns the registry checks them through this.
    """
    if value in table:
        return
    names = sorted(table)
    close = difflib.get_close_matches(str(value), names, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    where = f" for {what}" if what else ""
    raise ConfigError(f"'{key}' must be one of {names}{where}, got {value!r}{hint}")


def section(cls: type, doc: str) -> Any:
    """Declare a nested config section."""
    return dataclasses.field(default_factory=cls, metadata={"doc": doc, "section": True})


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key (leaves and sections) a config class accepts."""
    keys = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        keys.append(key)
        sub = _hints(cls)[f.name]
        if dataclasses.is_dataclass(sub):
            keys.extend(all_keys(sub, key + "."))
    return keys


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def value_keys(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every dotted key that holds a value (not a section), with its type."""
    out: dict[str, Any] = {}
    for name, tp in _hints(cls).items():
        if dataclasses.is_dataclass(tp):
            out.update(value_keys(tp, f"{prefix}{name}."))
        else:
            out[prefix + name] = tp
    return out


def did_you_mean(key: str, valid: list[str]) -> str:
    """The suffix an unknown key's error ends with: the closest valid key, or where to look."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean {close[0]}?" if close else " (see docs/config.md for every key)"


def _unknown_key(key: str, valid: list[str]) -> ConfigError:
    return ConfigError(f"unknown config key '{key}'{did_you_mean(key, valid)}")


def set_dotted(tree: dict, key: str, value: Any) -> None:
    """Set `a.b.c = value` in a nested dict, creating sections as needed."""
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set '{key}': '{p}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> dict:
    """Turn `["optim.lr=3e-4", "data.batch_size=32"]` into a nested dict (YAML-typed values)."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. optim.lr=3e-4)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw.strip() else ""
        set_dotted(tree, key.strip(), value)
    return tree


def deep_merge(base: dict, update: dict) -> dict:
    """Recursively merge `update` into a copy of `base`; an empty mapping in `update` clears
    the section (``model.text_options={}`` drops a preset's options)."""
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and v and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`, converting only lossless cases (int->float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"'{key}' expects {_type_name(tp)}, got {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{key}' expects a list of {_type_name(item_tp)}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        k_tp, v_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"'{key}' expects a mapping, got {value!r}")
        return {_coerce(key, k, k_tp): _coerce(f"{key}.{k}", v, v_tp) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"'{key}' must be a finite number, got {value!r}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
    raise ConfigError(f"'{key}' expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _check_range(key: str, value: Any, meta: dict) -> None:
    if meta.get("choices") is not None and value not in meta["choices"]:
        close = difflib.get_close_matches(str(value), [str(c) for c in meta["choices"]], n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"'{key}' must be one of {list(meta['choices'])}, got {value!r}{hint}")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    for bound, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("le", lambda v, b: v <= b, "<="),
        ("gt", lambda v, b: v > b, ">"),
    ):
        b = meta.get(bound)
        if b is not None and not ok(value, b):
            raise ConfigError(f"'{key}' must be {word} {b}, got {value!r}")


def build(cls: type, tree: dict | None, prefix: str = "", root: type | None = None) -> Any:
    """Build and validate a config dataclass from a nested dict of user values."""
    root = root or cls
    tree = tree or {}
    if not isinstance(tree, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or 'config'}' must be a section (mapping)")
    hints = _hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key in tree:
        if key not in names:
            raise _unknown_key(prefix + str(key), all_keys(root))
    kwargs = {}
    for name, f in names.items():
        key = prefix + name
        if name not in tree:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, tree[name], key + ".", root)
        else:
            value = _coerce(key, tree[name], tp)
            _check_range(key, value, dict(f.metadata))
            kwargs[name] = value
    obj = cls(**kwargs)
    for name, f in names.items():  # defaults must satisfy their own constraints too
        if name not in kwargs and not dataclasses.is_dataclass(hints[name]):
            _check_range(prefix + name, getattr(obj, name), dict(f.metadata))
    return obj


def to_dict(cfg: Any) -> dict:
    """A plain nested dict (safe to dump as YAML)."""
    return dataclasses.asdict(cfg)


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a key that appears twice in one mapping (YAML would silently
    keep the last one, e.g. drop a whole first `optim:` section)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"duplicate key {key!r} (lines {seen[key]} and {key_node.start_mark.line + 1}"
                    f" of {key_node.start_mark.name}): YAML keeps only the last one; merge them"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def safe_load_unique(text: str, name: str = "<string>") -> Any:
    """`yaml.safe_load` that rejects duplicate keys."""
    loader = _UniqueKeyLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def preset_dir() -> Path:
    """The folder of shipped presets (inside the installed package)."""
    return Path(str(resources.files("vltrain") / "configs"))


def shipped_preset(path: Path) -> Path | None:
    """The preset shipped inside the installed package that ``configs/NAME.yaml`` names.

    The README's commands say ``configs/NAME.yaml``, which a source checkout has (a link to
    ``vltrain/configs``) but a folder where vltrain was only pip-installed does not. None for
    any other path, or a name no preset has.
    """
    if path.is_absolute() or path.parent != Path("configs"):
        return None
    preset = preset_dir() / path.name
    return preset if preset.is_file() else None


def config_path(path: str | Path) -> Path:
    """``path``; for a missing ``configs/NAME.yaml``, the shipped preset of that name, said on
    stderr (rank 0 only). A file of that path in the working directory always wins."""
    p = Path(path)
    if not p.is_file() and (preset := shipped_preset(p)) is not None:
        if os.environ.get("RANK", "0") == "0":
            print(f"vltrain: no {p} here; using the shipped preset {preset}", file=sys.stderr)
        return preset
    return p


def load_yaml(path: str | Path) -> dict:
    """Read a YAML file (``config_path``'s) with the safe loader; a clear error if it is
    missing or malformed."""
    p = config_path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = safe_load_unique(p.read_text(encoding="utf-8"), str(p)) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not UTF-8 text (offset {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping of config sections, got {type(data).__name__}")
    return data


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every leaf: the reference documentation of a config."""
    rows = []
    inst = cls()
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, prefix + f.name + "."))
        else:
            rows.append((prefix + f.name, _type_name(tp), getattr(inst, f.name), f.metadata["doc"]))
    return rows


def non_default_keys(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys whose value differs from the field's default: what the user set."""
    out: dict[str, Any] = {}
    default = type(cfg)()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(non_default_keys(value, prefix + f.name + "."))
        elif value != getattr(default, f.name):
            out[prefix + f.name] = value
    return out


def reject_unused(cfg: Any, used: tuple[str, ...], context: str, why: dict[str, str]) -> None:
    """Refuse keys set away from their defaults that `context` would silently ignore.

    `used` holds fnmatch patterns of the keys it reads; `why` maps a pattern to a reason shown
    for keys it matches (e.g. "taken from the pretrained model").
    """
    import fnmatch

    ignored = [k for k in non_default_keys(cfg) if not any(fnmatch.fnmatchcase(k, p) for p in used)]
    if not ignored:
        return
    notes = []
    for key in ignored:
        reason = next((r for p, r in why.items() if fnmatch.fnmatchcase(key, p)), "")
        notes.append(f"{key}={getattr_dotted(cfg, key)!r}" + (f" ({reason})" if reason else ""))
    raise ConfigError(
        f"{context} does not use {', '.join(notes)}: it would be ignored. Remove "
        f"{'it' if len(ignored) == 1 else 'them'}, or pick the stage/model.kind that uses "
        f"{'it' if len(ignored) == 1 else 'them'}"
    )


def getattr_dotted(cfg: Any, key: str) -> Any:
    """`cfg.a.b` for key 'a.b'."""
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg
