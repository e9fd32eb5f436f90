"""Budgets: `train.max_samples` / `train.max_flops` / `train.epochs` -> `train.max_steps`, once,
before a run.

The FLOPs of one training sample come from :mod:`vltrain.scaling.flops` on the model the
config describes, built on the meta device (no memory, no compute) with the run's real
tokenizer (the one the stage will use: the run folder's, `model.init_from`'s, or the same BPE
training the stage runs), at the mean real text length of the training records.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from pathlib import Path

import torch

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.core.files import file_version
from vltrain.data.tokenizer import TextTokenizer, prepare_tokenizer
from vltrain.scaling.flops import ModelFlops, captioner_flops, dual_encoder_flops

#: model kinds with a FLOP formula for a train.max_flops budget
FLOP_KINDS = ("captioner", "dual_encoder", "vlm")


def _texts(cfg: Config) -> list[str]:
    """The texts the stage trains its tokenizer on (the stages' own functions)."""
    d = cfg.data
    if cfg.model.kind == "captioner":
        from vltrain.data.caption_data import read_caption_source, training_texts

        source = read_caption_source(d.train, d.image_column, d.text_column)
        return training_texts(source, cfg.caption.prompt, cfg.caption.instruction)
    from vltrain.data.contrastive_data import is_valid_text
    from vltrain.data.records import read_records

    records = read_records(d.train, d.image_column, d.text_column)
    return [t for r in records for t in r["text"] if is_valid_text(t)]


#: per process: (inputs of the tokenizer training) -> tokenizer, (..., tokenizer, max length)
#: -> mean length. A sweep checks and counts every run of its grid on the same data; BPE
#: training is deterministic, so the same inputs give the same tokenizer.
_MEMO: dict[tuple, object] = {}


def _text_key(cfg: Config) -> tuple:
    """What `_texts(cfg)` depends on, the data file's size and mtime included."""
    c = cfg.caption
    return (
        *file_version(cfg.data.train), cfg.model.kind,
        cfg.data.image_column, cfg.data.text_column, c.prompt, c.instruction,
    )  # fmt: skip


def run_tokenizer(cfg: Config) -> TextTokenizer:
    """The tokenizer the run will use, without writing into its folder."""
    from vltrain.core.checkpoint import resolve_init

    own = Path(cfg.run.out_dir) / "tokenizer"
    if (own / "tokenizer.json").is_file() and (cfg.train.resume or not cfg.train.overwrite):
        return TextTokenizer.load(own)
    init = resolve_init(cfg.model.init_from)
    key = ("tokenizer", _text_key(cfg), cfg.data.tokenizer_vocab, str(init))
    if key not in _MEMO:
        with tempfile.TemporaryDirectory() as tmp:
            prepare_tokenizer(
                Path(tmp), init, lambda: _texts(cfg), cfg.data.tokenizer_vocab, is_main=True
            )
            _MEMO[key] = TextTokenizer.load(Path(tmp))
    return _MEMO[key]


def mean_text_tokens(cfg: Config, tokenizer: TextTokenizer) -> int:
    """Mean real tokens per training text (bos + text + eos, cut at data.max_text_len)."""
    # keyed by the tokenizer's content: a sweep's finished runs each load their own copy of
    # the same tokenizer from their folders, and count once
    key = ("length", _text_key(cfg), cfg.data.max_text_len, tokenizer.digest())
    if key not in _MEMO:
        texts = _texts(cfg)[:20000]
        if not texts:
            raise ConfigError(f"data.train={cfg.data.train} holds no texts to count tokens of")
        lengths = [min(len(tokenizer.encode(t)) + 2, cfg.data.max_text_len) for t in texts]
        _MEMO[key] = max(2, round(sum(lengths) / len(lengths)))
    return _MEMO[key]


def config_flops(cfg: Config, tokenizer: TextTokenizer | None = None) -> ModelFlops:
    """Per-sample accounting of the model `cfg` describes (captioner, built-in dual encoder,
    or an HF VLM: `vlm_flops.vlm_config_flops`), built on the meta device, freezing as
    configured."""
    from vltrain.models.backbones import build_captioner, build_encoder

    if cfg.model.kind not in FLOP_KINDS:
        raise ConfigError(
            f"train.max_flops needs a FLOP formula for model.kind={cfg.model.kind!r} (have "
            f"{list(FLOP_KINDS)}); use train.max_samples, or count an HF model with "
            "vltrain.scaling.flops.measure_flops / hf_dual_encoder_flops"
        )
    from vltrain.data.pairs import is_pair_file

    if cfg.model.kind != "captioner" and cfg.data.train and is_pair_file(cfg.data.train):
        raise ConfigError(
            f"train.max_flops counts the FLOPs of image-caption records; {cfg.data.train} holds "
            "query/positive records (each side its own modality and count), which it does not "
            "count yet: set train.max_steps or train.max_samples"
        )
    if cfg.model.kind == "vlm":  # the HF model's own tokenizer and image processor
        from vltrain.scaling.vlm_flops import vlm_config_flops

        return vlm_config_flops(cfg)
    tokenizer = tokenizer or run_tokenizer(cfg)
    tokens = mean_text_tokens(cfg, tokenizer)
    with torch.device("meta"):
        if cfg.model.kind == "captioner":
            model = build_captioner(cfg, tokenizer)
            model.freeze(cfg.model.freeze)
            return captioner_flops(model, tokens)
        model = build_encoder(cfg, tokenizer)
    # every text a sample brings: its caption, up to `hard_negatives` negatives (the configured
    # count: records with fewer make this an upper bound) and the caption-caption term's second
    texts = 1 + cfg.objective.hard_negatives + (cfg.objective.caption_contrast > 0)
    return dual_encoder_flops(model, tokens, cfg.data.batch_size, texts)


def samples_per_step(cfg: Config, world_size: int = 1) -> int:
    return cfg.data.batch_size * world_size * cfg.optim.accum_steps


def dataset_size(cfg: Config) -> int:
    """Training samples in one epoch: the records of `data.train` (the first
    `data.max_train_samples` when set), or for tar shards the counts of their
    ``shardindex.json`` (a stream without one has no known length)."""
    n = _source_size(cfg)
    cap = cfg.data.max_train_samples
    return min(n, cap) if cap else n


def _source_size(cfg: Config) -> int:
    from vltrain.data import shards

    train = cfg.data.train
    if cfg.stage == "drafter":
        raise ConfigError(
            "train.epochs counts records of image-text data; the drafter stage trains on "
            "generated data: set train.max_steps"
        )
    if shards.is_shard_source(train):
        urls = shards.resolve_shards(train)
        index = shards.read_index(urls[0]) if urls else {}
        missing = [u for u in urls if Path(u).name not in index]
        if not urls or missing:
            raise ConfigError(
                f"train.epochs needs the dataset's size, but data.train={train} streams tar "
                f"shards without a {shards.INDEX_NAME} listing {missing[:1] or 'them'}: write "
                "the index (`vltrain data shard` does), or set train.max_steps / max_samples"
            )
        return sum(index[Path(u).name] for u in urls)
    if cfg.model.kind == "captioner":
        from vltrain.data.caption_data import read_caption_source

        return len(read_caption_source(train, cfg.data.image_column, cfg.data.text_column).records)
    from vltrain.data.pairs import is_pair_file, read_corpus, read_pair_records

    if is_pair_file(train):
        corpus = cfg.data.train_corpus
        return len(read_pair_records(train, read_corpus(corpus) if corpus else None))
    from vltrain.data.sources import read_source

    return len(read_source(train, cfg.data.image_column, cfg.data.text_column).records)


def resolve_epochs(cfg: Config, world_size: int = 1) -> Config:
    """`cfg` with `train.max_steps` (and the warmup, from `optim.warmup_epochs`) derived from
    `train.epochs`; rank 0 prints the arithmetic."""
    t, n = cfg.train, dataset_size(cfg)
    g, accum = cfg.data.batch_size * world_size, cfg.optim.accum_steps
    per_epoch = n // (g * accum)
    if per_epoch < 1:
        raise ConfigError(
            f"train.epochs: {n} samples make no full step of global batch {g} x accum {accum}: "
            "lower data.batch_size or optim.accum_steps"
        )
    steps = per_epoch * t.epochs
    warmup = cfg.optim.warmup_steps
    if cfg.optim.warmup_epochs:
        warmup = round(cfg.optim.warmup_epochs * per_epoch)
    if warmup > steps:
        raise ConfigError(
            f"the warmup ({warmup} steps) exceeds the {steps} steps of train.epochs={t.epochs}; "
            "lower optim.warmup_steps / optim.warmup_epochs"
        )
    if os.environ.get("RANK", "0") == "0":
        print(
            f"vltrain: {n} samples, global batch {g}, accum {accum} -> {per_epoch} steps per "
            f"epoch, {t.epochs} epochs = {steps} steps"
        )
    optim = dataclasses.replace(cfg.optim, warmup_steps=warmup)
    return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=steps), optim=optim)


def resolve_budget(cfg: Config, world_size: int = 1) -> Config:
    """`cfg` with `train.max_steps` set from its budget or its epochs (unchanged without)."""
    t = cfg.train
    if t.epochs:
        return resolve_epochs(cfg, world_size)
    if not (t.max_samples or t.max_flops):
        return cfg
    per_step = samples_per_step(cfg, world_size)
    if t.max_samples:
        steps = math.ceil(t.max_samples / per_step)
        why = f"train.max_samples={t.max_samples} / {per_step} samples per step"
    else:
        per_sample = config_flops(cfg).per_sample
        steps = math.floor(t.max_flops / (per_sample * per_step))
        why = (
            f"train.max_flops={t.max_flops:.3g} / ({per_sample:.4g} FLOPs per sample x "
            f"{per_step} samples per step)"
        )
    if steps < 1:
        raise ConfigError(f"{why} leaves {steps} optimizer steps: raise the budget")
    if cfg.optim.warmup_steps > steps:
        raise ConfigError(
            f"'optim.warmup_steps' ({cfg.optim.warmup_steps}) exceeds the {steps} steps of the "
            f"budget ({why}); lower the warmup"
        )
    return dataclasses.replace(cfg, train=dataclasses.replace(t, max_steps=steps))
