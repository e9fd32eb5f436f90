"""The caption stage: pretrain / finetune / SFT a captioner with teacher-forced cross-entropy.

Modes (``caption.mode``; presets in configs/caption_*.yaml, guide in docs/captioning.md):

- ``pretrain``: caption records; usually ``model.freeze: [vision, decoder]`` so only the
  connector learns (LLaVA stage 1).
- ``finetune``: caption records; everything trains, the vision tower at a lower LR
  (``optim.lr_scale.vision``).
- ``sft``: chat records (``messages``) in the template of `vltrain.data.chat`; the loss covers
  assistant tokens only. Plain caption records become one-turn chats (``caption.instruction``).

``model.init_from`` starts from a previous run's weights and reuses its tokenizer. Evaluation
(every rank decodes its contiguous shard; strings gathered once) reports loss and token accuracy
over all labelled tokens, and BLEU-1/4 and CIDEr-D of the decoded captions against all
references; ``checkpoints/best`` follows CIDEr-D.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.data.caption_data import CaptionDataset, read_caption_source, training_texts
from vltrain.data.chat import IGNORE_INDEX
from vltrain.data.records import split_bad
from vltrain.data.samplers import EvalShardSampler, LengthBucketBatchSampler, ShardedBatchSampler
from vltrain.data.tokenizer import TextTokenizer, train_bpe_tokenizer
from vltrain.engine import distributed as D
from vltrain.stages.base import (
    BatchSampler,
    Stage,
    copy_init_tokenizer,
    register_stage,
    resolve_init,
)
from vltrain.stages.caption_decode import (
    build_captioner,
    caption_scores,
    decode_captions,
    load_initial_weights,
    load_vision_tower,
)


class CaptionCollate:
    """Pad token ids (right; pad id), labels (right; -100) and eval prompts (left); picklable."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        t = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), t), self.pad_id, dtype=torch.long)  # (B, T)
        labels = torch.full((len(samples), t), IGNORE_INDEX, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(samples), t), dtype=torch.long)  # (B, T)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.tensor(s["input_ids"])
            labels[i, :n] = torch.tensor(s["labels"])
            mask[i, :n] = 1
        batch: dict[str, Any] = {
            "images": torch.stack([s["image"] for s in samples]),  # (B, 3, S, S)
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "index": torch.tensor([s["index"] for s in samples]),
        }
        if "prompt_ids" in samples[0]:
            batch["prompt_ids"] = [s["prompt_ids"] for s in samples]
            batch["refs"] = [s["refs"] for s in samples]
        return batch


@register_stage("caption")
class CaptionStage(Stage):
    """Teacher-forced captioning (pretrain/finetune/sft); eval by decoding + BLEU/CIDEr-D."""

    best_metric = "eval_CIDEr-D"
    best_mode = "max"

    # ---- setup --------------------------------------------------------------------------

    def _source(self, path: str):
        d = self.cfg.data
        return read_caption_source(path, d.image_column, d.text_column)

    def prepare(self) -> None:
        """Reuse the tokenizer of `model.init_from` (or of this run), else train one (rank 0)."""
        self.init_ckpt = resolve_init(self.cfg.model.init_from)
        tok_dir = self.out_dir / "tokenizer"
        if self.ctx.is_main and not (tok_dir / "tokenizer.json").is_file():
            if self.init_ckpt is not None:
                copy_init_tokenizer(self.init_ckpt, tok_dir)
            else:
                c = self.cfg.caption
                texts = training_texts(self._source(self.cfg.data.train), c.prompt, c.instruction)
                train_bpe_tokenizer(texts, vocab_size=self.cfg.data.tokenizer_vocab).save(tok_dir)
        D.barrier()
        self.tokenizer = TextTokenizer.load(tok_dir)
        self._eval_sets: dict[str, CaptionDataset] = {}

    def build_model(self) -> nn.Module:
        model = build_captioner(self.cfg, self.tokenizer)
        if self.init_ckpt is not None:
            load_initial_weights(model, self.init_ckpt)
        elif self.cfg.model.vision_init_from:
            load_vision_tower(model, self.cfg.model.vision_init_from)
        model.freeze(self.cfg.model.freeze)
        return model

    def _dataset(self, path: str, train: bool) -> CaptionDataset:
        d, c = self.cfg.data, self.cfg.caption
        return CaptionDataset(
            self._source(path),
            self.tokenizer,
            image_size=d.image_size,
            max_len=d.max_text_len,
            seed=self.cfg.run.seed,
            mode=c.mode,
            prompt=c.prompt,
            instruction=c.instruction,
            train=train,
        )

    def train_dataset(self) -> CaptionDataset:
        ds = self._dataset(self.cfg.data.train, train=True)
        if self.cfg.data.max_train_samples:
            ds.records = ds.records[: self.cfg.data.max_train_samples]
        return ds

    def train_sampler(self, dataset: CaptionDataset, start: tuple[int, int]) -> BatchSampler:
        """Length-bucketed batches when data.length_buckets > 0, else shuffled batches."""
        d, ctx = self.cfg.data, self.ctx
        if d.length_buckets > 0:
            lengths = [dataset.token_length(i) for i in range(len(dataset))]
            return LengthBucketBatchSampler(
                lengths,
                d.batch_size,
                ctx.rank,
                ctx.world_size,
                self.cfg.run.seed,
                n_buckets=d.length_buckets,
                max_same_bucket_run=d.max_same_bucket_run,
                start=start,
            )
        return ShardedBatchSampler(
            len(dataset), d.batch_size, ctx.rank, ctx.world_size, self.cfg.run.seed, start=start
        )

    def collate(self, samples: list[dict]) -> dict[str, Any]:
        return CaptionCollate(self.tokenizer.pad_id)(samples)

    def checkpoint_files(self) -> dict[str, Path]:
        return {"tokenizer": self.out_dir / "tokenizer"}

    # ---- loss ---------------------------------------------------------------------------

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> tuple[Tensor, dict]:
        out = model(batch["images"], batch["input_ids"], batch["attention_mask"], batch["labels"])
        return out["loss"], {"token_acc": out["token_acc"]}

    def backward(
        self, model: nn.Module, batch: dict[str, Any], scale: float
    ) -> tuple[Tensor, dict]:
        """Mean CE over the labelled tokens of the *global* batch, whatever the world size.

        Each rank's mean is reweighted by its share of the global token count (one scalar
        all-reduce), so DDP's gradient average equals one process holding the whole batch.
        """
        out = model(batch["images"], batch["input_ids"], batch["attention_mask"], batch["labels"])
        n = out["n_tokens"].double()
        local = torch.stack([out["loss"].detach().double() * n, out["token_acc"].double() * n, n])
        total = D.all_reduce_sum(local)  # (3,) CE sum, correct tokens, labelled tokens
        n_all = total[2].clamp(min=1.0)
        weight = (self.ctx.world_size * n / n_all).to(out["loss"].dtype)
        (out["loss"] * weight * scale).backward()
        metrics = {"token_acc": float(total[1] / n_all), "tokens": float(total[2])}
        return (total[0] / n_all).float(), metrics

    # ---- evaluation ---------------------------------------------------------------------

    def _eval_set(self, split: str) -> CaptionDataset:
        if split not in self._eval_sets:
            path = self.cfg.data.eval if split == "val" else self.cfg.data.test
            self._eval_sets[split] = self._dataset(path, train=False)
        return self._eval_sets[split]

    def _eval_shard(
        self, model: nn.Module, ds: CaptionDataset, strategies: tuple[str, ...]
    ) -> tuple[Tensor, dict, dict]:
        """Loss sums, and captions decoded by each strategy, of this rank's shard of `ds`."""
        c, dev = self.cfg.caption, self.ctx.device
        bs = self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        sums = torch.zeros(4, dtype=torch.float64)  # CE sum, correct, labelled tokens, bad
        hyps: dict[str, dict[int, str]] = {s: {} for s in strategies}
        refs: dict[int, list[str]] = {}
        collate = CaptionCollate(self.tokenizer.pad_id)
        for keys in EvalShardSampler(len(ds), bs, self.ctx.rank, self.ctx.world_size):
            good, bad = split_bad([ds[k] for k in keys])
            sums[3] += len(bad)
            if not good:
                continue
            b = collate(good)
            images = b["images"].to(dev)
            out = model(
                images, b["input_ids"].to(dev), b["attention_mask"].to(dev), b["labels"].to(dev)
            )
            n = float(out["n_tokens"])
            sums[:3] += torch.tensor([float(out["loss"]) * n, float(out["token_acc"]) * n, n])
            for strategy, shard_hyps in hyps.items():
                caps = decode_captions(
                    model,
                    self.tokenizer,
                    images,
                    b["prompt_ids"],
                    strategy=strategy,
                    num_beams=c.num_beams,
                    max_new_tokens=c.max_new_tokens,
                    length_penalty=c.length_penalty,
                )
                for s, cap in zip(good, caps, strict=True):
                    shard_hyps[s["index"]] = cap
            for s in good:
                refs[s["index"]] = s["refs"]
        return sums, hyps, refs

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Sharded loss + decoding; strings gathered once, every rank scores the same set."""
        return self.evaluate_decoding(model, split, {"": self.cfg.caption.strategy})

    def evaluate_decoding(
        self, model: nn.Module, split: str, strategies: dict[str, str]
    ) -> dict[str, float]:
        """Loss plus BLEU/CIDEr-D per decoding strategy; ``strategies`` maps a metric-name
        prefix ('' = none) to a strategy, e.g. ``{"": "greedy", "beam_": "beam"}``."""
        sums, hyps, refs = self._eval_shard(
            model, self._eval_set(split), tuple(sorted(set(strategies.values())))
        )
        total = D.all_reduce_sum(sums.to(self.ctx.device)).cpu()
        all_hyps: dict[str, dict[int, str]] = {s: {} for s in hyps}
        all_refs: dict[int, list[str]] = {}
        for h, r in D.all_gather_object((hyps, refs)):
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
