"""Streaming loader: kill/resume at any step equals the uninterrupted stream, for any worker
count, world size and shuffle buffer; 0 duplicates, 0 omissions; resume reads no consumed shard.

Ranks are simulated in-process (one StreamLoader per rank, their states merged as the
all_gather in `StreamLoader.state_dict` would); tests/stages/test_stream_train.py runs real
torchrun and kill -9 training from shards.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.data.stream_fixtures import make_shards
from vltrain.data import shard_decode, streaming
from vltrain.data import shards as shards_mod
from vltrain.data.readers import DataError

N_SAMPLES, GLOBAL_BATCH, STREAMS, STEPS = 300, 8, 4, 72  # 72 steps = 576 samples = 1.9 epochs


@pytest.fixture(scope="module")
def shard_list(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return make_shards(tmp_path_factory.mktemp("wds"), N_SAMPLES, shard_size=32)


def keys_collate(good: list[dict]) -> dict:
    return {"keys": [tuple(s["key"]) for s in good]}


def make_loaders(shard_list, world, workers, buffer, state=None, seed=0):
    loaders = []
    for rank in range(world):
        loader = streaming.StreamLoader(
            shard_list,
            GLOBAL_BATCH // world,
            rank,
            world,
            streams=STREAMS,
            seed=seed,
            buffer=buffer,
            decode=shard_decode.SampleDecoder(8, seed),
            collate=keys_collate,
            num_workers=workers,
        )
        if state is not None:
            loader.load_state_dict(state)
        loaders.append(loader)
    return loaders


def merged_state(loaders) -> dict:
    """What every rank's `state_dict()` returns on a real run (all_gather of local states)."""
    first = loaders[0]
    return streaming.merge_states(
        [lo.local_state() for lo in loaders],
        streams=first.streams,
        seed=first.seed,
        shards=[Path(s).name for s in first.shards],
    )


def run_segment(loaders, steps: int) -> list[list[tuple]]:
    """`steps` global batches (rank slices concatenated in rank order)."""
    iters = [iter(lo) for lo in loaders]
    out = [[k for it in iters for k in next(it).data["keys"]] for _ in range(steps)]
    for it in iters:
        it.close()  # ends the DataLoader workers, as a killed process would
    return out


def run_with_kills(shard_list, world, workers, buffer, kills: list[int]):
    batches, state, done = [], None, 0
    for stop in [*sorted(kills), STEPS]:
        loaders = make_loaders(shard_list, world, workers, buffer, state)
        batches += run_segment(loaders, stop - done)
        state, done = merged_state(loaders), stop
    return batches, state


@pytest.fixture(scope="module")
def reference(shard_list) -> dict[int, tuple[list, dict]]:
    """The uninterrupted 1-rank, in-process stream per buffer size."""
    out = {}
    for buffer in (0, 100, 1000):
        loaders = make_loaders(shard_list, 1, 0, buffer)
        out[buffer] = (run_segment(loaders, STEPS), merged_state(loaders))
    return out


def all_keys(shard_list) -> set[str]:
    return {f"{i:09d}" for i in range(N_SAMPLES)}


def check_exactly_once(batches, state, shard_list) -> None:
    """Every (epoch, sample) at most once; for each epoch every stream has read past, every
    sample is either delivered or still in a shuffle buffer (nothing dropped)."""
    flat = [k for b in batches for k in b]
    assert len(flat) == len(set(flat)), "a sample was delivered twice in one epoch"
    buffered = {(e, k) for st in state["stream_states"] for e, _, _, k in st["buffer"]}
    assert not buffered & set(flat), "a delivered sample is still in a buffer"
    passed = min(st["epoch"] for st in state["stream_states"])
    assert passed >= 1
    for epoch in range(passed):
        seen = {k for e, k in flat if e == epoch} | {k for e, k in buffered if e == epoch}
        assert seen == all_keys(shard_list), f"epoch {epoch}: omitted {all_keys(shard_list) - seen}"


def epoch_boundary_step(batches) -> int:
    """The first step that holds a sample of epoch 1 (a kill there crosses the boundary)."""
    return next(i for i, b in enumerate(batches) if any(e == 1 for e, _ in b))


@pytest.mark.parametrize("buffer", [0, 100, 1000])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_kill_resume_equals_uninterrupted_stream(
    shard_list, reference, workers: int, world: int, buffer: int
) -> None:
    ref_batches, ref_state = reference[buffer]
    rng = random.Random(f"{workers}/{world}/{buffer}")
    boundary = epoch_boundary_step(ref_batches)
    kills = sorted({boundary, *rng.sample(range(1, STEPS), 2)})
    batches, state = run_with_kills(shard_list, world, workers, buffer, kills)
    # the 1-rank in-process stream is the reference: N ranks and K workers equal it exactly
    assert batches == ref_batches
    assert state == ref_state
    check_exactly_once(batches, state, shard_list)


def test_two_ranks_resume_on_one_rank_with_the_same_global_batch(shard_list, reference) -> None:
    ref_batches, _ = reference[100]
    two = make_loaders(shard_list, 2, 1, 100)
    first = run_segment(two, 37)
    one = make_loaders(shard_list, 1, 2, 100, state=merged_state(two))
    assert first + run_segment(one, STEPS - 37) == ref_batches


def test_checker_catches_a_dropped_shuffle_buffer(shard_list, reference) -> None:
    """Negative control: a resume that refills its buffer (what HF datasets documents) loses
    the buffered samples, and the exactly-once check sees it."""
    ref_batches, _ = reference[100]
    loaders = make_loaders(shard_list, 1, 0, 100)
    batches = run_segment(loaders, 20)
    state = merged_state(loaders)
    for st in state["stream_states"]:
        st["buffer"] = []
    loaders = make_loaders(shard_list, 1, 0, 100, state=state)
    batches += run_segment(loaders, STEPS - 20)
    assert batches != ref_batches
    with pytest.raises(AssertionError, match="omitted"):
        check_exactly_once(batches, merged_state(loaders), shard_list)


def test_per_sample_randomness_ignores_world_size_and_workers(shard_list) -> None:
    """Caption and negative picks depend on (seed, epoch, key) only."""

    def picks(world: int, workers: int) -> list:
        def collate(good):
            return {"keys": [(tuple(s["key"]), s["text"], tuple(s["negatives"])) for s in good]}

        loaders = [
            streaming.StreamLoader(
                shard_list,
                8 // world,
                r,
                world,
                streams=4,
                seed=3,
                buffer=10,
                decode=shard_decode.SampleDecoder(8, 3, hard_negatives=1),
                collate=collate,
                num_workers=workers,
            )
            for r in range(world)
        ]
        return run_segment(loaders, 6)

    one = picks(1, 0)
    assert picks(2, 2) == one
    texts = {t for b in one for _, t, _ in b}
    assert any(t.endswith(" a") for t in texts) and any(t.endswith(" b") for t in texts)


def test_resume_reads_no_consumed_shard(shard_list, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resume seeks: it reads the buffered samples and the next batch, never replays."""
    read = {"bytes": 0}
    real_open = shards_mod.open_shard

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            read["bytes"] += len(data)
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(streaming, "open_shard", lambda url: Counting(real_open(url)))
    loaders = make_loaders(shard_list, 1, 0, 10)
    run_segment(loaders, 80)  # late in epoch 1
    state = merged_state(loaders)
    fresh_bytes = read["bytes"]
    read["bytes"] = 0
    run_segment(make_loaders(shard_list, 1, 0, 10, state=state), 1)
    per_sample = max(Path(s).stat().st_size for s in shard_list) / 32 * 1.2
    needed = sum(len(st["buffer"]) for st in state["stream_states"]) + GLOBAL_BATCH + STREAMS
    assert read["bytes"] <= needed * per_sample
    assert needed * per_sample < fresh_bytes / 5  # a replay of the 80 steps costs this


def test_resume_refuses_other_streams_seed_or_shards(shard_list) -> None:
    loaders = make_loaders(shard_list, 1, 0, 10)
    run_segment(loaders, 3)
    state = merged_state(loaders)
    other = streaming.StreamLoader(
        shard_list,
        8,
        0,
        1,
        streams=8,
        seed=0,
        buffer=10,
        decode=shard_decode.SampleDecoder(8, 0),
        collate=keys_collate,
    )
    with pytest.raises(DataError, match="data.streams=8 but the checkpoint has 4"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="shard list differs"):
        make_loaders(shard_list[:-1], 1, 0, 10, state=state)


def test_layout_errors_name_the_fix(shard_list) -> None:
    with pytest.raises(DataError, match="multiple of the world size"):
        streaming.check_layout(N_SAMPLES, 3, 4, 2)
    with pytest.raises(DataError, match="larger than the global batch"):
        streaming.check_layout(N_SAMPLES, 16, 4, 2)
    with pytest.raises(DataError, match="lower data.streams"):
        streaming.check_layout(3, 4, 8, 1)


def test_streams_split_each_epoch_evenly(shard_list) -> None:
    """Every stream reads N/S samples per epoch (within one), so epochs stay aligned."""
    counts = shards_mod.shard_counts(shard_list)
    assert counts == [32] * 9 + [12]
    sizes, union = [], set()
    for s in range(STREAMS):
        st = streaming.ShardStream(shard_list, counts, STREAMS, s, 0, 0)
        n = st.remaining
        keys = {st.next().key for _ in range(n)}
        assert st.epoch == 0 and st.remaining == 0  # the range ends exactly at the epoch's end
        sizes.append(len(keys))
        union |= keys
    assert sizes == [75] * 4 and len(union) == N_SAMPLES


# ---- epochs stay epochs: the run's k-th N samples are exactly epoch k --------------------


def check_epochs(batches, n: int) -> int:
    """Flattened in batch order, samples [k*n, (k+1)*n) are all of epoch k and hold every
    sample once: nothing is seen twice before everything was seen once. Returns the whole
    epochs checked."""
    flat = [k for b in batches for k in b]
    for epoch in range(len(flat) // n):
        chunk = flat[epoch * n : (epoch + 1) * n]
        assert {e for e, _ in chunk} == {epoch}, f"epoch {epoch} mixes in other epochs"
        assert len({k for _, k in chunk}) == n, f"epoch {epoch} repeats a sample"
    return len(flat) // n


@pytest.mark.parametrize("buffer", [0, 100, 1000])
def test_every_epoch_is_each_sample_once_before_any_repeat(reference, buffer: int) -> None:
    """The grid above equals these references for every worker count and world size."""
    batches, _ = reference[buffer]
    assert check_epochs(batches, N_SAMPLES) == 1
    flat = [k for b in batches for k in b]
    with pytest.raises(AssertionError):  # negative control: one sample out of place
        check_epochs([flat[1:]], N_SAMPLES)


# sets smaller than the buffers (512 records, 4 streams x 1000: the streams used to read ~8
# epochs ahead), global batches that are no multiple of data.streams, 1-2 workers and ranks
SMALL = [  # (samples, streams, global batch, buffer, world, workers)
    (512, 4, 16, 1000, 2, 1),
    (60, 4, 10, 1000, 1, 2),
    (37, 2, 6, 7, 2, 1),
    (20, 4, 8, 3, 1, 0),
]


@pytest.fixture(scope="module")
def small_shards(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[str]]:
    root = tmp_path_factory.mktemp("small")
    return {n: make_shards(root / str(n), n, shard_size=13) for n, *_ in SMALL}


@pytest.mark.parametrize(("n", "streams", "batch", "buffer", "world", "workers"), SMALL)
def test_sets_smaller_than_the_buffers_keep_epochs_through_kills(
    small_shards, n: int, streams: int, batch: int, buffer: int, world: int, workers: int
) -> None:
    def loaders(w: int, k: int, state=None) -> list:
        out = []
        for rank in range(w):
            lo = streaming.StreamLoader(
                small_shards[n],
                batch // w,
                rank,
                w,
                streams=streams,
                seed=1,
                buffer=buffer,
                decode=shard_decode.SampleDecoder(8, 1),
                collate=keys_collate,
                num_workers=k,
            )
            if state is not None:
                lo.load_state_dict(state)
            out.append(lo)
        return out

    steps = -(-5 * n // 2 // batch)  # two and a half epochs
    ref = run_segment(loaders(1, 0), steps)
    assert check_epochs(ref, n) == 2
    rng = random.Random(n)
    kills = sorted({n // batch, n // batch + 1, *rng.sample(range(1, steps), 2)})
    got, state, done = [], None, 0
    for stop in [*kills, steps]:
        segment = loaders(world, workers, state)
        got += run_segment(segment, stop - done)
        state, done = merged_state(segment), stop
    assert got == ref
