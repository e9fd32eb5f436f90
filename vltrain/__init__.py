"""vltrain: train vision-language models (contrastive embedders and generative VLMs).

The library API, everything a script needs (the CLI, `vltrain <command>`, runs the same code):

```python
from vltrain import load_config, train, load_run

overrides = ["run.out_dir=runs/api_demo", "train.max_steps=20", "optim.warmup_steps=5"]
cfg = load_config("configs/quickstart.yaml", overrides)
summary = train(cfg)                      # the run's summary dict; summary["step"]: its last step
run = load_run("runs/api_demo")           # the run's best checkpoint, else its newest
texts = run.embed_texts(["a red circle", "a blue square"])   # (2, D), L2-normalised
```

The example reads the quickstart's data in `runs/quickstart/data` (`vltrain quickstart` writes
it); docs/api.md has a longer one.

- Configs and training: `load_config`, `Config`, `ConfigError`, `train`, `Trainer`; a stage of
  your own implements the `Stage` protocol (its step returns a `StepOutput`) and trains with
  ``Trainer(cfg, stage=MyStage).run()``.
- Trained runs: `load_run` returns a `TrainedRun` with ``embed_images``, ``embed_texts``
  (contrastive runs) and ``generate`` (caption and rl runs).
- Losses and GradCache: `InfoNCELoss`, `SigLIPLoss`, `grad_cache`.
- Metrics: `evaluate_retrieval` (exact R@k, MRR@10, nDCG@10 over embeddings), `Bleu`, `CiderD`
  and `caption_scores` (pycocoevalcap's numbers).

Names are imported on first use (PEP 562), so ``import vltrain`` and the CLI's start stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_EXPORTS: dict[str, str] = {
    "load_config": "vltrain.config.schema",
    "Config": "vltrain.config.schema",
    "ConfigError": "vltrain.config.core",
    "train": "vltrain.runs",
    "Trainer": "vltrain.engine.loop",
    "Stage": "vltrain.engine.task",
    "StepOutput": "vltrain.engine.task",
    "load_run": "vltrain.tools.run_api",
    "TrainedRun": "vltrain.tools.run_api",
    "InfoNCELoss": "vltrain.objectives.contrastive",
    "SigLIPLoss": "vltrain.objectives.contrastive",
    "grad_cache": "vltrain.objectives.grad_cache",
    "evaluate_retrieval": "vltrain.eval.retrieval",
    "Bleu": "vltrain.eval.caption_metrics",
    "CiderD": "vltrain.eval.caption_metrics",
    "caption_scores": "vltrain.eval.caption_metrics",
}

__all__ = [  # the order of the API reference
    "__version__",
    "load_config",
    "Config",
    "ConfigError",
    "train",
    "Trainer",
    "Stage",
    "StepOutput",
    "load_run",
    "TrainedRun",
    "InfoNCELoss",
    "SigLIPLoss",
    "grad_cache",
    "evaluate_retrieval",
    "Bleu",
    "CiderD",
    "caption_scores",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports
    from vltrain.config.core import ConfigError
    from vltrain.config.schema import Config, load_config
    from vltrain.engine.loop import Trainer
    from vltrain.engine.task import Stage, StepOutput
    from vltrain.eval.caption_metrics import Bleu, CiderD, caption_scores
    from vltrain.eval.retrieval import evaluate_retrieval
    from vltrain.objectives.contrastive import InfoNCELoss, SigLIPLoss
    from vltrain.objectives.grad_cache import grad_cache
    from vltrain.runs import train
    from vltrain.tools.run_api import TrainedRun, load_run


def __getattr__(name: str) -> Any:
    """Import a public name's module on first access (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vltrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
