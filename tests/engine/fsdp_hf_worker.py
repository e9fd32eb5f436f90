"""Worker for test_sharding.py: FSDP2 per layer on a tiny random HF VLM, under torchrun.

Every rank loads the same local HF dir twice: a reference copy trained in-process on the full
batch, and a copy sharded per decoder layer / vision block that trains on this rank's half.
After two AdamW steps rank 0 writes the largest weight difference, how far training moved
the weights (so the comparison means something) and the sharded units.

Modes (argv[3], comma-separated): ``lora`` wraps both copies with the same peft LoRA adapters
first (frozen backbone and trainable adapters in one FSDP unit), ``offload`` shards with
``CPUOffloadPolicy`` (parameters, gradients and optimizer state kept in CPU memory).
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForImageTextToText

from vltrain.core import checkpoint, distributed
from vltrain.engine import sharding


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _load(path: str, lora: bool) -> torch.nn.Module:
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    if lora:
        from vltrain.models.hf_embedders import apply_lora

        torch.manual_seed(0)  # the same adapter initialisation in both copies
        model = apply_lora(model, {"r": 4}, ["q_proj", "v_proj"])
    return model


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def main(path: str, out: str, modes: str = "") -> None:
    distributed.init_from_env("cpu")
    rank, world = distributed.rank(), distributed.world_size()
    lora, offload = "lora" in modes.split(","), "offload" in modes.split(",")
    ref, model = _load(path, lora), _load(path, lora)
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    units = [type(m).__name__ for m in sharding.blocks(model)]
    replicated = sharding.apply_fsdp(model, world, None, offload=offload)
    opt_ref = torch.optim.AdamW(_trainable(ref), lr=1e-2)
    opt = torch.optim.AdamW(_trainable(model), lr=1e-2)
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
    full = checkpoint.full_state_dict(model)  # on rank 0 only (the others get {})
    if rank == 0:
        trained = ref.state_dict()
        record = {
            "diff": max(float((full[k] - v).abs().max()) for k, v in trained.items()),
            "moved": max(float((v - initial[k]).abs().max()) for k, v in trained.items()),
            "units": units,
            "replicated": len(replicated),
            "keys_equal": sorted(full) == sorted(trained),
            "trainable": len(_trainable(ref)),
            "lora_params": sum("lora_" in n for n, _ in ref.named_parameters()),
            # the sharded copy's backbone under LoRA: frozen, so it must not have moved
            "frozen_moved": max(
                (float((v - initial[k]).abs().max()) for k, v in full.items() if "lora_" not in k),
                default=0.0,
            ),
        }
        with open(out, "w") as f:
            json.dump(record, f)
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
