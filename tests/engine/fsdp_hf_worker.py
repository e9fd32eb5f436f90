"""Worker for test_sharding.py: FSDP2 per layer on a tiny random HF VLM, under torchrun.

Every rank loads the same local HF dir twice: a reference copy trained in-process on the full
batch, and a copy sharded per decoder layer / vision block that trains on this rank's half.
After two AdamW steps rank 0 writes the largest weight difference, how far training moved
the weights (so the comparison means something) and the sharded units.
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForImageTextToText

from vltrain.engine import distributed as D
from vltrain.engine import sharding


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def main(path: str, out: str) -> None:
    D.init_from_env("cpu")
    rank, world = D.rank(), D.world_size()
    torch.manual_seed(0)
    ref = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    units = [type(m).__name__ for m in sharding.blocks(model)]
    replicated = sharding.apply_fsdp(model, world, None, offload=False)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    vocab = ref.config.get_text_config().vocab_size
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(1, vocab, (2 * world, 12), generator=g)  # (B, T), no padding
        _loss(ref, ids).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        _loss(model, ids[2 * rank : 2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
    full = sharding.full_state_dict(model)  # on rank 0 only (the others get {})
    if rank == 0:
        initial = AutoModelForImageTextToText.from_pretrained(path).state_dict()
        trained = ref.state_dict()
        record = {
            "diff": max(float((full[k] - v).abs().max()) for k, v in trained.items()),
            "moved": max(float((v - initial[k]).abs().max()) for k, v in trained.items()),
            "units": units,
            "replicated": len(replicated),
            "keys_equal": sorted(full) == sorted(trained),
        }
        with open(out, "w") as f:
            json.dump(record, f)
    D.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
