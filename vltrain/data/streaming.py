"""Stream webdataset shards with exact resume (a :class:`~vltrain.data.loaders.Loader`).

The sample order is defined by ``S`` *virtual streams* (``data.streams``), never by the world
size or the worker count (see docs/streaming.md):

- Epoch ``e`` reads the shards in a permutation drawn from ``(seed, e)``; of that sequence's
  ``N`` samples, stream ``s`` reads a contiguous range as long as the positions it fills in
  the global batches of the epoch's ``N`` flat positions (`stream_ranges`), so every sample is
  read once per epoch and the ``k``-th ``N`` samples of the run are exactly epoch ``k``.
- A stream keeps a shuffle buffer of ``buffer`` raw samples: it fills the buffer, then emits
  the entry at ``rng(seed, s, n) % len(buffer)`` (``n`` = samples it emitted so far) and puts
  the last entry in its place. So every draw is a pure function of the stream's state. The
  buffer refills only from the current epoch's range and drains before the next epoch starts
  (the epoch fence): no sample comes twice before every sample came once.
- Position ``p`` of each global batch of ``G`` samples comes from stream ``p * S // G``.
  Rank ``r`` of ``W`` owns streams ``[r * S / W, (r + 1) * S / W)``, which are exactly the
  streams of its slice ``[r * G / W, (r + 1) * G / W)``; DataLoader workers split a rank's
  streams, and the main process puts each batch back together in stream order.

Hence the global batch sequence is the same for every world size dividing ``S`` and every
worker count, and a checkpoint taken with 2 ranks resumes on 1. The state is, per stream,
``(epoch, shard cursor, byte offset in the shard, samples emitted, buffer as sample keys)``;
resume seeks to the offset and re-reads only the buffered samples, one seek each.
"""

from __future__ import annotations

import tarfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vltrain.data.loaders import Batch, BatchCollate, start_workers, worker_init
from vltrain.data.readers import DataError
from vltrain.data.rng import sample_seed
from vltrain.data.shards import RawSample, iter_samples, open_shard, read_sample_at, shard_counts

Gather = Callable[[Any], list[Any]]  # every rank's object, in rank order (all_gather_object)
STATE_VERSION = 1


def shard_order(n_shards: int, seed: int, epoch: int) -> list[int]:
    """The order in which epoch `epoch` reads the shards (a permutation from (seed, epoch))."""
    g = torch.Generator().manual_seed(sample_seed(seed, epoch, 0, salt="shards"))
    return torch.randperm(n_shards, generator=g).tolist()


def stream_quota(streams: int, global_batch: int) -> list[int]:
    """Samples each stream contributes to every global batch (position p -> p * S // G)."""
    quota = [0] * streams
    for p in range(global_batch):
        quota[p * streams // global_batch] += 1
    return quota


def stream_ranges(total: int, quota: list[int], epoch: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each stream in epoch `epoch`'s sample sequence of `total` samples.

    Stream ``s`` reads as many samples as it fills positions of the global batches whose
    flat positions (batch after batch, ``G = sum(quota)`` each) fall in
    ``[epoch * total, (epoch + 1) * total)``. With every stream stopping at its range's end
    until its buffer is empty (the epoch fence), the first ``total`` samples the run sees are
    exactly one epoch, the next ``total`` the next one, whatever ``total``, the buffer and
    the batch.
    """
    g = sum(quota)
    starts = [sum(quota[:s]) for s in range(len(quota))]

    def filled(s: int, flat: int) -> int:  # stream s's positions among flat positions < flat
        return flat // g * quota[s] + min(max(flat % g - starts[s], 0), quota[s])

    lengths = [filled(s, (epoch + 1) * total) - filled(s, epoch * total) for s in range(len(quota))]
    bounds = [sum(lengths[:s]) for s in range(len(quota) + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass
class Entry:
    """A raw sample in flight: which epoch read it, from where; `sample` None = bad shard."""

    epoch: int
    shard: int
    offset: int
    key: str
    sample: RawSample | None = None

    def as_key(self) -> list[Any]:
        return [self.epoch, self.shard, self.offset, self.key]


class ShardStream:
    """One virtual stream: its range of each epoch, a read cursor and a shuffle buffer.

    Epoch ``e`` orders the shards by ``perm_e``; of that sequence's ``N`` samples, stream
    ``s`` reads the contiguous range `stream_ranges` gives it (``quota``: the samples each
    stream gives every global batch; default one each), and reads nothing of epoch ``e + 1``
    until its buffer has emitted all of epoch ``e`` (the epoch fence). So every sample is read
    exactly once per epoch and the run's ``k``-th ``N`` samples are exactly epoch ``k``.
    An unreadable rest of a shard yields one bad entry (``sample`` None) per sample it held.
    """

    def __init__(
        self,
        shards: list[str],
        counts: list[int],
        streams: int,
        stream: int,
        seed: int,
        buffer: int,
        state: dict[str, Any] | None = None,
        quota: list[int] | None = None,
    ) -> None:
        self.shards, self.counts, self.streams, self.stream = shards, counts, streams, stream
        self.seed, self.buffer_size = seed, buffer
        self.quota = quota or [1] * streams
        self._broken: str | None = None  # why the rest of the current shard is unreadable
        self.emitted = 0
        self.buffer: list[Entry] = []
        self._keys: list[list[Any]] = []  # buffer entries' keys, kept in step with `buffer`
        self._file: IO[bytes] | None = None
        self._reader: Iterator[RawSample] | None = None
        if state is None:
            self._start_epoch(0)
        else:
            self.load_state_dict(state)

    # ---- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,  # position in this epoch's shard order
            "sample": self.sample,  # sample index inside that shard
            "offset": self.offset,  # its byte offset
            "remaining": self.remaining,  # samples of this epoch's range still to read
            "emitted": self.emitted,
            "buffer": list(self._keys),  # sample keys, in buffer order
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek-based restore: the cursor is set, the buffered samples are re-read by offset."""
        self.close()
        self._broken = None
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.sample, self.offset = int(state["sample"]), int(state["offset"])
        self.remaining, self.emitted = int(state["remaining"]), int(state["emitted"])
        self._order = shard_order(len(self.shards), self.seed, self.epoch)
        entries = [Entry(int(e), int(s), int(o), str(k)) for e, s, o, k in state["buffer"]]
        by_shard: dict[int, list[Entry]] = {}
        for entry in entries:
            if entry.offset >= 0:
                by_shard.setdefault(entry.shard, []).append(entry)
        for shard, group in by_shard.items():
            with open_shard(self.shards[shard]) as f:
                for entry in sorted(group, key=lambda e: e.offset):
                    entry.sample = read_sample_at(f, entry.offset)
                    if entry.sample.key != entry.key:
                        raise DataError(
                            f"{self.shards[shard]} changed since the checkpoint: byte "
                            f"{entry.offset} holds sample {entry.sample.key!r}, the checkpoint's "
                            f"shuffle buffer expected {entry.key!r}; resume with the same shards"
                        )
        self.buffer = entries
        self._keys = [e.as_key() for e in entries]

    # ---- reading -------------------------------------------------------------------------

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._reader = None

    def _start_epoch(self, epoch: int) -> None:
        """Point the cursor at the first sample of this stream's range of `epoch`."""
        self.close()
        self._broken = None
        self.epoch = epoch
        self._order = shard_order(len(self.shards), self.seed, epoch)
        lo, hi = stream_ranges(sum(self.counts), self.quota, epoch)[self.stream]
        self.remaining = hi - lo
        self.cursor, self.sample = 0, lo if hi > lo else 0
        while self.sample >= self.counts[self._order[self.cursor]]:
            self.sample -= self.counts[self._order[self.cursor]]
            self.cursor += 1
        self.offset = 0
        if self.sample:  # one header-only scan of one shard (member data skipped by seeks)
            with open_shard(self.shards[self._order[self.cursor]]) as f:
                for i, raw in enumerate(iter_samples(f, 0, want=())):
                    if i == self.sample:
                        self.offset = raw.offset
                        break

    def _next_shard(self) -> None:
        self.close()
        self._broken = None
        self.cursor, self.sample, self.offset = self.cursor + 1, 0, 0
        if self.cursor >= len(self._order):
            raise DataError(
                f"the shards hold fewer samples than counted ({sum(self.counts)}); were they "
                "rewritten during the run? Rebuild the shard index (see docs/streaming.md)"
            )

    def _read(self) -> Entry:
        """The next raw sample of this stream's range (call it while ``remaining > 0``).

        A shard that fails mid-way (a damaged header, truncated data, a read error) or ends
        before its counted samples gives one bad entry per sample it still held, so the
        stream's range, and so its epoch, keeps its length; a resume at any of those entries
        fails the same way at the same byte and goes on counting.
        """
        while True:
            shard = self._order[self.cursor]
            if self.sample >= self.counts[shard]:  # samples past the count are never read
                self._next_shard()
                continue
            if self._broken is None and self._reader is None:
                try:
                    self._file = open_shard(self.shards[shard])
                    self._reader = iter_samples(self._file, self.offset)
                except OSError as e:
                    self._broken = str(e) or type(e).__name__
            raw = None
            if self._broken is None:
                try:
                    raw = next(self._reader, None) if self._reader is not None else None
                except (tarfile.ReadError, OSError) as e:  # the rest of this shard is unreadable
                    self._broken = str(e) or type(e).__name__
                if raw is None and self._broken is None:
                    self._broken = f"ends before its {self.counts[shard]} counted samples"
            if self._broken is not None:
                self.close()
                self.sample, self.remaining = self.sample + 1, self.remaining - 1
                why = f"{self.shards[shard]}: {self._broken}; the samples after it are lost"
                return Entry(self.epoch, shard, -1, why)
            assert raw is not None
            self.sample, self.offset, self.remaining = self.sample + 1, raw.end, self.remaining - 1
            return Entry(self.epoch, shard, raw.offset, raw.key, raw)

    def next(self) -> Entry:
        """The next sample this stream emits (through the shuffle buffer).

        The epoch fence: the buffer refills only from the current epoch's range; once that is
        read, the buffer drains, and only an empty buffer starts the next epoch."""
        while not self.buffer and self.remaining == 0:
            self._start_epoch(self.epoch + 1)
        while len(self.buffer) < self.buffer_size and self.remaining:
            entry = self._read()
            self.buffer.append(entry)
            self._keys.append(entry.as_key())
        if not self.buffer:  # no shuffle buffer (or a smaller one drained on resume)
            entry = self._read()
        else:  # swap-remove entry i
            i = sample_seed(self.seed, self.stream, self.emitted, salt="buffer") % len(self.buffer)
            entry, self.buffer[i], self._keys[i] = self.buffer[i], self.buffer[-1], self._keys[-1]
            self.buffer.pop()
            self._keys.pop()
        self.emitted += 1
        return entry


class _StreamSet(IterableDataset):
    """The streams of one rank; in a DataLoader worker, that worker's subset of them."""

    def __init__(
        self,
        shards: list[str],
        counts: list[int],
        streams: int,
        owned: list[int],
        quota: list[int],
        seed: int,
        buffer: int,
        decode: Callable[[Entry, str], dict[str, Any]],
        state: dict[int, dict[str, Any]],
        n_workers: int,
    ) -> None:
        self.shards, self.counts, self.streams = shards, counts, streams
        self.owned, self.quota = owned, quota
        self.seed, self.buffer, self.decode = seed, buffer, decode
        self.state, self.n_workers = state, n_workers

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        mine = self.owned[worker :: self.n_workers]
        streams = {
            s: ShardStream(
                self.shards,
                self.counts,
                self.streams,
                s,
                self.seed,
                self.buffer,
                self.state.get(s),
                quota=self.quota,
            )
            for s in mine
        }
        try:
            while True:  # one item = this worker's part of the rank's next batch
                samples = {s: self._decode(st, self.quota[s]) for s, st in streams.items()}
                state = {s: st.state_dict() for s, st in streams.items()}
                yield {"samples": samples, "state": state, **pack_images(samples)}
        finally:
            for stream in streams.values():
                stream.close()

    def _decode(self, stream: ShardStream, n: int) -> list[dict[str, Any]]:
        entries = [stream.next() for _ in range(n)]
        return [self.decode(e, self.shards[e.shard]) for e in entries]


def pack_images(samples: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Move equal-shape image tensors into one stacked tensor: a worker then hands the main
    process one shared-memory block per batch part instead of one per image."""
    where = [
        (s, i)
        for s in samples
        for i, x in enumerate(samples[s])
        if isinstance(x.get("image"), Tensor)
    ]
    if not where or len({tuple(samples[s][i]["image"].shape) for s, i in where}) != 1:
        return {}
    images = torch.stack([samples[s][i].pop("image") for s, i in where])  # (n, 3, S, S)
    return {"packed_images": images, "packed_where": where}


def unpack_images(part: dict[str, Any]) -> None:
    """Undo `pack_images` (views into the stacked tensor, no copy)."""
    images = part.pop("packed_images", None)
    if images is None:
        return
    for (s, i), image in zip(part.pop("packed_where"), images.unbind(0), strict=True):
        part["samples"][s][i]["image"] = image


def _items(x: Any) -> Any:
    return x


class StreamLoader:
    """This rank's micro-batches from tar shards; resumable at every batch (see module doc).

    `decode(entry, shard)` turns a raw sample into a sample dict (or a ``{"bad": reason}`` marker)
    inside the worker; `collate` is the stage's collate over the good samples. `gather` is
    ``all_gather_object`` on a distributed run: `state_dict` collects every rank's streams so
    that the checkpoint rank 0 writes can resume on any world size dividing `streams`.
    """

    def __init__(
        self,
        shards: list[str],
        batch_size: int,
        rank: int,
        world_size: int,
        *,
        streams: int,
        seed: int,
        buffer: int,
        decode: Callable[[Entry, str], dict[str, Any]],
        collate: Callable[[list[dict]], dict[str, Any]],
        num_workers: int = 0,
        gather: Gather | None = None,
        pin_memory: bool = False,
        counts: list[int] | None = None,
    ) -> None:
        self.counts = shard_counts(shards) if counts is None else list(counts)
        check_layout(sum(self.counts), streams, batch_size, world_size)
        self.shards, self.streams, self.seed, self.buffer = shards, streams, seed, buffer
        self.global_batch = batch_size * world_size
        per_rank = streams // world_size
        self.owned = list(range(rank * per_rank, (rank + 1) * per_rank))
        self.quota = stream_quota(streams, self.global_batch)
        self.decode, self.collate = decode, BatchCollate(collate)
        self.num_workers = min(num_workers, per_rank)  # a worker needs at least one stream
        if num_workers > per_rank:
            warnings.warn(
                f"data.num_workers={num_workers} but this rank owns {per_rank} of "
                f"data.streams={streams} streams: using {per_rank} workers; raise data.streams "
                "(a multiple of the world size) for more loader parallelism",
                stacklevel=2,
            )
        self.gather = gather or (lambda obj: [obj])
        self.pin_memory = pin_memory
        self.position: dict[int, dict[str, Any]] = {}  # stream -> state after the last batch

    # ---- state ---------------------------------------------------------------------------

    def local_state(self) -> dict[str, Any]:
        """This rank's streams' states (what `gather` exchanges)."""
        for s in self.owned:  # a stream not read yet: where it will start
            if s not in self.position:
                stream = ShardStream(
                    self.shards, self.counts, self.streams, s, self.seed, 0, quota=self.quota
                )
                self.position[s] = stream.state_dict()
        return {"streams": {s: self.position[s] for s in self.owned}}

    def state_dict(self) -> dict[str, Any]:
        """Every stream's state (a collective when distributed: call it on every rank)."""
        return merge_states(
            self.gather(self.local_state()),
            streams=self.streams,
            seed=self.seed,
            shards=[Path(s).name for s in self.shards],
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problems = []
        if int(state.get("version", -1)) != STATE_VERSION:
            problems.append(f"state version {state.get('version')} != {STATE_VERSION}")
        for key, mine in (("streams", self.streams), ("seed", self.seed)):
            if state.get(key) != mine:
                name = "data.streams" if key == "streams" else "run.seed"
                problems.append(f"{name}={mine} but the checkpoint has {state.get(key)}")
        if list(state.get("shards", [])) != [Path(s).name for s in self.shards]:
            problems.append("the shard list differs from the checkpoint's")
        if problems:
            raise DataError(
                "cannot resume this stream: "
                + "; ".join(problems)
                + ". A resumed stream needs the same shards, data.streams and run.seed."
            )
        self.position = {int(s): st for s, st in enumerate(state["stream_states"])}

    # ---- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        n_workers = max(self.num_workers, 1)
        dataset = _StreamSet(
            self.shards,
            self.counts,
            self.streams,
            self.owned,
            self.quota,
            self.seed,
            self.buffer,
            self.decode,
            {s: self.position[s] for s in self.owned if s in self.position},
            n_workers,
        )
        items: Any = iter(dataset)
        if self.num_workers:
            items = start_workers(
                DataLoader(
                    dataset,
                    batch_size=None,
                    collate_fn=_items,
                    num_workers=self.num_workers,
                    worker_init_fn=worker_init,
                    generator=torch.Generator().manual_seed(self.seed),
                    pin_memory=self.pin_memory,
                    prefetch_factor=4,
                )
            )
        while True:  # the DataLoader returns workers' items round-robin: one round, one batch
            parts = [next(items) for _ in range(n_workers)]
            samples: dict[int, list[dict[str, Any]]] = {}
            for part in parts:
                unpack_images(part)
                samples.update(part["samples"])
                self.position.update(part["state"])
            batch = self.collate([x for s in sorted(samples) for x in samples[s]])
            # this rank's streams; one rank's `merge_states([position])` is the loader state
            batch.position = self.local_state()
            yield batch


def merge_states(
    parts: list[dict[str, Any]], *, streams: int, seed: int, shards: list[str]
) -> dict[str, Any]:
    """One loader state from every rank's `local_state` (weights_only-loadable)."""
    states: list[dict[str, Any] | None] = [None] * streams
    for part in parts:
        for s, st in part["streams"].items():
            states[int(s)] = st
    if any(st is None for st in states):
        raise ValueError(f"rank states cover streams {[i for i, x in enumerate(states) if x]}")
    return {
        "version": STATE_VERSION,
        "streams": streams,
        "seed": seed,
        "shards": shards,
        "stream_states": states,
    }


def check_layout(n_samples: int, streams: int, batch_size: int, world_size: int) -> None:
    """The rules that make the sample order world-size free; errors name the fix."""
    check_stream_layout(streams, batch_size, world_size)
    if n_samples < streams:
        raise DataError(
            f"{n_samples} samples cannot feed data.streams={streams} streams (each stream reads "
            "a 1/data.streams part of every epoch); lower data.streams"
        )


def check_stream_layout(streams: int, batch_size: int, world_size: int) -> None:
    """The config-only part of `check_layout` (run at config load, before any compute)."""
    g = batch_size * world_size
    if streams < 1 or streams % world_size:
        raise DataError(
            f"data.streams={streams} must be a positive multiple of the world size "
            f"({world_size}) so that every rank owns whole streams; e.g. data.streams="
            f"{max(world_size, streams - streams % world_size or world_size)}"
        )
    if streams > g:
        raise DataError(
            f"data.streams={streams} is larger than the global batch ({g} = data.batch_size "
            f"{batch_size} x world size {world_size}); every stream must feed every batch: "
            f"lower data.streams or raise data.batch_size"
        )
