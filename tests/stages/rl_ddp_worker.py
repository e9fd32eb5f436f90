"""One rank of an rl run under torchrun, recording what this rank saw (test instrumentation).

    python -m torch.distributed.run --standalone --nproc_per_node=2 \
        tests/stages/rl_ddp_worker.py configs/rl.yaml key=value ...

Trains like `vltrain train` and writes ``<run.out_dir>/rank<r>.json``: per step the record
indices of this rank's batch, its local rewards, the EMA baseline after the step and a digest
of the policy weights before the step; a probe rollout of the same two records on every rank
(with the generator of the first real rollout); and digests of the final policy and reference.
Only methods of the stage instance are wrapped; vltrain's code is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vltrain.config import load_config
from vltrain.core import distributed
from vltrain.data.batches import to_device
from vltrain.data.caption_data import CaptionCollate
from vltrain.runs import Trainer
from vltrain.stages import get_stage


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes and bytes: equal digests mean bitwise-equal weights."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> None:
    cfg = load_config(argv[0], argv[1:])
    trainer = Trainer(cfg, stage=get_stage(cfg.stage))
    stage = trainer.stage
    steps: list[dict[str, Any]] = []
    seen: dict[str, Any] = {}
    models: list[nn.Module] = []
    build, step, sample, rewards = (
        stage.build_model,
        stage.forward_backward,
        stage._sample,
        stage._rewards,
    )

    def build_model() -> nn.Module:
        models.append(build())
        return models[-1]

    def sample_(policy: nn.Module, batch: dict, gen: torch.Generator) -> dict:
        if "probe" not in seen:  # identical inputs on every rank, this rollout's noise
            ds = stage.core.train_dataset(train=False)
            collate = CaptionCollate(stage.tokenizer.pad_id)
            probe = to_device(collate([ds[(0, 0, i)] for i in (0, 1)]), gen.device)
            twin = torch.Generator(gen.device)
            twin.set_state(gen.get_state())
            seen["probe"] = sample(policy, probe, twin)["seq"].tolist()
        return sample(policy, batch, gen)

    def rewards_(*args: Any) -> torch.Tensor:
        r = rewards(*args)
        steps[-1]["rewards"] = r.tolist()
        return r

    def step_(model: Any, batch: dict, scale: float) -> Any:
        steps.append(
            {"index": batch["index"].tolist(), "weights_before": digest(models[0].state_dict())}
        )
        out = step(model, batch, scale)
        steps[-1]["baseline"] = stage.baseline.value
        return out

    stage.build_model, stage.forward_backward, stage._sample, stage._rewards = (
        build_model,
        step_,
        sample_,
        rewards_,
    )
    summary = trainer.run()
    record = {
        "rank": distributed.rank(),
        "world_size": distributed.world_size(),
        "steps": steps,
        "probe": seen["probe"],
        "rollouts": stage.rollouts,
        "final_weights": digest(models[0].state_dict()),
        "reference": digest(stage.reference.state_dict()),
        "reference_dtypes": sorted({str(p.dtype) for p in stage.reference.parameters()}),
        "summary_steps": summary["steps"],
    }
    out = Path(cfg.run.out_dir) / f"rank{distributed.rank()}.json"
    out.write_text(json.dumps(record))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
