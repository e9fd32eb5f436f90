"""Embeddings for curation (semantic dedup, CLIP score) from a trained contrastive checkpoint.

Records are embedded through the stage's evaluation path (its data's `eval_dataset` + its
evaluator's `embed_shard`, the path `vltrain mine` and evaluation use), so a curation embedding
is an evaluation embedding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from vltrain.data.readers import DataError
from vltrain.tools.loading import load_trained


class CheckpointEmbedder:
    """`embed(path)` -> image (N, E), first caption (N, E), embedded mask (N,)."""

    def __init__(self, checkpoint: str | Path, batch_size: int = 128, device: str = "cpu") -> None:
        cfg, self.stage, self.model = load_trained(checkpoint, device=device)
        if not hasattr(self.stage, "retrieval"):
            raise DataError(
                f"checkpoint {checkpoint} is a '{cfg.stage}' run; curation embeddings need a "
                "contrastive (CLIP/SigLIP) checkpoint"
            )
        self.batch_size = batch_size

    def embed(self, path: Path) -> tuple[Tensor, Tensor, Tensor]:
        ds = self.stage.data.eval_dataset(path, hard_negatives=0)
        with torch.no_grad():
            shard, _, _ = self.stage.retrieval.embed_shard(
                self.model.encoder, ds, batch_size=self.batch_size
            )
        n, dim = len(ds), shard["img"].shape[1] if shard["img"].numel() else 1
        img, txt = torch.zeros(n, dim), torch.zeros(n, dim)
        valid = torch.zeros(n, dtype=torch.bool)
        idx = shard["idx"].long()
        img[idx] = torch.nn.functional.normalize(shard["img"], dim=1)
        owner = shard["owner"].long()
        first = torch.ones(len(owner), dtype=torch.bool)
        first[1:] = owner[1:] != owner[:-1]  # captions come grouped by owner, first caption first
        txt[owner[first]] = torch.nn.functional.normalize(shard["txt"][first], dim=1)
        valid[idx] = True
        return img, txt, valid
