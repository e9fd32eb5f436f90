"""Distributed, resumable batch samplers (see docs/internals.md, "Samplers").

Every training sampler here iterates forever (epoch 0, 1, 2, ...) and yields, per step, this
rank's share of one *global* batch as a list of `SampleKey = (epoch, batch_in_epoch, index)`.
The global batches depend only on (seed, epoch) -- never on rank or world size -- so a 2-rank
run with batch_size=4 sees exactly the batches of a 1-rank run with batch_size=8. Resume is
`start=sampler.position_after(last_consumed_key)`: no replay, no `set_epoch` to forget.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from vltrain.data.rng import sample_seed

SampleKey = tuple[int, int, int]
"""(epoch, batch_in_epoch, index): what a sampler yields and a dataset receives."""

TAIL_BUCKET = -1
"""Bucket id of the mixed-length tail batches built from bucket leftovers."""

Lengths = Sequence[int] | torch.Tensor
"""One token length per sample."""


def shard_range(n: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s contiguous shard of range(n); shard sizes differ by at most one."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}"
        )
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (1 if rank < extra else 0))


def _check_common(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}; "
            "check the RANK / WORLD_SIZE environment set by torchrun"
        )


def _too_few_samples(n: int, batch_size: int, world_size: int) -> ValueError:
    from vltrain.data.readers import DataError  # a user mistake: the CLI prints it plainly

    g = batch_size * world_size
    return DataError(
        f"the dataset has {n} samples but the global batch is {g} = data.batch_size "
        f"({batch_size}) x world size ({world_size}), so not one full batch fits; "
        "lower data.batch_size (or use more data)"
    )


class _ForeverSampler:
    """Shared epoch/position logic: subclasses provide `batches_per_epoch` and `global_batch`."""

    batch_size: int
    rank: int
    world_size: int

    def _init_start(self, start: tuple[int, int]) -> None:
        epoch, batch = start
        if epoch < 0 or not 0 <= batch < self.batches_per_epoch:
            raise ValueError(
                f"start=(epoch, batch_in_epoch)={tuple(start)} is out of range: epoch must be "
                f">= 0 and batch_in_epoch in [0, {self.batches_per_epoch}); pass "
                "sampler.position_after(last_consumed_key) from a run with the same data, "
                "batch size and world size"
            )
        self.start = (int(epoch), int(batch))

    def set_position(self, position: tuple[int, int]) -> None:
        """Start the next iteration at (epoch, batch_in_epoch) (a resumed loader's state)."""
        self._init_start(position)

    @property
    def batches_per_epoch(self) -> int:  # pragma: no cover - overridden
        raise NotImplementedError

    def global_batch(self, epoch: int, batch: int) -> list[int]:  # pragma: no cover
        raise NotImplementedError

    def rank_batch(self, epoch: int, batch: int) -> list[SampleKey]:
        """This rank's keys of global batch `batch` of `epoch` (split as evenly as possible)."""
        items = self.global_batch(epoch, batch)
        mine = shard_range(len(items), self.rank, self.world_size)
        return [(epoch, batch, i) for i in items[mine.start : mine.stop]]

    def __iter__(self) -> Iterator[list[SampleKey]]:
        epoch, batch = self.start
        while True:
            for j in range(batch, self.batches_per_epoch):
                yield self.rank_batch(epoch, j)
            epoch, batch = epoch + 1, 0

    def position_after(self, key: SampleKey) -> tuple[int, int]:
        """(epoch, batch_in_epoch) of the batch after the one holding `key`; wraps epochs."""
        if len(key) != 3:
            raise ValueError(f"expected a SampleKey (epoch, batch_in_epoch, index), got {key!r}")
        epoch, batch, _ = (int(v) for v in key)
        if epoch < 0 or not 0 <= batch < self.batches_per_epoch:
            raise ValueError(
                f"key {tuple(key)} does not belong to this sampler: batch_in_epoch must be in "
                f"[0, {self.batches_per_epoch}); was the data, batch size or world size changed "
                "since the checkpoint?"
            )
        if batch + 1 < self.batches_per_epoch:
            return epoch, batch + 1
        return epoch + 1, 0


class ShardedBatchSampler(_ForeverSampler):
    """Forever-iterating sampler over a per-epoch permutation of range(n).

    Global batch j of epoch e is `perm_e[j*G:(j+1)*G]`, G = batch_size * world_size, and rank r
    takes items [r*B, (r+1)*B). With drop_last=False the epoch has ceil(n / G) batches and the
    short last global batch is split across ranks as evenly as possible, so ranks may get
    unequal sizes there (a rank may even get an empty list when fewer than world_size items are
    left); the engine and losses must accept that.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        start: tuple[int, int] = (0, 0),
    ) -> None:
        _check_common(batch_size, rank, world_size)
        if n < 1:
            raise ValueError(f"the dataset is empty (n={n}); check data.train")
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.global_batch_size = batch_size * world_size
        if drop_last and n < self.global_batch_size:
            raise _too_few_samples(n, batch_size, world_size)
        self._cache: tuple[int, torch.Tensor] | None = None
        self._init_start(start)

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch: n // G with drop_last, else ceil(n / G)."""
        g = self.global_batch_size
        return self.n // g if self.drop_last else -(-self.n // g)

    def permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's order of range(n); depends on (seed, epoch) only. Cached per epoch."""
        if self._cache is None or self._cache[0] != epoch:
            if self.shuffle:
                gen = torch.Generator()
                gen.manual_seed(sample_seed(self.seed, epoch, -1, "perm"))
                perm = torch.randperm(self.n, generator=gen)
            else:
                perm = torch.arange(self.n)
            self._cache = (epoch, perm)
        return self._cache[1]

    def global_batch(self, epoch: int, batch: int) -> list[int]:
        """Sample indices of global batch `batch` of `epoch` (all ranks together)."""
        g = self.global_batch_size
        return self.permutation(epoch)[batch * g : (batch + 1) * g].tolist()


class EvalShardSampler:
    """Finite evaluation sampler: this rank's contiguous shard of range(n), in order.

    Yields batches of keys `(0, batch_idx, index)`. Shards differ by at most one sample, so
    ranks may run a different number of batches (by at most one): gather results once at the
    end, never per batch.
    """

    def __init__(self, n: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        _check_common(batch_size, rank, world_size)
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.shard = shard_range(n, rank, world_size)

    def __len__(self) -> int:
        return -(-len(self.shard) // self.batch_size)

    def __iter__(self) -> Iterator[list[SampleKey]]:
        b = self.batch_size
        for j in range(len(self)):
            yield [(0, j, i) for i in self.shard[j * b : (j + 1) * b]]


def _run_limit_ok(counts: dict[int, int], remaining: int, last: int, run: int, limit: int) -> bool:
    """Can `counts` (remaining batches per bucket) still be ordered with runs <= limit?

    Bucket x can fill at most one run per other batch plus one, and a run continuing `last`
    has only `limit - run` slots left: c_x <= limit * (remaining - c_x) + free_first_run.
    """
    for b, c in counts.items():
        first = limit - run if b == last else limit
        if c > limit * (remaining - c) + first:
            return False
    return True


def limit_runs(groups: Sequence[int], max_run: int) -> tuple[list[int], int]:
    """Reorder `groups` so no group appears more than `max_run` times in a row.

    Returns (order, limit): `order` is a permutation of positions, staying as close to the
    input order as possible (at each step the earliest remaining item whose group keeps the
    rest arrangeable). If one group dominates so that `max_run` is impossible, the limit is
    raised to the smallest achievable one, ceil(c_max / (N - c_max + 1)), and returned.
    Cost: O(N * n_groups^2) in the worst case; n_groups is the bucket count (small).
    """
    n = len(groups)
    queues: dict[int, deque[int]] = {}
    for i, gid in enumerate(groups):
        queues.setdefault(gid, deque()).append(i)
    counts = {gid: len(q) for gid, q in queues.items()}
    if n == 0:
        return [], max_run
    c_max = max(counts.values())
    limit = max(max_run, -(-c_max // (n - c_max + 1)))
    heap = [(q[0], gid) for gid, q in queues.items()]
    heapq.heapify(heap)
    order: list[int] = []
    last: int | None = None
    run = 0
    while heap:
        skipped, chosen = [], None
        while heap:
            head, gid = heapq.heappop(heap)
            new_run = run + 1 if gid == last else 1
            counts[gid] -= 1
            rest = n - len(order) - 1
            ok = new_run <= limit and _run_limit_ok(counts, rest, gid, new_run, limit)
            counts[gid] += 1
            if ok:
                chosen = (head, gid)
                break
            skipped.append((head, gid))
        if chosen is None:  # cannot happen if the feasibility test is exact; stay in order
            chosen = skipped.pop(0)
        for item in skipped:
            heapq.heappush(heap, item)
        gid = chosen[1]
        order.append(queues[gid].popleft())
        counts[gid] -= 1
        run, last = (run + 1 if gid == last else 1), gid
        if queues[gid]:
            heapq.heappush(heap, (queues[gid][0], gid))
    return order, limit


class LengthBucketBatchSampler(_ForeverSampler):
    """Forever-iterating sampler whose global batches each hold samples of one length bucket.

    Buckets are length ranges cut at the quantiles of `lengths`, fixed for the run. One length
    never spans two buckets: a length that fills several quantiles gets a bucket of its own
    (which can then dominate), empty buckets are dropped, and a bucket smaller than a global
    batch joins its neighbour (`_merge_small`), so `n_buckets` may come out smaller than asked.
    Each epoch, seeded by (seed, epoch) only:

    1. each bucket is shuffled and cut into full global batches of G = batch_size * world_size;
    2. the leftovers of all buckets are sorted by length and cut into mixed-length *tail*
       batches (bucket id `TAIL_BUCKET`). When n % G == 0 every sample appears exactly once
       per epoch; otherwise n % G leftovers (< G) are dropped, chosen at random each epoch so
       no sample is excluded for good. Every epoch has exactly n // G batches;
    3. batches are interleaved in proportion to bucket size: bucket b's i-th of m_b batches
       sits at (i + u_b) / m_b, u_b ~ U[0, 1) per epoch, so all buckets run out together and
       any prefix of the epoch holds about the same fraction of every bucket;
    4. a repair pass (`limit_runs`) moves batches so that no bucket runs more than
       `max_same_bucket_run` times in a row. If one bucket dominates (more than
       max_same_bucket_run batches per batch of all others), that is impossible; the runs are
       then kept as short as possible: ceil(m_max / (N - m_max + 1)) (`run_limit(epoch)`).

    Each global batch is split across ranks like `ShardedBatchSampler` (rank r takes
    items [r*B, (r+1)*B)).

    `lengths` is one length per sample, or a function epoch -> lengths when a sample's length
    depends on the epoch (a caption drawn per (seed, epoch, index) from several): buckets are
    then cut each epoch from the lengths of what that epoch will actually train on. The
    attributes `lengths`, `bucket_of`, `bucket_bounds` and `bucket_sizes` describe epoch 0;
    `bucketing(epoch)` gives any epoch's.
    """

    def __init__(
        self,
        lengths: Lengths | Callable[[int], Lengths],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        n_buckets: int = 8,
        max_same_bucket_run: int = 3,
        start: tuple[int, int] = (0, 0),
    ) -> None:
        _check_common(batch_size, rank, world_size)
        if n_buckets < 1 or max_same_bucket_run < 1:
            raise ValueError(
                f"n_buckets and max_same_bucket_run must be >= 1, got n_buckets={n_buckets}, "
                f"max_same_bucket_run={max_same_bucket_run}"
            )
        self._lengths_of = lengths if callable(lengths) else None
        self.global_batch_size = batch_size * world_size
        first = _as_lengths(lengths(0) if callable(lengths) else lengths)
        fixed = _bucketing(first, n_buckets, self.global_batch_size)
        self.n = fixed.lengths.numel()
        self.n_buckets_asked = n_buckets
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.seed, self.max_same_bucket_run = seed, max_same_bucket_run
        if self.n < self.global_batch_size:
            raise _too_few_samples(self.n, batch_size, world_size)
        self._epoch0 = fixed
        self.lengths, self.bucket_of = fixed.lengths, fixed.bucket_of
        self.bucket_bounds, self.bucket_sizes = fixed.bounds, fixed.sizes
        # built epochs, the newest two: the loader asks which bucket a batch came from while
        # the DataLoader already prefetches the next epoch's batches
        self._cache: dict[int, tuple[list[int], torch.Tensor, int]] = {}
        self._init_start(start)

    def bucketing(self, epoch: int) -> Bucketing:
        """The lengths and buckets of `epoch` (the same every epoch for fixed lengths)."""
        if self._lengths_of is None or epoch == 0:
            return self._epoch0
        lens = _as_lengths(self._lengths_of(epoch))
        if lens.numel() != self.n:
            raise ValueError(
                f"the lengths function returned {lens.numel()} lengths for epoch {epoch}, "
                f"expected one per sample ({self.n})"
            )
        return _bucketing(lens, self.n_buckets_asked, self.global_batch_size)

    @property
    def n_buckets(self) -> int:
        """Number of non-empty buckets actually used (may be < the requested n_buckets)."""
        return len(self.bucket_sizes)

    @property
    def batches_per_epoch(self) -> int:
        """Global batches per epoch: n // G (bucket batches plus mixed tail batches)."""
        return self.n // self.global_batch_size

    def _epoch(self, epoch: int) -> tuple[list[int], torch.Tensor, int]:
        """(bucket id per batch, (N, G) index tensor, run limit) for `epoch`; cached."""
        if epoch not in self._cache:
            built = self._build_epoch(epoch)
            self._cache = {e: v for e, v in self._cache.items() if e == max(self._cache)}
            self._cache[epoch] = built
        return self._cache[epoch]

    def _build_epoch(self, epoch: int) -> tuple[list[int], torch.Tensor, int]:
        g = self.global_batch_size
        buckets = self.bucketing(epoch)
        gen = torch.Generator()
        gen.manual_seed(sample_seed(self.seed, epoch, -1, "length_buckets"))
        rows, leftovers, group_ids, positions = [], [], [], []
        for members in buckets.members:
            shuffled = members[torch.randperm(len(members), generator=gen)]
            m = len(shuffled) // g
            rows.append(shuffled[: m * g].view(m, g))
            leftovers.append(shuffled[m * g :])
        left = torch.cat(leftovers)
        drop = self.n % g
        if drop:  # random choice of which leftovers sit this epoch out
            left = left[torch.randperm(len(left), generator=gen)[drop:]]
        left = left[torch.argsort(buckets.lengths[left], stable=True)]
        rows.append(left.view(-1, g))
        offsets = torch.rand(len(rows), generator=gen, dtype=torch.float64)
        for b, r in enumerate(rows):
            m = r.shape[0]
            positions.append((torch.arange(m, dtype=torch.float64) + offsets[b]) / max(m, 1))
            group_ids.append(torch.full((m,), b if b < len(buckets.members) else TAIL_BUCKET))
        natural = torch.argsort(torch.cat(positions), stable=True)
        all_rows, all_groups = torch.cat(rows)[natural], torch.cat(group_ids)[natural]
        groups = all_groups.tolist()
        if _max_run(all_groups) > self.max_same_bucket_run:
            order, limit = limit_runs(groups, self.max_same_bucket_run)
            all_rows, groups = all_rows[torch.tensor(order)], [groups[i] for i in order]
        else:
            limit = self.max_same_bucket_run
        return groups, all_rows, limit

    def epoch_schedule(self, epoch: int) -> list[tuple[int, list[int]]]:
        """[(bucket id, global batch indices)] for every batch of `epoch`, in order.

        The bucket id is `TAIL_BUCKET` (-1) for the mixed-length tail batches.
        """
        groups, rows, _ = self._epoch(epoch)
        return list(zip(groups, rows.tolist(), strict=True))

    def bucket_of_batch(self, epoch: int, batch: int) -> int:
        """The bucket global batch `batch` of `epoch` was drawn from (`TAIL_BUCKET`: mixed)."""
        return self._epoch(epoch)[0][batch]

    def run_limit(self, epoch: int) -> int:
        """Longest same-bucket run allowed in `epoch`: max_same_bucket_run unless infeasible."""
        return self._epoch(epoch)[2]

    def global_batch(self, epoch: int, batch: int) -> list[int]:
        """Sample indices of global batch `batch` of `epoch` (all ranks together)."""
        return self._epoch(epoch)[1][batch].tolist()


class Bucketing(NamedTuple):
    """One epoch's lengths (n,), bucket id per sample (n,), each bucket's min length, sizes and
    member indices (sorted by bucket)."""

    lengths: torch.Tensor
    bucket_of: torch.Tensor
    bounds: list[int]
    sizes: list[int]
    members: list[torch.Tensor]


def _as_lengths(lengths: Lengths) -> torch.Tensor:
    lens = torch.as_tensor(lengths, dtype=torch.int64)
    if lens.dim() != 1 or lens.numel() == 0:
        raise ValueError(
            f"lengths must be a non-empty 1-D sequence of ints (one per sample), "
            f"got shape {tuple(lens.shape)}"
        )
    return lens


def _bucketing(lengths: torch.Tensor, n_buckets: int, min_size: int = 1) -> Bucketing:
    bucket_of, bounds = _merge_small(*_quantile_buckets(lengths, n_buckets), min_size)
    order = torch.argsort(bucket_of, stable=True)
    sizes = torch.bincount(bucket_of, minlength=len(bounds)).tolist()
    return Bucketing(lengths, bucket_of, bounds, sizes, list(torch.split(order, sizes)))


def _quantile_buckets(lengths: torch.Tensor, n_buckets: int) -> tuple[torch.Tensor, list[int]]:
    """Bucket id per sample (0..K-1, K <= n_buckets non-empty) and each bucket's min length.

    Cuts at the k/n_buckets quantiles (k = 1..n_buckets-1); a length always maps to one bucket.
    A length that fills several quantiles (a very common length) gets a bucket of its own,
    cut at v and v + 1, so the lengths above it are not lumped in with it.
    """
    ordered = torch.sort(lengths).values
    n = len(ordered)
    quantiles = ordered[[k * n // n_buckets for k in range(1, n_buckets)]]
    values, repeats = torch.unique(quantiles, return_counts=True)
    cuts = torch.unique(torch.cat([values, values[repeats > 1] + 1]))
    raw = torch.searchsorted(cuts, lengths, right=True)
    used, bucket_of = torch.unique(raw, return_inverse=True)
    bounds = [int(ordered[0])] + cuts.tolist()
    return bucket_of, [bounds[i] for i in used.tolist()]


def _merge_small(
    bucket_of: torch.Tensor, bounds: list[int], min_size: int
) -> tuple[torch.Tensor, list[int]]:
    """Neighbouring buckets merged, shortest first, until each holds `min_size` samples (the
    last, if short, joins the one before it). A bucket smaller than a global batch never fills
    a batch of its own: every epoch all of it would go to the length-sorted tail batches, which
    for a small dataset would be the same batches in the same order epoch after epoch."""
    sizes = torch.bincount(bucket_of, minlength=len(bounds)).tolist()
    group, new_of, acc = [], [], 0
    for b, size in enumerate(sizes):
        if not group or acc >= min_size:
            group.append(b)
            acc = 0
        new_of.append(len(group) - 1)
        acc += size
    if len(group) > 1 and acc < min_size:  # the last group is short: into the one before
        new_of = [min(g, len(group) - 2) for g in new_of]
        group.pop()
    return torch.tensor(new_of, dtype=torch.int64)[bucket_of], [bounds[b] for b in group]


def _max_run(groups: torch.Tensor) -> int:
    """Length of the longest run of equal consecutive values (0 for an empty tensor)."""
    if groups.numel() == 0:
        return 0
    _, runs = torch.unique_consecutive(groups, return_counts=True)
    return int(runs.max())


def max_run_length(groups: Sequence[int]) -> int:
    """Longest run of equal consecutive values in `groups` (for diagnostics and tests)."""
    return _max_run(torch.as_tensor(list(groups), dtype=torch.int64))
