"""The search space: `tune.space` parsed, checked against the config schema, and sampled.

A space maps a dotted config key to a distribution spec, e.g.

    optim.lr: {type: float, low: 1.0e-5, high: 5.0e-4, log: true}
    data.batch_size: {type: categorical, choices: [16, 32, 64]}
    optim.warmup_steps: {type: int, low: 10, high: 100, step: 10}

Optuna parameter names are the dotted keys themselves, so a trial's `params` dict is directly
a set of config overrides.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from typing import Any

from vltrain.config.core import ConfigError, did_you_mean, set_dotted, value_keys
from vltrain.config.schema import Config

TYPES = ("float", "int", "categorical")
SPEC_FIELDS = ("type", "low", "high", "log", "step", "choices")

#: Keys a search may not touch: the tuner sets them per trial (budget, run dir) itself.
RESERVED = {
    "run.out_dir": "each trial trains in its own run dir under the study dir",
    "train.resume": "trials always start fresh",
    "train.max_steps": "set the trial budget with tune.max_steps or tune.epochs",
    "train.eval_every": "set the reporting cadence with tune.eval_every",
    "data.max_train_samples": "set the subset with tune.train_samples",
}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One searched config key and its distribution."""

    key: str
    type: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: float | int | None = None
    choices: tuple = ()

    def suggest(self, trial: Any) -> Any:
        """Draw this parameter from an optuna trial (named by its dotted key)."""
        if self.type == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.type == "int":
            return trial.suggest_int(
                self.key, self.low, self.high, step=self.step or 1, log=self.log
            )
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def extremes(self) -> list[Any]:
        """Values that bound what this parameter can take (for validating every trial)."""
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int" and self.step:
            # optuna rounds `high` down onto the step grid
            return [self.low, self.low + (self.high - self.low) // self.step * self.step]
        return [self.low, self.high]

    def describe(self) -> str:
        """Short human form, e.g. 'float [1e-05, 0.0005] log'."""
        if self.type == "categorical":
            return f"one of {list(self.choices)}"
        extra = (" log" if self.log else "") + (f" step {self.step}" if self.step else "")
        return f"{self.type} [{self.low}, {self.high}]{extra}"


def _flatten(space: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Accept nested sections (from `tune.space.optim.lr.type=float` overrides) as dotted."""
    flat: dict[str, Any] = {}
    for key, spec in space.items():
        full = f"{prefix}{key}"
        if (
            isinstance(spec, dict)
            and "type" not in spec
            and spec
            and all(isinstance(v, dict) for v in spec.values())
        ):
            flat.update(_flatten(spec, full + "."))
        else:
            flat[full] = spec
    return flat


def _number(key: str, field: str, value: Any, integer: bool) -> float | int:
    """Coerce a bound (YAML may give '1e-5' as a string) and say what was wrong if it fails."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"tune.space['{key}'].{field} must be a number, got {value!r}")
    try:
        num = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"tune.space['{key}'].{field} must be a number, got {value!r}") from None
    if integer:
        if num != int(num):
            raise ConfigError(
                f"tune.space['{key}'].{field} must be an integer for type int, got {value!r}"
            )
        return int(num)
    return num


def _parse_one(key: str, spec: Any) -> ParamSpec:
    where = f"tune.space['{key}']"
    if not isinstance(spec, dict):
        raise ConfigError(
            f"{where} must be a mapping like {{type: float, low: 1.0e-5, "
            f"high: 1.0e-3, log: true}}, got {spec!r}"
        )
    for field in spec:
        if field not in SPEC_FIELDS:
            close = difflib.get_close_matches(str(field), SPEC_FIELDS, n=1)
            hint = f"; did you mean {close[0]}?" if close else f" (allowed: {SPEC_FIELDS})"
            raise ConfigError(f"{where} has unknown field '{field}'{hint}")
    kind = spec.get("type")
    if kind not in TYPES:
        raise ConfigError(f"{where}.type must be one of {list(TYPES)}, got {kind!r}")
    if kind == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ConfigError(f"{where}: categorical needs a non-empty list 'choices'")
        bad = [c for c in choices if not isinstance(c, (str, int, float, bool, type(None)))]
        if bad:
            raise ConfigError(f"{where}: choices must be scalars (str, number, bool), got {bad}")
        extra = [f for f in ("low", "high", "log", "step") if f in spec]
        if extra:
            raise ConfigError(f"{where}: categorical takes only 'choices', not {extra}")
        return ParamSpec(key, kind, choices=tuple(choices))
    if "choices" in spec:
        raise ConfigError(f"{where}: 'choices' is for type categorical; {kind} takes low/high")
    integer = kind == "int"
    if "low" not in spec or "high" not in spec:
        raise ConfigError(f"{where}: type {kind} needs 'low' and 'high'")
    low = _number(key, "low", spec["low"], integer)
    high = _number(key, "high", spec["high"], integer)
    log = spec.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"{where}.log must be true or false, got {log!r}")
    step = _number(key, "step", spec["step"], integer) if spec.get("step") is not None else None
    if low > high:
        raise ConfigError(f"{where}: low ({low}) is above high ({high})")
    if log and low <= 0:
        raise ConfigError(f"{where}: log scale needs low > 0, got {low}")
    if log and step is not None:
        raise ConfigError(f"{where}: use either log or step, not both (Optuna cannot combine them)")
    if step is not None and step <= 0:
        raise ConfigError(f"{where}.step must be > 0, got {step}")
    return ParamSpec(key, kind, low, high, log, step)


def parse_space(space: dict[str, Any]) -> list[ParamSpec]:
    """Check every key against the schema (with a did-you-mean) and every spec's fields."""
    if not space:
        raise ConfigError(
            "tune.space is empty: declare at least one searched key, e.g. "
            "tune.space: {optim.lr: {type: float, low: 1.0e-5, high: 5.0e-4, "
            "log: true}}"
        )
    leaves = list(value_keys(Config))
    specs = []
    for key, spec in _flatten(space).items():
        if key.startswith("tune."):
            raise ConfigError(
                f"tune.space cannot search '{key}': the tuner's own settings are fixed for a study"
            )
        if key in RESERVED:
            raise ConfigError(f"tune.space cannot search '{key}': {RESERVED[key]}")
        if key not in leaves:
            raise ConfigError(f"tune.space: unknown config key '{key}'{did_you_mean(key, leaves)}")
        specs.append(_parse_one(key, spec))
    return specs


def params_tree(params: dict[str, Any]) -> dict:
    """`{"optim.lr": 1e-3}` -> `{"optim": {"lr": 1e-3}}`, ready to deep_merge into a config."""
    tree: dict = {}
    for key, value in params.items():
        set_dotted(tree, key, value)
    return tree


def corner_params(specs: list[ParamSpec], limit: int = 4096) -> list[dict[str, Any]]:
    """Parameter sets covering each parameter's extremes, for checking configs before a search.

    The full product of extremes when it has at most `limit` members (so cross-field rules
    such as warmup <= max_steps are checked in every combination); otherwise each
    parameter's extremes alone plus the all-low and all-high corners.
    """
    values = [s.extremes() for s in specs]
    n = 1
    for v in values:
        n *= len(v)
    if n <= limit:
        return [
            dict(zip([s.key for s in specs], combo, strict=True))
            for combo in itertools.product(*values)
        ]
    base = {s.key: v[0] for s, v in zip(specs, values, strict=True)}
    out = [base, {s.key: v[-1] for s, v in zip(specs, values, strict=True)}]
    for s, v in zip(specs, values, strict=True):
        out.extend({**base, s.key: x} for x in v[1:])
    return out


def check_enqueued(specs: list[ParamSpec], enqueue: list[dict[str, Any]]) -> None:
    """Every enqueued parameter set names searched keys with values inside the space."""
    by_key = {s.key: s for s in specs}
    for i, params in enumerate(enqueue):
        for key, value in params.items():
            spec = by_key.get(key)
            if spec is None:
                close = difflib.get_close_matches(key, list(by_key), n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise ConfigError(
                    f"tune.enqueue[{i}] sets '{key}', which is not in tune.space{hint}"
                )
            if spec.type == "categorical":
                if value not in spec.choices:
                    raise ConfigError(
                        f"tune.enqueue[{i}]['{key}'] = {value!r} is not one of {list(spec.choices)}"
                    )
            elif not isinstance(value, (int, float)) or not spec.low <= value <= spec.high:
                raise ConfigError(
                    f"tune.enqueue[{i}]['{key}'] = {value!r} is outside [{spec.low}, {spec.high}]"
                )
