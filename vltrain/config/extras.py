"""Optional packages and the pyproject extra that installs each: one table for every message
that names what to install.

A command that imports a missing optional package fails with ModuleNotFoundError, which the CLI
turns into ``this command needs NAME: pip install 'vltrain[EXTRA]'`` (`vltrain.cli.main`); a
config that will need one is refused before any compute by `require`, in the same words.
"""

from __future__ import annotations

import importlib.util

from vltrain.config.core import ConfigError

#: optional packages -> the pyproject extra that installs them
EXTRAS = {
    "transformers": "hf",
    "peft": "hf",
    "huggingface_hub": "hf",
    "optuna": "tune",
    "plotly": "tune",
    "tensorboard": "log",
    "wandb": "log",
    "mlflow": "log",
    "scipy": "scaling",
    "matplotlib": "scaling",
    "fsspec": "stream",
    "datasets": "datasets",
    "pyarrow": "datasets",
    "gguf": "gguf",
}


def install_hint(module: str) -> str | None:
    """``pip install 'vltrain[EXTRA]'`` for an optional package (or a submodule of one); None
    for a module that no extra installs."""
    extra = EXTRAS.get(module.split(".")[0])
    return f"pip install 'vltrain[{extra}]'" if extra else None


def installed(module: str) -> bool:
    """True when `module` can be imported (without importing it)."""
    return importlib.util.find_spec(module) is not None


def require(module: str, what: str) -> None:
    """Raise a ConfigError when `what` (a config key and value) needs `module` and it is not
    installed: ``'log.mlflow'=True needs mlflow: pip install 'vltrain[log]'``."""
    if not installed(module):
        hint = install_hint(module) or f"pip install {module}"
        raise ConfigError(f"{what} needs {module}: {hint}")
