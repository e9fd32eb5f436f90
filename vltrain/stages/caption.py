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

from vltrain.config.core import ConfigError, check_choice, reject_unused
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.core.checkpoint import resolve_init
from vltrain.data.batches import CaptionBatch
from vltrain.data.caption_data import (
    CaptionCollate,
    CaptionDataset,
    read_caption_source,
    training_texts,
)
from vltrain.data.images import DecodedImages
from vltrain.data.loaders import Loader, MapLoader
from vltrain.data.samplers import LengthBucketBatchSampler, ShardedBatchSampler
from vltrain.data.shards import is_shard_source
from vltrain.data.tokenizer import TextTokenizer, prepare_tokenizer
from vltrain.engine.parallel import ParallelModel
from vltrain.engine.runtime import RunContext
from vltrain.engine.task import StepOutput
from vltrain.eval.captions import CaptionEvaluator, metric_names
from vltrain.inference.captioning import decode_captions
from vltrain.models import backbones
from vltrain.models.connectors import CONNECTORS, check_connector_options
from vltrain.stages.caption_hf import HF_CAPTION_KINDS, HFCaptionCore, check_hf_caption_config

#: the captioner's parts, as model.freeze names them
PARTS = ("vision", "connector", "decoder")


#: keys the captioner stages read (the rl stage adds rl.* and drops the length buckets)
CAPTION_KEYS = (
    *("stage", "run.*", "optim.*", "train.*", "log.*", "tune.*", "doctor.*", "data.*"),
    *("caption.*", "model.kind", "model.vision", "model.text", "model.vision_layers"),
    *("model.vision_width", "model.vision_options", "model.text_layers", "model.text_width"),
    *("model.dropout", "model.connector", "model.connector_options", "model.vision_init_from"),
    *("model.freeze", "model.init_from"),
)
WHY = {
    "objective.*": "the contrastive stage's",
    "rl.*": "the rl stage's",
    "model.embed_dim": "the dual encoder's",
    "model.path": "HF models are model.kind hf_vlm or llava here",
    "model.lora_*": "LoRA applies to model.kind hf_vlm or llava",
    "model.vision_path": "model.kind=llava's",
}


def check_captioner_config(cfg: Config, stage: str, used: tuple[str, ...] = CAPTION_KEYS) -> None:
    """The captioner's own rules, shared by the stages that train it (caption, rl)."""
    m = cfg.model
    reject_unused(cfg, used, f"stage {stage}", WHY)
    check_choice("model.kind", m.kind, ("captioner",), f"stage {stage}")
    if is_shard_source(cfg.data.train):
        raise ConfigError(
            f"stage {stage} reads map-style records (JSONL/COCO/HF datasets): its length buckets "
            "(data.length_buckets) and caption evaluation need every sample indexed up front. "
            "data.train names tar shards, which stream in stage contrastive; pass the JSONL here"
        )
    check_choice("model.connector", m.connector, CONNECTORS)
    try:  # before the run folder is written
        check_connector_options(m.connector, m.connector_options)
    except ValueError as e:
        raise ConfigError(f"model.connector / model.connector_options: {e}") from None
    for part in m.freeze:
        if part not in PARTS:
            raise ConfigError(f"'model.freeze' entry {part!r} is not one of {list(PARTS)}")
    if set(PARTS) <= set(m.freeze):
        raise ConfigError("'model.freeze' freezes every part of the model: nothing would train")
    backbones.check_captioner_vision(cfg)


class CaptionCore:
    """What the caption and rl stages share, held by both (composition): the tokenizer,
    datasets, the model built from config and ``model.init_from``, and sharded evaluation."""

    def __init__(self, cfg: Config, out_dir: Path, ctx: RunContext) -> None:
        self.cfg, self.out_dir, self.ctx = cfg, out_dir, ctx
        self._eval_sets: dict[str, CaptionDataset] = {}
        self.pin_init: Path | None = None  # rl: the run folder its start is kept in

    def _source(self, path: str):
        d = self.cfg.data
        return read_caption_source(path, d.image_column, d.text_column)

    def prepare(self) -> None:
        """Reuse the tokenizer of `model.init_from` (or of this run), else train one (rank 0)."""
        self.init_ckpt = resolve_init(self.cfg.model.init_from, self.pin_init, self.ctx.is_main)
        tok_dir = self.out_dir / "tokenizer"
        c = self.cfg.caption
        prepare_tokenizer(
            tok_dir,
            self.init_ckpt,
            lambda: training_texts(self._source(self.cfg.data.train), c.prompt, c.instruction),
            self.cfg.data.tokenizer_vocab,
            self.ctx.is_main,
        )
        distributed.barrier()
        self.tokenizer = TextTokenizer.load(tok_dir)
        d = self.cfg.data
        self.evaluator = CaptionEvaluator(
            CaptionCollate(self.tokenizer.pad_id),
            self.ctx,
            d.eval_batch_size or d.batch_size,
            self._decode,
        )

    def build_model(self) -> nn.Module:
        model = backbones.build_captioner(self.cfg, self.tokenizer)
        if self.init_ckpt is not None:
            backbones.load_initial_weights(model, self.init_ckpt)
        elif self.cfg.model.vision_init_from:
            backbones.load_vision_tower(model, self.cfg.model.vision_init_from)
        model.freeze(self.cfg.model.freeze)
        return model

    def dataset(self, path: str, train: bool) -> CaptionDataset:
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

    def train_dataset(self, train: bool = True) -> CaptionDataset:
        """The training records (first data.max_train_samples of them when set); `train=False`
        gives eval-style samples (prompt ids and every reference), as RL samples from."""
        ds = self.dataset(self.cfg.data.train, train=train)
        if self.cfg.data.image_cache_mb:
            ds.source.decoded = DecodedImages.shared(
                self.cfg.data.train, self.cfg.data.image_cache_mb
            )
        if self.cfg.data.max_train_samples:
            ds.records = ds.records[: self.cfg.data.max_train_samples]
        return ds

    def loader(self, dataset: CaptionDataset, sampler: Any) -> Loader:
        return MapLoader(
            dataset,
            sampler,
            CaptionCollate(self.tokenizer.pad_id),
            num_workers=self.cfg.data.num_workers,
            seed=self.cfg.run.seed,
            pin_memory=self.ctx.device.type == "cuda",
        )

    def checkpoint_files(self) -> dict[str, Path]:
        return {"tokenizer": self.out_dir / "tokenizer"}

    # ---- evaluation ---------------------------------------------------------------------

    def evaluate_decoding(
        self, model: nn.Module, split: str, strategies: dict[str, str]
    ) -> dict[str, float]:
        """Sharded loss plus BLEU/CIDEr-D per decoding strategy (`CaptionEvaluator`);
        ``strategies`` maps a metric-name prefix ('' = none) to a strategy."""
        if split not in self._eval_sets:
            path = self.cfg.data.eval if split == "val" else self.cfg.data.test
            self._eval_sets[split] = self.dataset(path, train=False)
        return self.evaluator.evaluate(model, self._eval_sets[split], strategies)

    def _decode(
        self, model: nn.Module, images: Tensor, prompt_ids: list[list[int]], strategy: str
    ) -> list[str]:
        """Captions of `images` decoded with `strategy` and the caption.* decoding settings."""
        c = self.cfg.caption
        return decode_captions(
            model,
            self.tokenizer,
            images,
            prompt_ids,
            strategy=strategy,
            num_beams=c.num_beams,
            max_new_tokens=c.max_new_tokens,
            length_penalty=c.length_penalty,
        )


class CaptionStage:
    """Teacher-forced captioning (pretrain/finetune/sft); eval by decoding + BLEU/CIDEr-D."""

    best_metric = "eval_CIDEr-D"
    best_mode = "max"

    def __init__(self, cfg: Config, out_dir: Path, ctx: RunContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        hf = cfg.model.kind in HF_CAPTION_KINDS
        self.core: Any = (HFCaptionCore if hf else CaptionCore)(cfg, out_dir, ctx)

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """The built-in captioner's rules, or those of the HF kinds (`caption_hf`)."""
        check_choice(
            "model.kind", cfg.model.kind, ("captioner", *HF_CAPTION_KINDS), "stage caption"
        )
        if cfg.model.kind in HF_CAPTION_KINDS:
            check_hf_caption_config(cfg)
        else:
            check_captioner_config(cfg, "caption")

    @property
    def tokenizer(self) -> Any:
        """The run's tokenizer (a `TextTokenizer`, or an HF tokenizer for the HF kinds)."""
        return self.core.tokenizer

    @classmethod
    def eval_metrics(cls, cfg: Config) -> tuple[str, ...]:
        return metric_names(("", "beam_") if cfg.caption.eval_beam else ("",))

    def prepare(self) -> None:
        self.core.prepare()

    def build_model(self) -> nn.Module:
        return self.core.build_model()

    def build_loader(self) -> Loader:
        """Length-bucketed batches when data.length_buckets > 0, else shuffled batches."""
        d, ctx = self.cfg.data, self.ctx
        dataset = self.core.train_dataset()
        if d.length_buckets > 0:
            # buckets by the caption each epoch will draw, not by the first one
            sampler: Any = LengthBucketBatchSampler(
                dataset.epoch_token_lengths,
                d.batch_size,
                ctx.rank,
                ctx.world_size,
                self.cfg.run.seed,
                n_buckets=d.length_buckets,
                max_same_bucket_run=d.max_same_bucket_run,
            )
        else:
            sampler = ShardedBatchSampler(
                len(dataset), d.batch_size, ctx.rank, ctx.world_size, self.cfg.run.seed
            )
        return self.core.loader(dataset, sampler)

    def forward_backward(
        self, model: ParallelModel, batch: CaptionBatch, scale: float
    ) -> StepOutput:
        """Mean CE over the labelled tokens of the *global* batch, whatever the world size.

        Each rank's mean is reweighted by its share of the global token count (one scalar
        all-reduce), so DDP's gradient average equals one process holding the whole batch.
        """
        out = model(batch["images"], batch["input_ids"], batch["attention_mask"], batch["labels"])
        n = out["n_tokens"].double()
        local = torch.stack([out["loss"].detach().double() * n, out["token_acc"].double() * n, n])
        total = distributed.all_reduce_sum(local)  # (3,) CE sum, correct tokens, labelled tokens
        n_all = total[2].clamp(min=1.0)
        weight = (self.ctx.world_size * n / n_all).to(out["loss"].dtype)
        (out["loss"] * weight * scale).backward()
        metrics = {"token_acc": float(total[1] / n_all), "tokens": float(total[2])}
        if batch.get("visual_tokens") is not None:  # HF kinds: image tokens per image
            metrics["visual_tokens_mean"] = float(batch["visual_tokens"].float().mean())
            metrics["visual_tokens_max"] = float(batch["visual_tokens"].max())
        return StepOutput((total[0] / n_all).float(), metrics)

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Sharded loss + decoding; strings gathered once, every rank scores the same set."""
        strategies = {"": self.cfg.caption.strategy}
        if self.cfg.caption.eval_beam:
            strategies["beam_"] = "beam"
        return self.core.evaluate_decoding(model, split, strategies)

    def checkpoint_files(self) -> dict[str, Path]:
        return self.core.checkpoint_files()

    def export(self, model: nn.Module, folder: Path) -> None:
        """Nothing beyond the weights and the tokenizer (or processor); the HF kinds export
        for transformers with `vltrain export RUN --format hf` (`export_hf`)."""

    def export_hf(self, model: nn.Module, out: Path) -> Path:
        """HF kinds: a folder plain transformers loads (the model and its processor)."""
        if not isinstance(self.core, HFCaptionCore):
            raise ConfigError(
                f"--format hf exports caption runs of model.kind {' or '.join(HF_CAPTION_KINDS)}"
                f"; this run trains model.kind={self.cfg.model.kind} (use --format vltrain)"
            )
        return self.core.export_hf(model, out)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state besides the weights."""
