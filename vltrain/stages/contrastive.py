"""The contrastive (CLIP-style) stage: dual encoder + InfoNCE, retrieval evaluation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vltrain.config.core import ConfigError, check_choice, reject_unused
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.core.checkpoint import (
    complete_checkpoints,
    has_weights,
    load_weights,
    resolve_init,
)
from vltrain.data.images import BadSample, DecodedImages, check_text
from vltrain.data.loaders import MapLoader
from vltrain.data.readers import DataError
from vltrain.data.reading import (
    ReadingTargets,
    load_reading_tokens,
    reading_tokens,
    save_reading_tokens,
)
from vltrain.data.records import ImageTextDataset, read_records, split_bad
from vltrain.data.samplers import EvalShardSampler, ShardedBatchSampler
from vltrain.data.shard_decode import SampleDecoder
from vltrain.data.shards import is_shard_source, read_texts, resolve_shards
from vltrain.data.streaming import StreamLoader, check_stream_layout
from vltrain.data.synth import scene_key
from vltrain.data.tokenizer import TextTokenizer, prepare_tokenizer
from vltrain.engine.parallel import ParallelModel
from vltrain.engine.runtime import RunContext, to_device
from vltrain.engine.task import StepOutput
from vltrain.eval.ceiling import retrieval_ceiling
from vltrain.eval.retrieval import image_text_retrieval
from vltrain.models.backbones import (
    ENCODER_KINDS,
    HF_KINDS,
    ImageTextCollate,
    build_batcher,
    build_encoder,
    objective_for,
    uses_tokenizer,
    vision_options,
)
from vltrain.models.presets import VISION_PRESETS
from vltrain.objectives import qwen3vl
from vltrain.objectives.contrastive import LOSSES, Features, build_loss_from_config
from vltrain.objectives.grad_cache import (
    TEXT_SIDES,
    dual_encoder_grad_cache,
    encode_text_sets,
)
from vltrain.objectives.reading import ReadingLoss
from vltrain.stages import embedding_pairs as pairs

__all__ = ["ContrastiveModel", "ContrastiveStage", "ImageTextCollate"]


class ContrastiveModel(nn.Module):
    """Encoder + loss in one module, so DDP sees one forward and the loss's temperature trains;
    with `reading`, the grid of the positive and image-negative pages also learns to read
    (`objective.reading`). Weights saved when the reader lived in the loss
    (``reading.head.*``) load into the encoder's (``encoder.reader.*``)."""

    def __init__(
        self, encoder: nn.Module, loss: nn.Module, reading: ReadingLoss | None = None
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.loss = loss
        self.reading = reading
        self._register_load_state_dict_pre_hook(_reader_moved)

    def embed(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
        """Unit-norm image (B, E), text (B, E) and hard-negative (M, E) embeddings."""
        return self._embed(batch, second=False)[:3]

    def _embed(
        self, batch: dict[str, Tensor], second: bool
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """`embed`'s three and, with `second`, the second captions' (B, E) of
        `objective.caption_contrast`; the texts in one grouped pass (`encode_text_sets`)."""
        img = self.encoder.encode_image(batch["images"])
        sides = TEXT_SIDES if second else TEXT_SIDES[:2]
        present = [(i, m) for i, m in sides if batch.get(i) is not None]
        sets = encode_text_sets(self.encoder, [(batch[i], batch[m]) for i, m in present])
        emb = {i: e for (i, _), e in zip(present, sets, strict=True)}
        return img, emb["input_ids"], emb.get("neg_ids"), emb.get("pair_ids")

    def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if pairs.is_pair_batch(batch) and self.reading is not None and "reading" in batch:
            q, p, n, read = pairs.embed_pairs_reading(self.encoder, batch)
            loss, metrics = self.loss(q, p, n)
            read_loss, read_metrics = self.reading(read, batch["reading"])
            return loss + read_loss, {**metrics, **read_metrics}
        if pairs.is_pair_batch(batch):  # query / positive / negatives sides of any modality
            return self.loss(*pairs.embed_pairs(self.encoder, batch))
        img, txt, neg, second = self._embed(batch, second=True)
        if second is not None:
            return self.loss(img, txt, neg, pairs=second)
        return self.loss(img, txt, neg)


def _reader_moved(state: dict[str, Any], prefix: str, *_: Any) -> None:
    """``reading.head.*`` (the reader's name before it moved into the encoder) ->
    ``encoder.reader.*``."""
    for name in [k for k in state if k.startswith(prefix + "reading.head.")]:
        state[prefix + "encoder.reader." + name[len(prefix + "reading.head.") :]] = state.pop(name)


def is_valid_text(text: object) -> bool:
    """True for a caption the dataset would accept (non-empty, valid UTF-8 string)."""
    try:
        check_text(text)
    except BadSample:
        return False
    return True


#: captions read from tar shards to train the built-in BPE tokenizer
TOKENIZER_TEXTS = 200_000

#: metrics `ContrastiveStage.evaluate` returns (patterns: per-kind, per-dim and per-k keys)
EVAL_METRICS = (
    "eval_loss",
    "eval_acc_i2t",
    "eval_R@1_mean",
    "eval_i2t_*",
    "eval_t2i_*",
    "eval_i2t_R@1_ceiling",
    "eval_t2i_R@1_ceiling",
    "eval_hardneg_acc",
    "eval_hardneg_acc_*",
    "eval_bad_samples",
    "eval_n_images",
)


#: keys every stage reads
COMMON = ("stage", "run.*", "optim.*", "train.*", "log.*", "tune.*", "doctor.*")
WHY = {
    "model.freeze": "the captioner's; LoRA (model.lora_r) trains part of an HF backbone",
    "model.vision_init_from": "the captioner's; use model.init_from for a contrastive run",
    "model.connector*": "the captioner's",
    "caption.*": "the caption stage's",
    "rl.*": "the rl stage's",
    "data.length_buckets": "the caption stage's",
    "objective.temperature": "objective.loss=infonce's start; hf_clip/hf_siglip start from the "
    "pretrained model's own scale",
    "objective.siglip_init_*": "objective.loss=siglip's start; hf_clip/hf_siglip start from the "
    "pretrained model's own scale",
    "model.lora_*": "LoRA applies to HF backbones",
    "objective.reading": "the built-in dual encoder's (it reads the tower's grid of cells)",
    "objective.terms": "objective.loss=qwen3vl's",
    "objective.false_negative_*": "objective.loss=qwen3vl's",
}


def used_keys(cfg: Config) -> tuple[str, ...]:
    """fnmatch patterns of the keys this stage reads for `cfg`'s model kind and loss."""
    m, o = cfg.model, cfg.objective
    used = [*COMMON, "model.kind", "model.init_from"]
    used += [f"data.{k}" for k in ("train", "eval", "test", "batch_size", "max_train_samples")]
    used += [f"data.{k}" for k in ("max_visual_tokens", "eval_batch_size", "num_workers")]
    used.append("data.image_cache_mb")
    used += [f"data.{k}" for k in ("image_size", "max_text_len", "max_bad_fraction")]
    used += ["data.image_column", "data.text_column", "data.streams", "data.shuffle_buffer"]
    used.append("data.train_corpus")
    used += [f"objective.{k}" for k in ("loss", "learn_temperature", "gather", "hard_negatives")]
    used.append("objective.grad_cache_chunk")
    pretrained_scale = m.kind in ("hf_clip", "hf_siglip")
    if o.loss == "infonce":
        used += ["objective.symmetric", "objective.label_smoothing", "objective.caption_contrast"]
        used += [] if pretrained_scale else ["objective.temperature", "objective.max_logit_scale"]
    elif o.loss == "qwen3vl":
        used += ["objective.terms", "objective.false_negative_*"]
        used += ["objective.temperature", "objective.max_logit_scale"]
        # query -> document only: symmetric=false (the retrieval presets') says just that
        used += [] if o.symmetric else ["objective.symmetric"]
    elif not pretrained_scale:
        used += ["objective.siglip_init_*", "objective.max_logit_scale"]
    if m.kind == "dual_encoder":
        used += ["data.tokenizer_vocab", "model.vision", "model.embed_dim", "model.head"]
        used += ["model.vision_layers", "model.vision_width", "model.vision_options"]
        used += ["model.dropout", "objective.reading"]
        if m.head == "word_pairs":
            used.append("model.pair_code")
        else:  # the word-pair code needs no text tower
            used += ["model.text", "model.text_layers", "model.text_width", "model.text_options"]
    else:
        # LoRA options stay accepted with model.lora_r=0: that is how a LoRA preset is turned off
        used += ["model.path", "model.local_files_only", "model.lora_*"]
    if m.kind == "vlm":
        used += ["model.pooling", "model.instruction_*", "model.matryoshka_dims"]
    return tuple(used)


def check_matryoshka_width(cfg: Config) -> None:
    """model.matryoshka_dims no wider than the VLM's embedding (its hidden size), read from
    the model's config before any weights load."""
    m = cfg.model
    if m.kind != "vlm" or not m.matryoshka_dims or not m.path:
        return
    from transformers import AutoConfig

    try:
        width = AutoConfig.from_pretrained(m.path, local_files_only=m.local_files_only)
        width = int(width.get_text_config().hidden_size)
    except (OSError, ValueError, AttributeError):
        return  # loading the model reports a bad model.path
    if m.matryoshka_dims[-1] > width:
        raise ConfigError(
            f"'model.matryoshka_dims' {m.matryoshka_dims} go beyond the embedding width {width} "
            f"of {m.path}; keep every prefix <= {width}"
        )


def tower_patch(cfg: Config) -> int:
    """The built-in vision tower's patch size: model.vision_options' or the preset's."""
    m = cfg.model
    return (
        vision_options(m.vision_options).get("patch_size") or VISION_PRESETS[m.vision]["patch_size"]
    )


class ContrastiveStage:
    """Train a dual encoder contrastively; evaluate loss, accuracy, R@K and hard negatives."""

    best_metric = "eval_R@1_mean"
    best_mode = "max"

    def __init__(self, cfg: Config, out_dir: Path, ctx: RunContext) -> None:
        self.cfg, self.out_dir, self.ctx = cfg, out_dir, ctx

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Model kinds, losses and options this stage honours."""
        m = cfg.model
        check_choice("model.kind", m.kind, ENCODER_KINDS, "stage contrastive")
        check_choice("objective.loss", cfg.objective.loss, LOSSES)
        if cfg.objective.loss == "qwen3vl" and m.kind in ("hf_clip", "hf_siglip"):
            raise ConfigError(
                f"objective.loss=qwen3vl (a softmax over query-query, doc-doc and query-doc "
                f"terms) does not train model.kind={m.kind}, whose pretrained scale belongs to "
                f"its own loss (objective.loss={'siglip' if m.kind == 'hf_siglip' else 'infonce'}"
                "); use qwen3vl with model.kind=vlm or dual_encoder"
            )
        check_matryoshka_width(cfg)
        if m.kind in HF_KINDS and not m.path:
            raise ConfigError(f"model.kind={m.kind} needs 'model.path' (a local HF model dir)")
        if m.kind in HF_KINDS and cfg.data.image_cache_mb:
            raise ConfigError(
                f"data.image_cache_mb keeps images decoded at data.image_size for the built-in "
                f"towers; model.kind={m.kind} reads images at their own size: set it to 0"
            )
        why = {**WHY, "model.text*": "model.head=word_pairs has no text tower"}
        why = why if m.head == "word_pairs" else WHY
        reject_unused(cfg, used_keys(cfg), f"stage contrastive with model.kind={m.kind}", why)
        if cfg.train.parallel == "fsdp" and cfg.objective.grad_cache_chunk:
            raise ConfigError(
                "objective.grad_cache_chunk > 0 with train.parallel=fsdp: GradCache runs its "
                "chunks outside the sharded forward, where FSDP cannot reduce the root's "
                "gradients; use train.parallel=ddp with GradCache, or fsdp with a smaller "
                "data.batch_size (activation checkpointing: train.activation_checkpointing=true)"
            )
        if m.kind == "dual_encoder":  # the tower's patch grid must tile the image
            patch = tower_patch(cfg)
            if cfg.data.image_size % patch:
                raise ConfigError(
                    f"'data.image_size' {cfg.data.image_size} is not a multiple of the "
                    f"'{m.vision}' vision tower's patch size {patch}"
                )
            pool = vision_options(m.vision_options).get("pool")
            if m.head == "word_pairs" and (not cfg.objective.reading or pool != "none"):
                raise ConfigError(
                    "model.head=word_pairs codes the tokens the image tower reads at each cell "
                    "of its grid: it needs objective.reading > 0 (the readers learn from the "
                    "records' word boxes) and model.vision_options.pool: none (the tower pools "
                    f"nothing); got objective.reading={cfg.objective.reading}, pool={pool!r}"
                )
            if pool == "none" and m.head != "word_pairs":
                raise ConfigError(
                    "model.vision_options.pool: none leaves the image tower without a pooled "
                    "feature; only model.head=word_pairs reads such a tower"
                )
        if is_shard_source(cfg.data.train):  # before any compute; torchrun sets WORLD_SIZE
            try:
                check_stream_layout(
                    cfg.data.streams, cfg.data.batch_size, int(os.environ.get("WORLD_SIZE", "1"))
                )
            except DataError as e:
                raise ConfigError(str(e)) from None
        if is_shard_source(cfg.data.train) and cfg.data.max_train_samples:
            raise ConfigError(
                "data.max_train_samples needs map-style records (JSONL/COCO); data.train names "
                "tar shards: write fewer shards (`vltrain data shard`) instead"
            )
        for key in ("eval", "test"):
            if is_shard_source(getattr(cfg.data, key)):
                raise ConfigError(
                    f"data.{key} must be JSONL/COCO records (evaluation indexes "
                    "every sample); tar shards are for data.train"
                )
        pairs.check_config(cfg)

    @classmethod
    def eval_metrics(cls, cfg: Config) -> tuple[str, ...]:
        dims = tuple(f"eval_d{d}_*" for d in cfg.model.matryoshka_dims)
        return EVAL_METRICS + pairs.CORPUS_METRICS + dims

    def prepare(self) -> None:
        """The BPE tokenizer: `model.init_from`'s, else trained on the training captions once
        (rank 0), else the one this run already saved."""
        self.tokenizer: TextTokenizer | None = None
        self._eval_sets: dict[str, ImageTextDataset] = {}
        self.init_ckpt = resolve_init(self.cfg.model.init_from)
        self.reading_tokens: list[int] | None = None
        if uses_tokenizer(self.cfg):
            tok_dir = self.out_dir / "tokenizer"
            prepare_tokenizer(
                tok_dir,
                self.init_ckpt,
                self._training_texts,
                self.cfg.data.tokenizer_vocab,
                self.ctx.is_main,
            )
            distributed.barrier()
            self.tokenizer = TextTokenizer.load(tok_dir)
            if self.cfg.objective.reading:
                self.reading_tokens = self._prepare_reading_tokens(tok_dir)
        self.batcher = build_batcher(self.cfg, self.tokenizer)
        self.corpus = pairs.CorpusEvaluator(self.cfg, self.ctx, self.batcher)

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
            tokens = reading_tokens(self.tokenizer, pairs.training_words(self.cfg))
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

    def _training_texts(self) -> list[str]:
        """Every valid training caption (bad records are skipped and counted later)."""
        if is_shard_source(self.cfg.data.train):  # captions of the first shards, images skipped
            texts = read_texts(resolve_shards(self.cfg.data.train), limit=TOKENIZER_TEXTS)
        elif pairs.uses_pairs(self.cfg):
            texts = pairs.training_texts(self.cfg)
        else:
            texts = [t for r in read_records(self.cfg.data.train) for t in r["text"]]
        return [t for t in texts if is_valid_text(t)]

    def build_model(self) -> nn.Module:
        encoder = build_encoder(self.cfg, self.tokenizer, reading_tokens=self.reading_tokens)
        if self.ctx.is_main and hasattr(encoder, "describe"):
            print(f"vltrain: {encoder.describe()}")
        # registry: objective.loss (infonce, siglip, qwen3vl); HF CLIP/SigLIP start at their own
        # scale
        loss = build_loss_from_config(objective_for(encoder, self.cfg.objective))
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
                    f"model.init_from={self.init_ckpt} does not fit this model "
                    f"({str(e)[:300]}...); model.kind, model.vision, model.text, "
                    "model.embed_dim, model.head, objective.loss, objective.reading (on or "
                    "off: its head is part of the weights) and the LoRA options must match the "
                    "source run's "
                    "config.yaml"
                ) from None
        return model

    def train_dataset(self) -> ImageTextDataset | pairs.PairDataset:
        if pairs.uses_pairs(self.cfg):
            ds = pairs.pair_dataset(
                self.cfg, self.cfg.data.train, True, self.cfg.objective.hard_negatives
            )
        else:
            ds = ImageTextDataset(
                self.cfg.data.train,
                self.cfg.data.image_size,
                self.cfg.run.seed,
                hard_negatives=self.cfg.objective.hard_negatives,
                train=True,
                native=self.cfg.model.kind in HF_KINDS,
                image_column=self.cfg.data.image_column,
                text_column=self.cfg.data.text_column,
                second_caption=self.cfg.objective.caption_contrast > 0,
            )
            if self.cfg.data.image_cache_mb:
                ds.source.decoded = DecodedImages.shared(
                    self.cfg.data.train, self.cfg.data.image_cache_mb
                )
        if self.cfg.data.max_train_samples:
            ds.records = ds.records[: self.cfg.data.max_train_samples]
        qwen3vl.check_negatives_per_query(self.cfg.objective, ds.records, self.cfg.data.train)
        return ds

    def build_loader(self) -> MapLoader | StreamLoader:
        if is_shard_source(self.cfg.data.train):
            return self.stream_loader()
        dataset = self.train_dataset()
        sampler = ShardedBatchSampler(
            len(dataset),
            self.cfg.data.batch_size,
            self.ctx.rank,
            self.ctx.world_size,
            self.cfg.run.seed,
        )
        return MapLoader(
            dataset,
            sampler,
            self.train_collate(dataset),
            num_workers=self.cfg.data.num_workers,
            seed=self.cfg.run.seed,
            pin_memory=self.ctx.device.type == "cuda",
        )

    def stream_loader(self) -> StreamLoader:
        """Tar shards, streamed with exact resume (vltrain.data.streaming)."""
        d = self.cfg.data
        decode = SampleDecoder(
            d.image_size,
            self.cfg.run.seed,
            self.cfg.objective.hard_negatives,
            native=self.cfg.model.kind in HF_KINDS,
            second_caption=self.cfg.objective.caption_contrast > 0,
        )
        return StreamLoader(
            resolve_shards(d.train),
            d.batch_size,
            self.ctx.rank,
            self.ctx.world_size,
            streams=d.streams,
            seed=self.cfg.run.seed,
            buffer=d.shuffle_buffer,
            decode=decode,
            collate=self.batcher,
            num_workers=d.num_workers,
            gather=distributed.all_gather_object,
            pin_memory=self.ctx.device.type == "cuda",
        )

    def train_collate(self, dataset: Any) -> Any:
        """The batcher, or its pair collate for query/positive records."""
        if isinstance(dataset, pairs.PairDataset):
            return pairs.collate(self.batcher, dataset, self.reading_targets())
        return self.batcher

    def reading_targets(self) -> ReadingTargets | None:
        """What `objective.reading` trains on: a target per cell of the vision tower's grid."""
        if not self.cfg.objective.reading:
            return None
        grid = self.cfg.data.image_size // tower_patch(self.cfg)
        following = self.cfg.model.head == "word_pairs"
        return ReadingTargets(self.tokenizer, grid, following, self.reading_tokens)

    def forward_backward(
        self, model: ParallelModel, batch: dict[str, Any], scale: float
    ) -> StepOutput:
        """GradCache when objective.grad_cache_chunk > 0 (same gradients, chunk-sized memory)."""
        chunk = self.cfg.objective.grad_cache_chunk
        if not chunk:
            loss, metrics = model(batch)
            (loss * scale).backward()
            loss = loss.detach()
        else:  # chunks run on the plain module; gradients are reduced once afterwards
            cached = (
                pairs.pair_grad_cache if pairs.is_pair_batch(batch) else dual_encoder_grad_cache
            )
            loss, metrics = cached(model.module, batch, chunk, scale)
            model.reduce_gradients()
        if batch.get("visual_tokens") is not None:  # the per-image budget actually used
            metrics["visual_tokens_mean"] = batch["visual_tokens"].float().mean()
            metrics["visual_tokens_max"] = batch["visual_tokens"].max().float()
        return StepOutput(loss, metrics)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """No state besides the weights."""

    def checkpoint_files(self) -> dict[str, Path]:
        return {"tokenizer": self.out_dir / "tokenizer"} if self.tokenizer else {}

    def export(self, model: nn.Module, folder: Path) -> None:
        """HF backbones: an HF-loadable `hf_model/` (save_pretrained) beside the safetensors."""
        if self.cfg.model.kind in HF_KINDS:
            enc, loss = model.encoder, model.loss
            if hasattr(enc, "set_logit_params"):  # CLIP/SigLIP: the loss owns scale and bias
                log_scale = loss.logit_scale.clamp(max=loss.max_log_scale)
                enc.set_logit_params(log_scale, getattr(loss, "logit_bias", None))
            enc.save_pretrained(folder / "hf_model")

    # ---- evaluation -------------------------------------------------------------------

    def eval_dataset(self, path: str | Path, hard_negatives: int = 10**6) -> ImageTextDataset:
        """Records of `path` as evaluation samples (every caption, fixed order), decoded the
        way this backbone's batcher expects (native-size PIL images for HF backbones)."""
        return ImageTextDataset(
            path,
            self.cfg.data.image_size,
            self.cfg.run.seed,
            hard_negatives=hard_negatives,
            train=False,
            native=self.cfg.model.kind in HF_KINDS,
            image_column=self.cfg.data.image_column,
            text_column=self.cfg.data.text_column,
        )

    def _eval_set(self, split: str) -> ImageTextDataset:
        if split not in self._eval_sets:
            path = self.cfg.data.eval if split == "val" else self.cfg.data.test
            self._eval_sets[split] = self.eval_dataset(path)
        return self._eval_sets[split]

    def embed_shard(
        self,
        model: ContrastiveModel,
        ds: ImageTextDataset,
        rank: int = 0,
        world_size: int = 1,
        batch_size: int = 0,
    ) -> tuple[dict[str, Tensor], dict[str, list[int]], list[str]]:
        """Embeddings of the shard `rank` of `ds` through the evaluation batcher.

        Returns tensors (img (I, E), idx (I,), txt (T, E), owner (T,), hard-negative hit
        counts, n_bad), hard-negative hits per negative kind ({kind: [correct, total]}), and
        the caption strings in `txt` order. Evaluation and `vltrain mine` both embed here, so a
        mined embedding is exactly an evaluation embedding.
        """
        bs = batch_size or self.cfg.data.eval_batch_size or self.cfg.data.batch_size
        enc, dev = model.encoder, self.ctx.device
        out: dict[str, list[Tensor]] = {
            k: [] for k in ("img", "idx", "txt", "owner", "hn_correct", "hn_total")
        }
        n_bad, kind_hits, all_texts = 0, {}, []
        for keys in EvalShardSampler(len(ds), bs, rank, world_size):
            good, bad = split_bad([ds[k] for k in keys])
            n_bad += len(bad)
            if not good:
                continue
            images, _ = self.batcher.image_batch([s["image"] for s in good])
            img = enc.encode_image(to_device(images, dev))  # (b, E)
            texts = [t for s in good for t in s["texts"]]
            owner = torch.tensor([s["index"] for s in good for _ in s["texts"]])
            txt = self.encode_texts(enc, texts)  # (sum captions, E)
            out["img"].append(img.float().cpu())
            out["idx"].append(torch.tensor([s["index"] for s in good]))
            out["txt"].append(txt.float().cpu())
            out["owner"].append(owner)
            all_texts += texts
            c, t = self._hard_negative_hits(enc, img, txt, good, kind_hits)
            out["hn_correct"].append(c)
            out["hn_total"].append(t)
        cat = {k: (torch.cat(v) if v else torch.zeros(0)) for k, v in out.items()}
        cat["n_bad"] = torch.tensor([n_bad])
        return cat, kind_hits, all_texts

    def encode_texts(self, enc: nn.Module, texts: list[str]) -> Tensor:
        """Unit-norm text embeddings (N, E) through this stage's batcher."""
        ids, mask = self.batcher.text_batch(texts)
        return enc.encode_text(ids.to(self.ctx.device), mask.to(self.ctx.device))

    def _hard_negative_hits(
        self,
        enc: nn.Module,
        img: Tensor,
        txt: Tensor,
        good: list[dict],
        kind_hits: dict[str, list[int]],
    ) -> tuple[Tensor, Tensor]:
        """How often the first caption outscores each negative; adds per-kind counts to
        `kind_hits` for samples with `negative_kinds`."""
        negs = [n for s in good for n in s["negatives"]]
        if not negs:
            return torch.zeros(1), torch.zeros(1)
        neg = self.encode_texts(enc, negs).float()  # (M, E)
        first = torch.tensor([0] + [len(s["texts"]) for s in good[:-1]]).cumsum(0)
        owner = torch.tensor([i for i, s in enumerate(good) for _ in s["negatives"]])
        pos_score = (img.float() * txt[first].float()).sum(-1)  # (b,)
        neg_score = (img.float()[owner] * neg).sum(-1)  # (M,)
        hit = (pos_score[owner] > neg_score).cpu()  # (M,)
        kinds = [k for s in good for k in s.get("negative_kinds") or [None] * len(s["negatives"])]
        for kind, h in zip(kinds, hit.tolist(), strict=True):
            if kind is not None:
                c = kind_hits.setdefault(kind, [0, 0])
                c[0] += int(h)
                c[1] += 1
        return hit.sum().float().reshape(1), torch.tensor([float(len(negs))])

    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        """Sharded embedding, gathered once; every rank then computes the same metrics."""
        path = self.cfg.data.eval if split == "val" else self.cfg.data.test
        if pairs.corpus.is_corpus_dir(path):  # queries x corpus with qrels
            ranks = self.out_dir / f"eval_ranks_{split}.jsonl"
            return self.corpus.evaluate(model, path, ranks_path=ranks)
        shard, shard_kind_hits, _ = self.embed_shard(
            model, self._eval_set(split), self.ctx.rank, self.ctx.world_size
        )
        g = {k: distributed.all_gather_no_grad(v) for k, v in shard.items()}
        img, idx, txt, owner = g["img"], g["idx"], g["txt"], g["owner"]
        pos = torch.searchsorted(idx, owner)  # text -> row of its image in `img`
        metrics = image_text_retrieval(img, txt, pos)
        metrics["R@1_mean"] = 0.5 * (metrics["i2t_R@1"] + metrics["t2i_R@1"])
        metrics.update(self._ceiling(self._eval_set(split), idx, pos))
        metrics.update(self._eval_loss(model, img, txt, pos))
        total = float(g["hn_total"].sum())
        if total:
            metrics["hardneg_acc"] = float(g["hn_correct"].sum()) / total
        kind_hits: dict[str, list[int]] = {}
        for part in distributed.all_gather_object(shard_kind_hits):  # every rank, same order
            for kind, (c, t) in part.items():
                acc = kind_hits.setdefault(kind, [0, 0])
                acc[0], acc[1] = acc[0] + c, acc[1] + t
        for kind in sorted(kind_hits):  # accuracy per kind of negative (`negative_kinds`)
            c, t = kind_hits[kind]
            metrics[f"hardneg_acc_{pairs.corpus.metric_suffix(kind)}"] = c / t
        for dim in self.cfg.model.matryoshka_dims:  # truncated embeddings, evaluated separately
            small = image_text_retrieval(
                model.encoder.truncate(img, dim), model.encoder.truncate(txt, dim), pos
            )
            metrics.update({f"d{dim}_{k}": v for k, v in small.items() if "R@" in k})
        metrics["bad_samples"] = float(g["n_bad"].sum())
        metrics["n_images"] = float(img.shape[0])
        return metrics

    @staticmethod
    def _ceiling(ds: ImageTextDataset, idx: Tensor, pos: Tensor) -> dict[str, float]:
        """The R@1 a perfect model expects on these images (`vltrain.eval.ceiling`), when the
        records say what their captions describe (the synthetic data's scene); else nothing."""
        keys = [scene_key(ds.records[i]) for i in idx.tolist()]
        if not keys or all(k is None for k in keys):
            return {}
        n_captions = torch.bincount(pos, minlength=len(keys)).tolist()  # captions per image
        return {f"{k}_ceiling": v for k, v in retrieval_ceiling(keys, n_captions).items()}

    def _eval_loss(
        self, model: ContrastiveModel, img: Tensor, txt: Tensor, pos: Tensor
    ) -> dict[str, float]:
        """InfoNCE over fixed chunks of the eval set (first caption per image), world-size free."""
        first = torch.full((img.shape[0],), -1, dtype=torch.long)
        first.scatter_reduce_(0, pos, torch.arange(len(pos)), reduce="amin", include_self=False)
        # chunks of the global eval batch, so the value does not depend on the world size
        bs = (self.cfg.data.eval_batch_size or self.cfg.data.batch_size) * self.ctx.world_size
        loss_sum = acc_sum = 0.0
        for s in range(0, img.shape[0], bs):
            f = Features(
                img[s : s + bs].to(self.ctx.device),
                txt[first[s : s + bs]].to(self.ctx.device),
                None,
            )
            loss, m = model.loss.loss_from_features(f)
            loss_sum += float(loss) * f.image.shape[0]
            acc_sum += float(m["acc_i2t"]) * f.image.shape[0]
        n = max(img.shape[0], 1)
        return {"loss": loss_sum / n, "acc_i2t": acc_sum / n}
