"""What the contrastive stage reads: image-caption records, query/positive pair records (with a
``data.train_corpus`` of documents they name), or tar shards (streamed), built from the config.

`ContrastiveData` is held by the stage (composition): its training and evaluation datasets,
the stream loader of tar shards, the texts its BPE tokenizer trains on and the words the
reading loss reads (`objective.reading`, the synthetic-page reading model's targets).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vltrain.config.core import ConfigError
from vltrain.config.schema import Config
from vltrain.core import distributed
from vltrain.data.images import BadSample, DecodedImages, check_text
from vltrain.data.pairs import (
    PairDataset,
    Side,
    check_side_modality,
    is_pair_file,
    read_corpus,
    read_pair_records,
    side_texts,
)
from vltrain.data.records import ImageTextDataset, read_records
from vltrain.data.shard_decode import SampleDecoder
from vltrain.data.shards import is_shard_source, read_texts, resolve_shards
from vltrain.data.streaming import StreamLoader

#: captions read from tar shards to train the built-in BPE tokenizer
TOKENIZER_TEXTS = 200_000


def uses_pairs(cfg: Config) -> bool:
    """True when data.train holds query/positive records (not image-caption records)."""
    return is_pair_file(cfg.data.train)


def is_valid_text(text: object) -> bool:
    """True for a caption the dataset would accept (non-empty, valid UTF-8 string)."""
    try:
        check_text(text)
    except BadSample:
        return False
    return True


class ContrastiveData:
    """The contrastive stage's datasets from `cfg`; `native`: images stay PIL at their own size
    (HF backbones bring their own processor)."""

    def __init__(self, cfg: Config, native: bool) -> None:
        self.cfg, self.native = cfg, native

    def train_dataset(self) -> ImageTextDataset | PairDataset:
        """The training records (the first data.max_train_samples of them when set)."""
        cfg = self.cfg
        if uses_pairs(cfg):
            ds: Any = self.pair_dataset(cfg.data.train, True, cfg.objective.hard_negatives)
        else:
            ds = ImageTextDataset(
                cfg.data.train,
                cfg.data.image_size,
                cfg.run.seed,
                hard_negatives=cfg.objective.hard_negatives,
                train=True,
                native=self.native,
                image_column=cfg.data.image_column,
                text_column=cfg.data.text_column,
                second_caption=cfg.objective.caption_contrast > 0,
            )
            if cfg.data.image_cache_mb:
                ds.source.decoded = DecodedImages.shared(cfg.data.train, cfg.data.image_cache_mb)
        if cfg.data.max_train_samples:
            ds.records = ds.records[: cfg.data.max_train_samples]
        return ds

    def pair_dataset(self, path: str | Path, train: bool, hard_negatives: int) -> PairDataset:
        """Pair records of `path` for this backbone; image+text sides need a VLM (ConfigError)."""
        cfg = self.cfg
        ds = PairDataset(
            path,
            cfg.data.image_size,
            cfg.run.seed,
            hard_negatives=hard_negatives,
            train=train,
            native=self.native,
            corpus=cfg.data.train_corpus,
        )
        for role, kind in ds.modalities.items():
            check_side_modality(cfg.model.kind, role, kind, str(path))
        if train and cfg.objective.reading and ds.modalities["positive"] != "image":
            raise ConfigError(
                f"objective.reading trains the image tower to read the positive images, but the "
                f"positives of {path} are {ds.modalities['positive']} sides: set "
                "objective.reading=0"
            )
        return ds

    def eval_dataset(
        self, path: str | Path, hard_negatives: int = 10**6, merge_images: bool = False
    ) -> ImageTextDataset:
        """Records of `path` as evaluation samples (every caption, fixed order), decoded the
        way this backbone's batcher expects (native-size PIL images for HF backbones);
        `merge_images`: lines of the same image path are one sample (retrieval scoring)."""
        d = self.cfg.data
        return ImageTextDataset(
            path,
            d.image_size,
            self.cfg.run.seed,
            hard_negatives=hard_negatives,
            train=False,
            native=self.native,
            image_column=d.image_column,
            text_column=d.text_column,
            merge_images=merge_images,
        )

    def stream_loader(
        self, collate: Any, rank: int, world_size: int, pin_memory: bool
    ) -> StreamLoader:
        """Tar shards, streamed with exact resume (vltrain.data.streaming)."""
        d, seed = self.cfg.data, self.cfg.run.seed
        decode = SampleDecoder(
            d.image_size,
            seed,
            self.cfg.objective.hard_negatives,
            native=self.native,
            second_caption=self.cfg.objective.caption_contrast > 0,
        )
        return StreamLoader(
            resolve_shards(d.train),
            d.batch_size,
            rank,
            world_size,
            streams=d.streams,
            seed=seed,
            buffer=d.shuffle_buffer,
            decode=decode,
            collate=collate,
            num_workers=d.num_workers,
            gather=distributed.all_gather_object,
            pin_memory=pin_memory,
        )

    def training_texts(self) -> list[str]:
        """Every valid training text, for the BPE tokenizer (bad records are skipped and
        counted later): captions (of the first shards: images skipped), or every side of the
        pair records and data.train_corpus's documents."""
        train = self.cfg.data.train
        if is_shard_source(train):
            texts = read_texts(resolve_shards(train), limit=TOKENIZER_TEXTS)
        elif uses_pairs(self.cfg):
            records, corpus = self._pair_records()
            texts = side_texts(records)
            if corpus:
                texts += [s["text"] for s in corpus.values() if isinstance(s["text"], str)]
        else:
            d = self.cfg.data
            texts = [
                t for r in read_records(train, d.image_column, d.text_column) for t in r["text"]
            ]
        return [t for t in texts if is_valid_text(t)]

    def training_words(self) -> list[str]:
        """The words listed on the training records' image sides (what the reading loss
        reads)."""
        out: list[str] = []
        for rec in self._pair_records()[0]:
            for side in (rec["query"], *rec["positives"], *rec["negatives"]):
                out += [w[0] for w in side.get("words") or ()]
        return out

    def _pair_records(self) -> tuple[list[dict[str, Any]], dict[str, Side] | None]:
        """The training pair records (document ids resolved) and data.train_corpus's docs."""
        path = self.cfg.data.train_corpus
        corpus = read_corpus(path) if path else None
        return read_pair_records(self.cfg.data.train, corpus), corpus
