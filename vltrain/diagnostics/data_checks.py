"""Checks on what the batches held: length composition, data order, eval/train overlap."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter, deque
from pathlib import Path

from torch import nn

from vltrain.config.schema import Config
from vltrain.core.files import file_version
from vltrain.data.shards import is_shard_source
from vltrain.diagnostics.record import Finding, StepRecord


class BatchComposition:
    """Per step the length bucket and mean length; the longest same-bucket run; loss vs batch
    length. Homogeneous batches are fine when length bucketing is configured and interleaved
    (at most data.max_same_bucket_run in a row); otherwise they whip the gradient."""

    name = "batch_composition"
    # judged on >= 32 samples in >= 3 batches (this rank's samples per step): a batch of one
    # has no spread (2-process runs of a small batch: a warning on every clean run), and 3
    # random batches of 2 or 4 lengths fell below the threshold in 22% / 1.3% of 20,000 draws
    # (uniform 5-45); with 32 samples, 0.16% / 0.01%
    min_samples = 32

    def __init__(self, cfg: Config) -> None:
        self.bucketed = cfg.data.length_buckets > 0
        self.n_buckets = max(cfg.data.length_buckets, 3)
        self.max_run = cfg.data.max_same_bucket_run if self.bucketed else 0
        self.pool: deque[int] = deque(maxlen=4096)
        self.recent: deque[list[int]] = deque(maxlen=16)
        self.means: deque[float] = deque(maxlen=64)  # recent batch mean lengths
        self.run, self.longest = 0, 0
        self.drawn: deque[int] = deque(maxlen=64)  # the sampler's own bucket ids, when given
        self.loss_by_bucket: dict[int, list[float]] = {}
        self.reported: set[str] = set()

    def homogeneity(self) -> float:
        """Mean within-batch length variance over the total variance of the recent batches
        (~1 for shuffled batches, ~0 for homogeneous ones). Within a batch the sample
        variance (n - 1): the population one of a batch of n is (n - 1) / n of the total."""
        flat = [x for b in self.recent for x in b]
        total = statistics.pvariance(flat) if len(flat) > 1 else 0.0
        if total == 0.0:
            return 1.0
        return statistics.fmean(statistics.variance(b) for b in self.recent) / total

    def observe(self, rec: StepRecord) -> list[Finding]:
        if not rec.lengths:
            return []
        self.pool.extend(rec.lengths)
        if len(rec.lengths) > 1:  # one sample has no within-batch spread
            self.recent.append(list(rec.lengths))
        mean_len = statistics.fmean(rec.lengths)
        self.means.append(mean_len)
        if rec.bucket is not None:  # the bucket the sampler drew from, not a guess by length
            self.drawn.append(rec.bucket)
            buckets = list(self.drawn)
        else:  # the trailing run, re-bucketed with the current edges (they settle with data)
            pool = self.pool
            edges = statistics.quantiles(pool, n=self.n_buckets) if len(pool) > 1 else []
            buckets = [sum(m > e for e in edges) for m in self.means]
        b = buckets[-1]
        self.run = next((i for i, x in enumerate(reversed(buckets)) if x != b), len(buckets))
        self.longest = max(self.longest, self.run)
        if rec.finite:
            self.loss_by_bucket.setdefault(b, []).append(rec.loss)
        out = []
        h = self.homogeneity()
        # 3 random batches of 8 never went below 0.5 in 3000 trials of the shapes captions
        if (
            not self.bucketed
            and len(self.recent) >= 3
            and sum(map(len, self.recent)) >= self.min_samples
            and h < 0.35
            and "homog" not in self.reported
        ):
            self.reported.add("homog")
            out.append(Finding(
                "warn", "homogeneous_batches", rec.step - len(self.recent) + 1,
                f"batches are homogeneous in length (within/total variance {h:.2f}) though "
                "no length bucketing is configured",
                "shuffle the batches (a sorted or grouped sampler?); or configure "
                "data.length_buckets with data.max_same_bucket_run",
                {"homogeneity": h, "mean_len": mean_len},
            ))  # fmt: skip
        if self.bucketed and self.run > self.max_run and "run" not in self.reported:
            self.reported.add("run")
            out.append(Finding(
                "warn", "homogeneous_batches", rec.step - self.run + 1,
                f"{self.run} consecutive batches from one length bucket "
                f"(data.max_same_bucket_run={self.max_run})",
                "interleave buckets: the loss and gradient swing with batch length",
                {"run": self.run, "bucket": b},
            ))  # fmt: skip
        return out

    def modes(self) -> dict[int, float]:
        """Mean loss per length bucket (the loss modes a bucketed run shows)."""
        return {b: statistics.fmean(v) for b, v in sorted(self.loss_by_bucket.items()) if v}

    def finish(self) -> list[Finding]:
        modes = self.modes()
        if len(modes) < 2 or not self.pool:
            return []
        within = [statistics.pstdev(v) for v in self.loss_by_bucket.values() if len(v) > 1]
        spread = max(modes.values()) - min(modes.values())
        if not within or spread < 2.0 * statistics.fmean(within):
            return []
        return [Finding(
            "info", "loss_by_length", 0,
            f"loss depends on the batch's length bucket (per-bucket means "
            f"{ {k: round(v, 3) for k, v in modes.items()} }; longest same-bucket run "
            f"{self.longest}): a multi-modal loss curve is the batches, not the model",
            "compare per-bucket curves (report.html) rather than the raw loss",
            {"modes": modes, "longest_run": self.longest},
        )]  # fmt: skip


REPLAY_STEPS = 3
"""Steps at the start of consecutive epochs compared for a replayed order. One batch is not
enough: a length-bucketed epoch of a few batches may start with the same batch by chance (its
mixed-length batches are cut from samples sorted by length), a forgotten set_epoch repeats them
all."""


class DataOrder:
    """Each epoch's order differs from the last (set_epoch not forgotten), and no sample
    comes twice within an epoch (this rank's view; shards are compared in RankConsistency).
    A sample is ``(epoch, id)``: each sample's own epoch where the record carries it (a
    streamed batch may hold the end of one epoch and the start of the next)."""

    name = "data_order"

    def __init__(self, cfg: Config) -> None:
        self.first: dict[int, list[int]] = {}  # epoch -> the ids of its first steps
        self.first_steps: dict[int, int] = {}  # epoch -> how many steps `first` holds
        self.seen: set[tuple[int, int]] = set()  # (epoch, id) of this epoch and the last
        self.epoch = -1
        self.reported: set[str] = set()
        self.streamed = is_shard_source(cfg.data.train)

    def observe(self, rec: StepRecord) -> list[Finding]:
        if not rec.sample_ids or rec.epoch < 0:
            return []
        out: list[Finding] = []
        keys = rec.keys()  # (epoch, id): a step may hold the end of one epoch and the next
        for epoch in sorted({e for e, _ in keys}):
            if epoch > self.epoch:  # a new epoch starts in this step
                if self.first_steps.get(self.epoch, REPLAY_STEPS) < REPLAY_STEPS:
                    out += self._replayed(rec.step, self.epoch)  # it ended in fewer steps
                self.epoch = epoch
                self.seen = {(e, i) for e, i in self.seen if e >= epoch - 1}
                self.first = {e: v for e, v in self.first.items() if e >= epoch - 1}
                self.first_steps = {e: n for e, n in self.first_steps.items() if e >= epoch - 1}
                self.first[epoch], self.first_steps[epoch] = [], 0
            if self.first_steps.get(epoch, REPLAY_STEPS) < REPLAY_STEPS:
                self.first[epoch] += [i for e, i in keys if e == epoch]
                self.first_steps[epoch] += 1
                if self.first_steps[epoch] == REPLAY_STEPS:
                    out += self._replayed(rec.step, epoch)
        counts = Counter(keys)
        dup = {k for k, n in counts.items() if n > 1} | (self.seen & counts.keys())
        if dup and "dup" not in self.reported:
            self.reported.add("dup")
            ids = sorted({i for _, i in dup})
            out.append(Finding(
                "error", "sample_repeated", rec.step,
                f"{len(ids)} sample(s) seen twice within epoch "
                f"{min(e for e, _ in dup)}: ids {ids[:8]}{' ...' if len(ids) > 8 else ''}",
                self._hint(),
                {"ids": ids[:20], "epochs": sorted({e for e, _ in dup})},
            ))  # fmt: skip
        self.seen.update(counts)
        return out

    def _hint(self) -> str:
        if self.streamed:  # the epoch fence rules out the shuffle buffers and the streams
            return (
                "a streamed epoch reads every sample once (data.shuffle_buffer and "
                "data.streams cannot repeat one), so two samples share an id: shards "
                "written separately restart their keys at 000000000 (write them in one "
                "`vltrain data shard` call or give them distinct keys), or data.train lists a "
                "shard twice"
            )
        return "the sampler must draw each index once per epoch"

    def _replayed(self, step: int, epoch: int) -> list[Finding]:
        """The epoch's first `REPLAY_STEPS` steps (all of it, if shorter) come in the order the
        previous epoch's did. Starts of unequal length (an epoch boundary inside a step) are
        compared on their common prefix, if that is long enough not to match by chance."""
        prev, ids = self.first.get(epoch - 1), self.first.get(epoch, [])
        n = min(len(prev or []), len(ids))
        if not prev or prev[:n] != ids[:n] or (len(prev) != len(ids) and n < 8):
            return []
        if "replay" in self.reported:
            return []
        self.reported.add("replay")
        return [Finding(
            "error", "epoch_replayed", step,
            f"epoch {epoch} starts with exactly the {self.first_steps[epoch]} step(s) epoch "
            f"{epoch - 1} started with: the same order every epoch",
            "derive the shuffle from (seed, epoch): call sampler.set_epoch(epoch)",
            {"epoch": epoch, "ids": ids[:16]},
        )]  # fmt: skip

    def finish(self) -> list[Finding]:
        return []


#: (resolved path, size, mtime_ns, limit) of a record file -> its fingerprints, so that the
#: stages of one pipeline process (and the report after them) hash a dataset's images once
_FINGERPRINTS: dict[tuple[str, int | None, int | None, int], tuple[frozenset[str], int]] = {}


CHAT_FIELDS = ("prompt", "completion", "messages", "conversations")
"""Record fields besides ``text`` that hold a record's text (chat and drafter records)."""


#: the fraction of repeated training records `train_duplicates` warns at
DUPLICATE_WARN = 0.05


def record_fingerprints(path: str, limit: int = 50_000) -> frozenset[str]:
    """Content fingerprints of a JSONL record file: sha1 of the image bytes (else its path)
    plus the normalised texts (``text`` and `CHAT_FIELDS`). Empty for other formats.

    Kept per process while the record file's size and modification time stay the same (an
    image rewritten in place under an unchanged record file is not hashed again)."""
    return _fingerprinted(path, limit)[0]


def _fingerprinted(path: str, limit: int) -> tuple[frozenset[str], int]:
    """(`record_fingerprints`, how many records were fingerprinted), kept per file version."""
    p = Path(path)
    if not p.is_file() or p.suffix != ".jsonl":
        return frozenset(), 0
    key = (*file_version(p), limit)
    if key not in _FINGERPRINTS:
        if len(_FINGERPRINTS) >= 16:
            _FINGERPRINTS.pop(next(iter(_FINGERPRINTS)))
        prints, total = _fingerprints(p, limit)
        _FINGERPRINTS[key] = (frozenset(prints), total)
    return _FINGERPRINTS[key]


def _fingerprints(p: Path, limit: int) -> tuple[set[str], int]:
    from vltrain.data.images import BadSample
    from vltrain.data.readers import resolve_image_path

    out, total = set(), 0
    with p.open(encoding="utf-8", errors="replace") as f:  # bad lines are the loader's to count
        for i, line in enumerate(f):
            if i >= limit or not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(rec, dict):
                continue
            try:  # the same escape rules as the loader: never read outside the data folder
                img = resolve_image_path(p, str(rec.get("image", "")))
                key = hashlib.sha1(img.read_bytes()).hexdigest()
            except (BadSample, OSError):
                key = str(rec.get("image", ""))
            text = rec.get("text", "")
            texts = text if isinstance(text, list) else [text]
            # chat and drafter records: their turns, prompt and answer are the text
            texts += [json.dumps(rec[k], sort_keys=True) for k in CHAT_FIELDS if k in rec]
            out.add(key + "|" + "|".join(sorted(" ".join(str(t).lower().split()) for t in texts)))
            total += 1
    return out, total


def train_duplicates(cfg: Config) -> list[Finding]:
    """Training records that repeat another (same image bytes and text): each is seen that many
    times per epoch, and an epoch-based schedule counts them twice (a file concatenated with
    itself trained silently)."""
    if not cfg.data.train:
        return []
    prints, total = _fingerprinted(cfg.data.train, 50_000)
    repeats = total - len(prints)
    if total == 0 or repeats / total < DUPLICATE_WARN:
        return []
    return [Finding(
        "warn", "train_duplicates", 0,
        f"{repeats} of the first {total} data.train records ({repeats / total:.0%}) repeat "
        "another record (same image bytes and text): they train that many times per epoch",
        "deduplicate data.train (vltrain data curate), or repeat records on purpose only",
        {"repeats": repeats, "records": total},
    )]  # fmt: skip


def eval_overlap(cfg: Config) -> list[Finding]:
    """Evaluation records whose image and text also occur in the training records."""
    if not cfg.data.eval or not cfg.data.train:
        return []
    train = record_fingerprints(cfg.data.train)
    found = []
    for split in ("eval", "test"):
        path = getattr(cfg.data, split)
        held = record_fingerprints(path) if path else frozenset()
        shared = held & train
        if shared:
            frac = len(shared) / len(held)
            found.append(Finding(
                "error" if frac > 0.5 else "warn", "eval_overlap", 0,
                f"{len(shared)} of {len(held)} data.{split} records ({frac:.0%}) also occur in "
                "data.train (same image bytes and text): the eval measures memorisation",
                f"deduplicate data.{split} against data.train (vltrain data curate)",
                {"split": split, "shared": len(shared), "total": len(held)},
            ))  # fmt: skip
    return found


def batch_norm_split(cfg: Config, module: nn.Module, world: int) -> list[Finding]:
    """Training BatchNorm layers whose batch is split: each of `world` > 1 processes (or each
    GradCache chunk) normalises its own part of the global batch, so the run trains another
    function than one process on the whole batch (the 'same global batch, any world size'
    equality does not hold: the quickstart tower's loss differed at step 1 on 2 processes)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    was = module.training
    module.train()  # as the loop trains it (a frozen part's batch norms may stay in eval mode)
    norms = [n for n, m in module.named_modules() if isinstance(m, _BatchNorm) and m.training]
    module.train(was)
    chunk = cfg.objective.grad_cache_chunk if cfg.stage == "contrastive" else 0
    split = [f"{world} processes"] if world > 1 else []
    split += [f"GradCache chunks of {chunk}"] if 0 < chunk < cfg.data.batch_size else []
    if not norms or not split:
        return []
    return [Finding(
        "warn", "batch_norm_split", 0,
        f"{len(norms)} BatchNorm layer(s) ({norms[0]}, ...) normalise each part of the batch "
        f"({' and '.join(split)}) with its own statistics: this trains another function than "
        "one process on the whole batch, and results change with the world size",
        "set model.vision_options.stem_norm=group (the built-in towers), or keep the world "
        "size and chunking fixed",
        {"layers": len(norms), "world_size": world, "grad_cache_chunk": chunk},
    )]  # fmt: skip
