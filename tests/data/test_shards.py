"""`vltrain data shard`: plain webdataset tars (read by the webdataset library), found by
folder, brace pattern or fsspec URL; bad samples in shards are counted by reason."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from tests.data.stream_fixtures import png_bytes, write_records
from vltrain.cli import main
from vltrain.config.core import ConfigError
from vltrain.data import shard_decode, shards, streaming
from vltrain.data.readers import DataError
from vltrain.stages import load_run_config


def test_cli_writes_webdataset_tars(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    records = write_records(tmp_path / "rec", 25)
    out = tmp_path / "wds"
    assert main(["data", "shard", str(records), "--out", str(out), "--shard-size", "10"]) == 0
    assert "wrote 25 samples in 3 shards" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("*.tar")) == [f"shard-00000{i}.tar" for i in range(3)]
    index = json.loads((out / "shardindex.json").read_text())
    assert [e["nsamples"] for e in index["shardlist"]] == [10, 10, 5]

    import webdataset as wds  # the peer library reads the same files

    samples = list(wds.WebDataset(str(out / "shard-{000000..000002}.tar"), shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"{i:09d}" for i in range(25)]
    meta = json.loads(samples[3]["json"])
    assert meta == {
        "text": ["caption 3 a", "caption 3 b"],
        "negatives": ["negative 3"],
        "id": "r3",
    }
    assert samples[3]["png"] == png_bytes(3)  # copied byte for byte
    # writing into a folder that already holds shards is refused (old and new would mix)
    with pytest.raises(DataError, match="already holds 3 shards"):
        shards.write_shards(records, out, 10)


def test_sources_folder_pattern_and_urls_name_the_same_shards(tmp_path: Path) -> None:
    records = write_records(tmp_path / "rec", 12)
    written = shards.write_shards(records, tmp_path / "wds", 4).shards
    assert shards.resolve_shards(tmp_path / "wds") == written
    assert shards.resolve_shards(str(tmp_path / "wds" / "shard-{000000..000002}.tar")) == written
    assert shards.is_shard_source(tmp_path / "wds") and not shards.is_shard_source(records)
    urls = shards.resolve_shards(f"file://{tmp_path / 'wds'}")
    assert [u.removeprefix("file://") for u in urls] == written
    assert shards.expand_braces("a{0..2}-{x,y}") == ["a0-x", "a0-y", "a1-x", "a1-y", "a2-x", "a2-y"]
    with pytest.raises(DataError, match="names no tar shards"):
        shards.resolve_shards(tmp_path / "rec")


def test_fsspec_memory_url_streams_like_local_disk(tmp_path: Path) -> None:
    import fsspec

    records = write_records(tmp_path / "rec", 12)
    local = shards.write_shards(records, tmp_path / "wds", 4).shards
    fs = fsspec.filesystem("memory")
    for p in local:
        fs.pipe(f"/bucket/wds/{Path(p).name}", Path(p).read_bytes())
    remote = shards.resolve_shards("memory://bucket/wds")
    assert [Path(u).name for u in remote] == [Path(p).name for p in local]

    def stream(urls: list[str]) -> list:
        loader = streaming.StreamLoader(
            urls,
            4,
            0,
            1,
            streams=2,
            seed=0,
            buffer=3,
            decode=shard_decode.SampleDecoder(8, 0),
            collate=lambda g: [s["key"] for s in g],
        )
        it = iter(loader)
        return [next(it).data for _ in range(7)]

    assert stream(remote) == stream(local)


def _tar(path: Path, members: list[tuple[str, bytes]]) -> str:
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def test_bad_samples_are_counted_by_reason(tmp_path: Path) -> None:
    good = json.dumps({"text": "a red square"}).encode()
    path = _tar(
        tmp_path / "bad.tar",
        [
            ("0.png", png_bytes(0)),
            ("0.json", good),  # fine
            ("1.json", good),  # no image member
            ("2.png", b""),
            ("2.json", good),  # empty file
            ("3.png", b"not an image at all"),
            ("3.json", good),
            ("4.png", png_bytes(4)[:50]),
            ("4.json", good),  # truncated PNG
            ("5.png", png_bytes(5)),
            ("5.json", json.dumps({"text": "  "}).encode()),
            ("6.jpg", png_bytes(6)),
            ("6.txt", b"caption from txt"),  # img2dataset layout
            ("d/" + "k" * 120 + ".png", png_bytes(7)),
            ("d/" + "k" * 120 + ".json", good),
        ],
    )
    decode = shard_decode.SampleDecoder(8, 0)
    with open(path, "rb") as f:
        raws = list(shards.iter_samples(f))
    assert [r.key for r in raws][-1] == "d/" + "k" * 120  # GNU long names keep their key
    entries = [streaming.Entry(0, 0, r.offset, r.key, r) for r in raws]
    out = [decode(e, path) for e in entries]
    reasons = [s.get("bad") for s in out]
    assert reasons == [
        None,
        "missing",
        "empty_file",
        "not_image",
        "truncated",
        "bad_text",
        None,
        None,
    ]
    assert out[6]["text"] == "caption from txt" and out[0]["image"].shape == (3, 8, 8)
    assert "bad.tar:1" in out[1]["path"]


def test_damaged_shard_is_one_bad_sample_and_the_stream_goes_on(tmp_path: Path) -> None:
    records = write_records(tmp_path / "rec", 8)
    paths = shards.write_shards(records, tmp_path / "wds", 4).shards
    data = Path(paths[0]).read_bytes()
    broken = bytearray(data)
    broken[3 * 1024 + 148 : 3 * 1024 + 156] = b"0000000\0"  # a header checksum mid-shard
    Path(paths[0]).write_bytes(bytes(broken))
    loader = streaming.StreamLoader(
        paths,
        4,
        0,
        1,
        streams=1,
        seed=0,
        buffer=0,
        decode=shard_decode.SampleDecoder(8, 0),
        collate=lambda g: [s["key"] for s in g],
        counts=[4, 4],
    )
    it = iter(loader)
    batches = [next(it) for _ in range(3)]
    bad = [b for batch in batches for b in batch.bad]
    assert bad and all(reason == "corrupt" for reason, _ in bad)
    assert "lost" in bad[0][1]
    assert sum(b.n_good for b in batches) >= 4  # the intact shard still trains


def _damage(path: str, how: str) -> None:
    data = bytearray(Path(path).read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2 + 100]
    else:  # a header checksum mid-shard
        data[3 * 1024 + 148 : 3 * 1024 + 156] = b"0000000\0"
    Path(path).write_bytes(bytes(data))


def _raw_key(entry: streaming.Entry, shard: str) -> dict:
    """Every entry as a sample: its (epoch, key), a lost one as (epoch, "LOST")."""
    return {"key": (entry.epoch, entry.key if entry.sample else "LOST"), "index": 0}


@pytest.mark.parametrize("index", [True, False])
@pytest.mark.parametrize("how", ["truncated", "checksum"])
def test_damaged_shard_counts_each_lost_sample_and_resumes_exactly(
    tmp_path: Path, how: str, index: bool
) -> None:
    """Every epoch stays N samples long, the unreadable ones one `corrupt` entry each; a
    resume at any step (inside the damaged shard too) equals the uninterrupted stream; the
    tokenizer's text scan skips the damage."""
    records = write_records(tmp_path / "rec", 40)
    paths = shards.write_shards(records, tmp_path / "wds", 8).shards
    _damage(paths[2], how)
    if not index:
        (tmp_path / "wds" / shards.INDEX_NAME).unlink()
    counts = shards.shard_counts(paths)
    n = sum(counts)
    # with the index the shard keeps its 8; without, its readable samples + 1 for the rest
    assert counts[2] == 8 if index else 1 <= counts[2] < 8

    def loader(state=None):
        lo = streaming.StreamLoader(
            paths,
            6,
            0,
            1,
            streams=2,
            seed=0,
            buffer=5,
            decode=_raw_key,
            collate=lambda g: [tuple(s["key"]) for s in g],
            num_workers=1,
        )
        if state is not None:
            lo.load_state_dict(state)
        return lo

    def run(lo, steps):
        it = iter(lo)
        return [next(it).data for _ in range(steps)], lo.state_dict()

    steps = -(-3 * n // 6)
    ref, _ = run(loader(), steps)
    got, state = run(loader(), 4)
    for stop in (7, 9, steps):
        more, state = run(loader(state), stop - len(got))
        got += more
    assert got == ref
    flat = [k for b in ref for k in b]
    lost = []
    for epoch in range(2):
        chunk = flat[epoch * n : (epoch + 1) * n]
        assert {e for e, _ in chunk} == {epoch}
        good = [k for _, k in chunk if k != "LOST"]
        assert len(good) == len(set(good))
        lost.append(n - len(good))
    assert lost[0] == lost[1] >= 1
    # the real decoder counts them as `corrupt`, naming the shard
    entry = streaming.ShardStream(paths, counts, 1, 0, 0, 0)
    bad = [shard_decode.SampleDecoder(8, 0)(entry.next(), "") for _ in range(n)]
    bad = [b for b in bad if "bad" in b]
    assert len(bad) == lost[0] and {b["bad"] for b in bad} == {"corrupt"}
    assert all(Path(paths[2]).name in b["path"] and "lost" in b["path"] for b in bad)
    assert len(shards.read_texts(paths, 1000)) >= 2 * (40 - 8)


def test_read_texts_skips_images(tmp_path: Path) -> None:
    records = write_records(tmp_path / "rec", 6)
    paths = shards.write_shards(records, tmp_path / "wds", 4).shards
    assert shards.read_texts(paths, 5) == [
        "caption 0 a",
        "caption 0 b",
        "caption 1 a",
        "caption 1 b",
        "caption 2 a",
    ]


def test_caption_stage_refuses_shards_with_a_clear_error(tmp_path: Path) -> None:
    records = write_records(tmp_path / "rec", 6)
    shards.write_shards(records, tmp_path / "wds", 4)
    with pytest.raises(ConfigError, match="length buckets"):
        load_run_config(
            None, ["stage=caption", "model.kind=captioner", f"data.train={tmp_path}/wds"]
        )
    with pytest.raises(ConfigError, match="larger than the global batch"):  # at load
        load_run_config(None, [f"data.train={tmp_path}/wds", "data.batch_size=2"])
    with pytest.raises(ConfigError, match="data.max_train_samples needs map-style"):
        load_run_config(None, [f"data.train={tmp_path}/wds", "data.max_train_samples=3"])


@pytest.mark.parametrize("kind", ["folder", "parquet", "save_to_disk"])
def test_shards_of_every_source_kind_carry_their_images(
    shapes_dir: Path, tmp_path: Path, kind: str
) -> None:
    """A captions folder's images lie beside its captions file (they were looked for beside
    the folder: every sample was written without its image, rc 0); parquet and datasets
    sources hold their images in the table (a TypeError and a half-written shard)."""
    import shutil

    from vltrain.data.readers import read_jsonl

    recs = read_jsonl(shapes_dir / "val.jsonl")[:5]
    if kind == "folder":
        src = tmp_path / "shots"
        src.mkdir()
        for r in recs:
            shutil.copy(shapes_dir / r["image"], src / Path(r["image"]).name)
        rows = [f"{Path(r['image']).name},{r['text'][0]}" for r in recs]
        (src / "captions.csv").write_text("image,caption\n" + "\n".join(rows) + "\n")
    else:
        datasets = pytest.importorskip("datasets")
        table = datasets.Dataset.from_dict(
            {
                "image": [str(shapes_dir / r["image"]) for r in recs],
                "text": [r["text"] for r in recs],
            }
        ).cast_column("image", datasets.Image())
        src = tmp_path / ("d.parquet" if kind == "parquet" else "hf")
        table.to_parquet(str(src)) if kind == "parquet" else table.save_to_disk(str(src))
    report = shards.write_shards(src, tmp_path / "wds", 4)
    assert report.samples == 5 and report.missing_images == {}
    assert not list((tmp_path / "wds").glob("*.tmp"))
    with tarfile.open(report.shards[0]) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert members["000000000.png"] == (shapes_dir / recs[0]["image"]).read_bytes()
