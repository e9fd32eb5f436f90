"""The contrastive stage's config policy: the keys it reads and the rules it checks at load.

`check_config(cfg)` runs before any compute (``ContrastiveStage.check_config``): the model
kinds and losses it trains, keys another stage or model kind would read (`used_keys`, with a
reason per key in `WHY`), the built-in tower's geometry, tar-shard layouts, and the rules of
query/positive records, corpus evaluation and the reading loss.
"""

from __future__ import annotations

from pathlib import Path

from vltrain.config.core import ConfigError, check_choice, reject_unused
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.data.contrastive_data import uses_pairs
from vltrain.data.pairs import is_pair_file
from vltrain.data.readers import DataError
from vltrain.data.shards import is_shard_source
from vltrain.data.sources import CAPTION_FILES, is_record_folder
from vltrain.data.streaming import check_stream_layout
from vltrain.eval import corpus
from vltrain.models import preflight
from vltrain.models.backbones import (
    ENCODER_KINDS,
    HF_KINDS,
    vision_options,
)
from vltrain.models.presets import VISION_PRESETS
from vltrain.objectives.contrastive import LOSSES

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


def tower_patch(cfg: Config) -> int:
    """The built-in vision tower's patch size: model.vision_options' or the preset's."""
    m = cfg.model
    return (
        vision_options(m.vision_options).get("patch_size") or VISION_PRESETS[m.vision]["patch_size"]
    )


def check_config(cfg: Config) -> None:
    """Model kinds, losses and options the contrastive stage honours."""
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
    if m.kind in HF_KINDS and not m.path:
        raise ConfigError(f"model.kind={m.kind} needs 'model.path' (a local HF model dir)")
    preflight.check_backbone(cfg)
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
    if m.kind == "dual_encoder":
        _check_tower(cfg)
        # builds both towers on the meta device: a value model.vision_options or
        # model.text_options holds that the tower refuses is a ConfigError here
        preflight.check_memory(cfg)
    _check_shards(cfg)
    _check_pairs(cfg)


def _check_tower(cfg: Config) -> None:
    """The built-in tower's patch grid must tile the image; a tower that pools nothing is the
    word-pair head's, which reads (`objective.reading`)."""
    m = cfg.model
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


def _check_shards(cfg: Config) -> None:
    """Tar shards train (streamed, their layout checked before any compute); evaluation
    indexes every sample, so it reads records."""
    if is_shard_source(cfg.data.train):
        try:
            check_stream_layout(
                cfg.data.streams, cfg.data.batch_size, distributed.launched_world_size()
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


def _check_pairs(cfg: Config) -> None:
    """Load-time rules for pair data, corpus evaluation and the reading loss."""
    if uses_pairs(cfg) and cfg.objective.caption_contrast:
        raise ConfigError(
            "objective.caption_contrast pairs two captions of one image (image-caption records); "
            f"data.train={cfg.data.train} holds query/positive records: set it to 0"
        )
    if uses_pairs(cfg) and cfg.data.image_cache_mb:
        raise ConfigError(
            "data.image_cache_mb keeps decoded images of image-caption records; "
            f"data.train={cfg.data.train} holds query/positive records: set it to 0"
        )
    for key in ("eval", "test"):
        path = getattr(cfg.data, key)
        if path and Path(path).is_dir() and not corpus.is_corpus_dir(path):
            if not is_record_folder(Path(path)):
                have = [f for f in corpus.FILES if (Path(path) / f).is_file()]
                lacks = [f for f in corpus.FILES if f not in have]
                raise ConfigError(
                    f"data.{key}={path} is a folder but lacks "
                    + (
                        f"{', '.join(lacks)} beside its {', '.join(have)} (a BEIR split)"
                        if have
                        else f"{', '.join(corpus.FILES)} (a BEIR split), a captions file "
                        f"({', '.join(CAPTION_FILES)}) or a datasets folder"
                    )
                )
        if path and is_pair_file(path):
            raise ConfigError(
                f"data.{key}={path} holds query/positive records; evaluate pair data on a "
                f"corpus: point data.{key} at a folder with {', '.join(corpus.FILES)}"
            )
    corpus_eval = any(corpus.is_corpus_dir(p) for p in (cfg.data.eval, cfg.data.test) if p)
    if corpus_eval and cfg.train.best_metric in ("", "eval_R@1_mean"):
        raise ConfigError(
            "data.eval is a corpus folder: its metrics are eval_R@1, eval_R@5, eval_nDCG@10, ... "
            "(not eval_R@1_mean); set train.best_metric=eval_R@1 (or another of them)"
        )
    if cfg.objective.reading and not uses_pairs(cfg):
        raise ConfigError(
            f"objective.reading reads the 'words' boxes of query/positive records' image "
            f"sides; data.train={cfg.data.train} holds none (`vltrain data synth --kind pages` "
            "writes such records): set objective.reading=0"
        )
    if cfg.objective.reading and cfg.objective.grad_cache_chunk:
        raise ConfigError(
            "objective.reading > 0 with objective.grad_cache_chunk > 0: the reading loss reads "
            "the positive images' grid in the plain step; set objective.grad_cache_chunk=0"
        )
    if cfg.data.train_corpus and not Path(cfg.data.train_corpus).is_file():
        raise ConfigError(f"data.train_corpus={cfg.data.train_corpus} does not exist")
