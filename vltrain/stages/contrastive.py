"""The contrastive (CLIP-style) stage: an encoder trained with InfoNCE or SigLIP on image-caption
or query/positive records, evaluated by retrieval.

The stage wires; the parts live below it: the model `vltrain.models.contrastive`
(encoder + loss, its embedding forwards), GradCache `vltrain.objectives.grad_cache`, the data
`vltrain.data.contrastive_data`, the evaluators `vltrain.eval.image_text` (image-caption
records) and `vltrain.eval.corpus` (a BEIR corpus folder), the config policy
`vltrain.stages.contrastive_checks`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.core.checkpoint import complete_checkpoints, has_weights, load_weights, resolve_init
from vltrain.data.batches import ImageTextBatch, PairBatch
from vltrain.data.contrastive_data import ContrastiveData
from vltrain.data.loaders import MapLoader
from vltrain.data.pairs import PairCollate, PairDataset
from vltrain.data.reading import (
    ReadingTargets,
    load_reading_tokens,
    reading_tokens,
    save_reading_tokens,
)
from vltrain.data.records import ImageTextDataset
from vltrain.data.samplers import ShardedBatchSampler
from vltrain.data.shards import is_shard_source
from vltrain.data.streaming import StreamLoader
from vltrain.data.tokenizer import TextTokenizer, prepare_tokenizer
from vltrain.engine.parallel import ParallelModel
from vltrain.engine.runtime import RunContext
from vltrain.engine.task import StepOutput
from vltrain.eval import corpus, image_text
from vltrain.eval.corpus import CorpusEvaluator
from vltrain.eval.image_text import ImageTextEvaluator
from vltrain.models.backbones import (
    HF_KINDS,
    build_batcher,
    build_encoder,
    objective_for,
    uses_tokenizer,
)
from vltrain.models.contrastive import ContrastiveModel, is_pair_batch
from vltrain.objectives import qwen3vl
from vltrain.objectives.contrastive import Features, build_loss_from_config
from vltrain.objectives.grad_cache import dual_encoder_grad_cache, pair_grad_cache
from vltrain.objectives.reading import ReadingLoss
from vltrain.stages import contrastive_checks

__all__ = ["ContrastiveStage"]


class ContrastiveStage:
    """Train a dual encoder contrastively; evaluate loss, accuracy, R@K and hard negatives."""

    best_metric = "eval_R@1_mean"
    best_mode = "max"

    def __init__(self, cfg: Config, out_dir: Path, ctx: RunContext) -> None:
        self.cfg, self.out_dir, self.ctx = cfg, out_dir, ctx
        self.native = cfg.model.kind in HF_KINDS  # HF backbones take images at their own size
        self.data = ContrastiveData(cfg, self.native)
        self._eval_sets: dict[str, ImageTextDataset] = {}

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Model kinds, losses and options this stage honours (`contrastive_checks`)."""
        contrastive_checks.check_config(cfg)

    @classmethod
    def eval_metrics(cls, cfg: Config) -> tuple[str, ...]:
        dims = tuple(f"eval_d{d}_*" for d in cfg.model.matryoshka_dims)
        return image_text.METRICS + corpus.METRICS + dims

    def prepare(self) -> None:
        """The BPE tokenizer: `model.init_from`'s, else trained on the training captions once
        (rank 0), else the one this run already saved; then the batcher and the evaluators."""
        cfg, d = self.cfg, self.cfg.data
        self.tokenizer: TextTokenizer | None = None
        self.init_ckpt = resolve_init(cfg.model.init_from)
        self.reading_tokens: list[int] | None = None
        if uses_tokenizer(cfg):
            tok_dir = self.out_dir / "tokenizer"
            prepare_tokenizer(
                tok_dir,
                self.init_ckpt,
                self.data.training_texts,
                d.tokenizer_vocab,
                self.ctx.is_main,
            )
            distributed.barrier()
            self.tokenizer = TextTokenizer.load(tok_dir)
            if cfg.objective.reading:
                self.reading_tokens = self._prepare_reading_tokens(tok_dir)
        self.batcher = build_batcher(cfg, self.tokenizer)
        bs = d.eval_batch_size or d.batch_size
        # the eval loss's chunk: data.eval_batch_size when set (a per-process size: times the
        # world size it changed the loss with the process count), else the global batch
        chunk = d.eval_batch_size or d.batch_size * self.ctx.world_size
        self.retrieval = ImageTextEvaluator(
            self.batcher, self.ctx, bs, cfg.model.matryoshka_dims, chunk
        )
        self.corpus = CorpusEvaluator(
            self.batcher,
            self.ctx,
            bs,
            d.image_size,
            self.native,
            cfg.model.kind,
            tuple(cfg.model.matryoshka_dims),
        )

    def _prepare_reading_tokens(self, tok_dir: Path) -> list[int] | None:
        """The run's reading vocabulary, saved beside its tokenizer (so checkpoints carry it):
        the one there; else, while no weights exist (a new run, or one stopped before its
        first checkpoint), the token ids of the training records' words; else None: weights
        saved before reading vocabularies existed read every id as its own class (their reader
        loads under its old name, `ContrastiveModel`)."""
        folder = self.out_dir  # a run dir, or a checkpoint folder (vltrain eval / mine)
        trained = has_weights(folder) or bool(complete_checkpoints(folder / "checkpoints"))
        if self.ctx.is_main and not trained and load_reading_tokens(tok_dir) is None:
            assert self.tokenizer is not None
            tokens = reading_tokens(self.tokenizer, self.data.training_words())
            if tokens:  # none: every rank refuses below
                save_reading_tokens(tok_dir, tokens)
        distributed.barrier()
        tokens = load_reading_tokens(tok_dir)
        if tokens is None and not trained:
            raise ConfigError(
                f"objective.reading={self.cfg.objective.reading} but no training record of "
                f"{self.cfg.data.train} lists the 'words' drawn on its image sides: there is "
                "nothing to read; set objective.reading=0 (or add word boxes, see "
                "docs/retrieval.md)"
            )
        return tokens

    def build_model(self) -> ContrastiveModel:
        encoder = build_encoder(self.cfg, self.tokenizer, reading_tokens=self.reading_tokens)
        if self.ctx.is_main and hasattr(encoder, "describe"):
            print(f"vltrain: {encoder.describe()}")
        # registry: objective.loss (infonce, siglip, qwen3vl); HF CLIP/SigLIP start at their own
        # scale
        loss = build_loss_from_config(objective_for(encoder, self.cfg.objective))
        loss.matryoshka_dims = tuple(self.cfg.model.matryoshka_dims)  # trained, not only scored
        reading = None
        if self.cfg.objective.reading:
            assert self.tokenizer is not None  # the built-in towers (check_config)
            classes = len(self.reading_tokens or range(self.tokenizer.vocab_size))
            reading = ReadingLoss(classes, self.cfg.objective.reading)
        model = ContrastiveModel(encoder, loss, reading)
        if self.init_ckpt is not None:  # e.g. a hard-negative round after `vltrain mine`
            try:
                load_weights(model, self.init_ckpt)
            except RuntimeError as e:
                raise ConfigError(
                    f"model.init_from={self.init_ckpt}: {str(e).splitlines()[0][:400]}; "
                    "model.kind, model.vision, model.text, "
                    "model.embed_dim, model.head, objective.loss, objective.reading (on or "
                    "off: its head is part of the weights) and the LoRA options must match the "
                    "source run's "
                    "config.yaml"
                ) from None
        return model

    def build_loader(self) -> MapLoader | StreamLoader:
        """Tar shards stream; records load map-style, shuffled by (seed, epoch)."""
        d, ctx = self.cfg.data, self.ctx
        pin = ctx.device.type == "cuda"
        if is_shard_source(d.train):
            return self.data.stream_loader(self.batcher, ctx.rank, ctx.world_size, pin)
        dataset = self.data.train_dataset()
        qwen3vl.check_negatives_per_query(self.cfg.objective, dataset.records, d.train)
        sampler = ShardedBatchSampler(
            len(dataset), d.batch_size, ctx.rank, ctx.world_size, self.cfg.run.seed
        )
        return MapLoader(
            dataset,
            sampler,
            self.train_collate(dataset),
            num_workers=d.num_workers,
            seed=self.cfg.run.seed,
            pin_memory=pin,
        )

    def train_collate(self, dataset: Any) -> Any:
        """The batcher, or its pair collate for query/positive records."""
        if isinstance(dataset, PairDataset):
            return PairCollate(self.batcher, dataset.modalities, self.reading_targets())
        return self.batcher

    def reading_targets(self) -> ReadingTargets | None:
        """What `objective.reading` trains on: a target per cell of the vision tower's grid."""
        if not self.cfg.objective.reading:
            return None
        grid = self.cfg.data.image_size // contrastive_checks.tower_patch(self.cfg)
        following = self.cfg.model.head == "word_pairs"
        return ReadingTargets(self.tokenizer, grid, following, self.reading_tokens)

    def forward_backward(
        self, model: ParallelModel, batch: ImageTextBatch | PairBatch, scale: float
    ) -> StepOutput:
        """GradCache when objective.grad_cache_chunk > 0 (same gradients, chunk-sized memory)."""
        chunk = self.cfg.objective.grad_cache_chunk
        if not chunk:
            loss, metrics = model(batch)
            (loss * scale).backward()
            loss = loss.detach()
        else:  # chunks run on the plain module; gradients are reduced once afterwards
            cached = pair_grad_cache if is_pair_batch(batch) else dual_encoder_grad_cache
            loss, metrics = cached(model.module, batch, chunk, scale)
            model.reduce_gradients()
        if batch.get("visual_tokens") is not None:  # the per-image budget actually used
            metrics["visual_tokens_mean"] = batch["visual_tokens"].float().mean()
            metrics["visual_tokens_max"] = batch["visual_tokens"].max().float()
        return StepOutput(loss, metrics)

    def evaluate(self, model: ContrastiveModel, split: str) -> dict[str, float]:
        """A corpus folder's retrieval metrics, or the records' image<->text ones; sharded."""
        path = self.cfg.data.eval if split == "val" else self.cfg.data.test
        if corpus.is_corpus_dir(path):  # queries x corpus with qrels
            ranks = self.out_dir / f"eval_ranks_{split}.jsonl"
            return self.corpus.evaluate(model.encoder, path, ranks_path=ranks)
        if split not in self._eval_sets:
            self._eval_sets[split] = self.data.eval_dataset(path, merge_images=True)

        def loss(image: Tensor, text: Tensor) -> tuple[Tensor, dict[str, Any]]:
            return model.loss.loss_from_features(Features(image, text, None))  # no gathering

        return self.retrieval.evaluate(model.encoder, self._eval_sets[split], loss)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state besides the weights."""

    def checkpoint_files(self) -> dict[str, Path]:
        return {"tokenizer": self.out_dir / "tokenizer"} if self.tokenizer else {}

    def export(self, model: nn.Module, folder: Path) -> None:
        """HF backbones: an HF-loadable `hf_model/` (save_pretrained) beside the safetensors."""
        if self.native:
            enc, loss = model.encoder, model.loss
            if hasattr(enc, "set_logit_params"):  # CLIP/SigLIP: the loss owns scale and bias
                log_scale = loss.logit_scale.clamp(max=loss.max_log_scale)
                enc.set_logit_params(log_scale, getattr(loss, "logit_bias", None))
            enc.save_pretrained(folder / "hf_model")
