"""Sharded evaluation of a captioner: teacher-forced loss and token accuracy over every labelled
token, and the captions it decodes scored by BLEU-1/4 and CIDEr-D against all references.

Every rank runs its contiguous shard of the records; the loss sums are all-reduced and the
decoded strings gathered once, so every rank scores the same set (no rank waits on work only
one rank does, and no number depends on the eval batch size or the world size). The stage says
how to decode (`Decode`: the decoding loop of `vltrain.inference`, with its beam and length
settings); this module only calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from vltrain.core import distributed
from vltrain.data.batches import to_device
from vltrain.data.caption_data import CaptionCollate, CaptionDataset
from vltrain.data.records import split_bad
from vltrain.data.samplers import EvalShardSampler
from vltrain.eval.caption_metrics import caption_scores
from vltrain.eval.protocols import Placement

#: (model, images (B, 3, S, S), prompt ids per row, strategy) -> one caption per row
Decode = Callable[[Any, Tensor, list[list[int]], str], list[str]]

#: metrics every caption evaluation returns; decoding scores come per strategy prefix
METRICS = ("eval_loss", "eval_token_acc", "eval_bad_samples", "eval_n_images")
SCORES = ("BLEU-1", "BLEU-4", "CIDEr-D")


def metric_names(prefixes: tuple[str, ...]) -> tuple[str, ...]:
    """Metric names of `CaptionEvaluator.evaluate` with these strategy prefixes."""
    return METRICS + tuple(f"eval_{p}{s}" for p in prefixes for s in SCORES)


class CaptionEvaluator:
    """Loss plus decoding scores of a captioner (``model(images, ids, mask, labels)`` -> a dict
    with ``loss``, ``token_acc``, ``n_tokens``) on a caption dataset's eval samples."""

    def __init__(
        self, collate: CaptionCollate, where: Placement, batch_size: int, decode: Decode
    ) -> None:
        self.collate, self.where, self.batch_size, self.decode = collate, where, batch_size, decode

    def evaluate(
        self, model: Any, ds: CaptionDataset, strategies: dict[str, str]
    ) -> dict[str, float]:
        """Loss plus BLEU/CIDEr-D per decoding strategy; ``strategies`` maps a metric-name
        prefix ('' = none) to a strategy, e.g. ``{"": "greedy", "beam_": "beam"}``."""
        sums, hyps, refs = self._shard(model, ds, tuple(sorted(set(strategies.values()))))
        total = distributed.all_reduce_sum(sums.to(self.where.device)).cpu()
        all_hyps: dict[str, dict[int, str]] = {s: {} for s in hyps}
        all_refs: dict[int, list[str]] = {}
        for h, r in distributed.all_gather_object((hyps, refs)):
            for strategy, rows in h.items():
                all_hyps[strategy].update(rows)
            all_refs.update(r)
        n = max(float(total[2]), 1.0)
        metrics = {"loss": float(total[0]) / n, "token_acc": float(total[1]) / n}
        for prefix, strategy in strategies.items():
            scores = caption_scores(all_hyps[strategy], all_refs)
            metrics.update({f"{prefix}{k}": v for k, v in scores.items()})
        metrics["bad_samples"] = float(total[3])
        metrics["n_images"] = float(len(all_refs))
        return metrics

    def _shard(
        self, model: Any, ds: CaptionDataset, strategies: tuple[str, ...]
    ) -> tuple[Tensor, dict[str, dict[int, str]], dict[int, list[str]]]:
        """Loss sums, and captions decoded by each strategy, of this rank's shard of `ds`."""
        where, dev = self.where, self.where.device
        sums = torch.zeros(4, dtype=torch.float64)  # CE sum, correct, labelled tokens, bad
        hyps: dict[str, dict[int, str]] = {s: {} for s in strategies}
        refs: dict[int, list[str]] = {}
        for keys in EvalShardSampler(len(ds), self.batch_size, where.rank, where.world_size):
            good, bad = split_bad([ds[k] for k in keys])
            sums[3] += len(bad)
            if not good:
                continue
            b = self.collate(good)
            images = to_device(b["images"], dev)  # pixels, or an HF VLM's dict of them
            out = model(
                images, b["input_ids"].to(dev), b["attention_mask"].to(dev), b["labels"].to(dev)
            )
            n = float(out["n_tokens"])
            sums[:3] += torch.tensor([float(out["loss"]) * n, float(out["token_acc"]) * n, n])
            for strategy, shard_hyps in hyps.items():
                caps = self.decode(model, images, b["prompt_ids"], strategy)
                for s, cap in zip(good, caps, strict=True):
                    shard_hyps[s["index"]] = cap
            for s in good:
                refs[s["index"]] = s["refs"]
        return sums, hyps, refs
