"""Run under torch.distributed.run: corpus evaluation of a checkpoint, sharded over the ranks.

python -m torch.distributed.run --nproc_per_node=2 corpus_eval_worker.py CKPT SPLIT_DIR OUT
"""

from __future__ import annotations

import json
import sys

import torch

from vltrain.core import distributed
from vltrain.engine.runtime import RunContext
from vltrain.tools.loading import load_trained

if __name__ == "__main__":
    ckpt, split, out = sys.argv[1:4]
    distributed.init_from_env("cpu")
    _, stage, model = load_trained(ckpt)
    stage.corpus.where = RunContext(
        torch.device("cpu"),
        rank=distributed.rank(),
        world_size=distributed.world_size(),
        precision="fp32",
        seed=0,
    )
    with torch.no_grad():
        metrics = stage.corpus.evaluate(model.encoder, split)
    if distributed.is_main():
        with open(out, "w") as f:
            json.dump(metrics, f)
    distributed.shutdown()
