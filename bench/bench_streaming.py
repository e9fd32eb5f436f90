"""Streaming webdataset shards, side by side on the same tars: samples lost or duplicated by a
mid-epoch kill/resume, resume time, and loader throughput.

    PYTHONPATH=. python bench/bench_streaming.py [--samples 2000 --shard-size 100 --buffer 1000
        --batch 32 --kill-at 700 --workers 2 --image-size 64 --runs 3]

Peers: webdataset 1.0.2 (no resume state: a restart replays the epoch from its start), HF
datasets' "webdataset" streaming builder with `.shuffle(buffer)` and `state_dict()`, and
torchdata 0.11 `StatefulDataLoader` over the webdataset pipeline (it fast-forwards). Every loader
runs one epoch's worth of samples (N): `kill_at` before the kill, N - kill_at after the resume;
lost = samples of the epoch never delivered, duplicated = deliveries beyond the first. The
throughput rows decode every image with the same function (vltrain's safe PIL decode + resize),
so they compare the loaders, not the decoders.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vltrain.data import shard_decode, shards, streaming
from vltrain.data.synth import synth_command
from vltrain.diagnostics.card import cpu_model


def make_data(root: Path, n: int, shard_size: int, image_size: int) -> list[str]:
    synth_command(str(root / "data"), n, 8, 8, 0, image_size=image_size)
    return shards.write_shards(root / "data" / "train.jsonl", root / "wds", shard_size).shards


def count(keys: list[str], n: int) -> tuple[int, int]:
    """(lost, duplicated) over one epoch of `n` samples."""
    return n - len(set(keys)), len(keys) - len(set(keys))


# ---- vltrain -----------------------------------------------------------------------------


def key_collate(good: list[dict]) -> list[tuple[int, str]]:
    return [tuple(s["key"]) for s in good]  # (epoch, key)


def vltrain_loader(urls, args, workers=0, decode_images=False, state=None):
    size = args.image_size
    decode = shard_decode.SampleDecoder(size, 0) if decode_images else KeyOnly()
    loader = streaming.StreamLoader(
        urls,
        args.batch,
        0,
        1,
        streams=args.streams,
        seed=0,
        buffer=args.buffer // args.streams,
        decode=decode,
        collate=key_collate if not decode_images else image_collate,
        num_workers=workers,
    )
    if state is not None:
        loader.load_state_dict(state)
    return loader


class KeyOnly:
    """No image decode: the resume rows measure the loaders' bookkeeping, not PIL."""

    def __call__(self, entry, shard):
        return {"key": (entry.epoch, entry.key), "index": 0}


def image_collate(good: list[dict]) -> dict:
    return {"images": torch.stack([s["image"] for s in good])}


def vltrain_resume(urls, args, n):
    """Exact: a state_dict after `kill_at` samples, a new loader, the rest of the epoch."""
    steps_before, steps_after = args.kill_at // args.batch, (n - args.kill_at) // args.batch
    loader = vltrain_loader(urls, args)
    it = iter(loader)
    keys = [k for _ in range(steps_before) for k in next(it).data]
    state = loader.state_dict()
    t = time.perf_counter()
    it = iter(vltrain_loader(urls, args, state=state))
    first = next(it).data
    resume_s = time.perf_counter() - t
    keys += first + [k for _ in range(steps_after - 1) for k in next(it).data]
    # the epoch is n samples; with a buffer, epoch-0 samples still buffered come a bit later
    return keys, resume_s, steps_before * args.batch


# ---- webdataset --------------------------------------------------------------------------


def wds_pipeline(urls, args, decode_images=False):
    import webdataset as wds

    ds = wds.WebDataset(
        urls, shardshuffle=len(urls), seed=0, nodesplitter=None, empty_check=False
    ).shuffle(args.buffer)
    if decode_images:  # the very decode vltrain's loader runs: image, caption pick, checks
        return ds.map(SameDecode(args.image_size)).batched(args.batch, collation_fn=image_stack)
    return ds.map(lambda s: s["__key__"])


class SameDecode:
    def __init__(self, size: int) -> None:
        self.decode = shard_decode.SampleDecoder(size, 0)

    def __call__(self, s: dict) -> dict:
        raw = shards.RawSample(s["__key__"], 0, 0, {"png": s["png"], "json": s["json"]})
        return self.decode(streaming.Entry(0, 0, 0, s["__key__"], raw), s["__url__"])


def image_stack(samples: list[dict]) -> torch.Tensor:
    return torch.stack([s["image"] for s in samples])


def wds_resume(urls, args, n):
    """webdataset has no state: a restarted job starts the epoch over."""
    it = iter(wds_pipeline(urls, args))
    keys = [next(it) for _ in range(args.kill_at)]
    t = time.perf_counter()
    it = iter(wds_pipeline(urls, args))
    keys.append(next(it))
    resume_s = time.perf_counter() - t
    keys += [next(it) for _ in range(n - args.kill_at - 1)]
    return keys, resume_s


# ---- HF datasets -------------------------------------------------------------------------


def hf_stream(urls, args):
    from datasets import load_dataset

    ds = load_dataset("webdataset", data_files={"train": urls}, split="train", streaming=True)
    return ds.shuffle(seed=0, buffer_size=args.buffer).select_columns(["__key__"])


def hf_resume(urls, args, n):
    ds = hf_stream(urls, args)
    keys = []
    for i, row in enumerate(ds):
        keys.append(row["__key__"])
        if i + 1 == args.kill_at:
            break
    state = ds.state_dict()
    t = time.perf_counter()
    ds2 = hf_stream(urls, args)
    ds2.load_state_dict(state)
    it = iter(ds2)
    keys.append(next(it)["__key__"])
    resume_s = time.perf_counter() - t
    for row in it:
        keys.append(row["__key__"])
        if len(keys) == n:
            break
    return keys, resume_s


# ---- torchdata ---------------------------------------------------------------------------


def torchdata_resume(urls, args, n):
    """StatefulDataLoader over the webdataset pipeline: it counts batches and, on resume,
    fast-forwards by pulling that many again (the pipeline has no state of its own)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        return StatefulDataLoader(wds_pipeline(urls, args), batch_size=args.batch, num_workers=0)

    steps_before, steps_after = args.kill_at // args.batch, (n - args.kill_at) // args.batch
    dl = loader()
    it = iter(dl)
    keys = [k for _ in range(steps_before) for k in next(it)]
    state = dl.state_dict()
    t = time.perf_counter()
    dl2 = loader()
    dl2.load_state_dict(state)
    it = iter(dl2)
    first = next(it)
    resume_s = time.perf_counter() - t
    keys += list(first) + [k for _ in range(steps_after - 1) for k in next(it)]
    return keys, resume_s


# ---- throughput --------------------------------------------------------------------------


def throughput(make_iter, batches: int) -> float:
    it = make_iter()
    next(it)  # start-up (workers, first shard) is not throughput
    t = time.perf_counter()
    n = sum(len(next(it)) for _ in range(batches))
    return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--shard-size", type=int, default=100)
    p.add_argument("--buffer", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--kill-at", type=int, default=704)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--throughput-batches", type=int, default=40)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench_stream_"))
    urls = make_data(root, args.samples, args.shard_size, args.image_size)
    n = args.samples
    import datasets
    import torchdata
    import webdataset

    print(
        f"CPU: {cpu_model()}; python {platform.python_version()}, torch {torch.__version__}, "
        f"webdataset {webdataset.__version__}, datasets {datasets.__version__}, torchdata "
        f"{torchdata.__version__}; {n} samples in {len(urls)} shards, buffer {args.buffer}, "
        f"batch {args.batch}, kill after {args.kill_at} samples"
    )
    print("\n| loader | lost | duplicated | resume to first batch (s, median) |")
    print("|---|---:|---:|---:|")
    rows = {
        "vltrain StreamLoader": lambda: vltrain_resume(urls, args, n)[:2],
        f"webdataset {webdataset.__version__} (restart)": lambda: wds_resume(urls, args, n),
        f"HF datasets {datasets.__version__} state_dict": lambda: hf_resume(urls, args, n),
        f"torchdata {torchdata.__version__} StatefulDataLoader": lambda: torchdata_resume(
            urls, args, n
        ),
    }
    for name, fn in rows.items():
        runs = [fn() for _ in range(args.runs)]
        keys = runs[0][0]
        if name.startswith("vltrain"):
            # against the uninterrupted stream: epoch-0 samples still buffered at sample n
            # arrive a little later, exactly as they do without the kill
            ref = iter(vltrain_loader(urls, args))
            full = [k for _ in range(len(keys) // args.batch) for k in next(ref).data]
            lost = len(set(full) - set(keys))
            dup = len(keys) - len(set(keys)) + sum(a != b for a, b in zip(full, keys, strict=False))
        else:
            lost, dup = count(keys, n)
        med = statistics.median(r[1] for r in runs)
        print(f"| {name} | {lost} | {dup} | {med:.3f} |")
    print(
        "\nvltrain: lost = samples of the uninterrupted stream missing after resume, "
        "duplicated = repeats plus positions where the two streams differ (0 = identical). "
        "Peers: samples of the epoch never delivered / delivered twice. Buffers: the same "
        "total size (vltrain splits it over its streams)."
    )

    print(f"\n| loader ({args.workers} workers, decode + resize {args.image_size}px) | samples/s |")
    print("|---|---:|")
    import webdataset as wds

    def ours():
        return (
            b.data["images"]
            for b in vltrain_loader(urls, args, workers=args.workers, decode_images=True)
        )

    def theirs():
        return iter(
            wds.WebLoader(
                wds_pipeline(urls, args, decode_images=True),
                batch_size=None,
                num_workers=args.workers,
            )
        )

    results: dict[str, list[float]] = {"vltrain": [], "webdataset": []}
    for _ in range(args.runs):  # alternate, so load changes hit both alike
        results["vltrain"].append(throughput(ours, args.throughput_batches))
        results["webdataset"].append(throughput(theirs, args.throughput_batches))
    for name, vals in results.items():
        print(f"| {name} | {statistics.median(vals):.0f} (runs {[round(v) for v in vals]}) |")
    ratio = statistics.median(results["vltrain"]) / statistics.median(results["webdataset"])
    print(f"\nvltrain / webdataset throughput: {ratio:.2f}x")


if __name__ == "__main__":
    main()
