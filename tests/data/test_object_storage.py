"""Tar shards from object storage: URLs, ``file://`` paths and brace patterns pass the
pre-flight (fsspec lists them and opens the first shard) and stream exactly like local disk;
what cannot be read is one `vltrain: error:` line naming the URL, before anything is written.

Real servers on 127.0.0.1, started here: an HTTP server with byte ranges and moto's S3 server
(skipped with a message where moto or s3fs is not installed). tests/stages/test_stream_train.py
trains from both with kill -9 and exact resume.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides
from tests.data.stream_fixtures import make_shards
from tests.data.stream_servers import http_server, s3_server
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.config.core import ConfigError
from vltrain.data import shard_decode, shards, streaming
from vltrain.engine.run_dir import check_data_files


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("store")
    make_shards(out, 30, shard_size=8)  # out/shards/shard-00000{0..3}.tar
    (out / "html").mkdir()
    (out / "html" / "shard-000000.tar").write_text("<html>not a tar</html>")
    return out


@pytest.fixture(scope="module")
def http(root: Path):
    with http_server(root) as url:
        yield url


@pytest.fixture(scope="module")
def s3(root: Path):
    pytest.importorskip("s3fs", reason="pip install s3fs 'moto[server]' for the S3 tests")
    pytest.importorskip("moto.server", reason="pip install 'moto[server]' for the S3 tests")
    import fsspec

    with s3_server():
        fs = fsspec.filesystem("s3")
        fs.mkdir("bucket")
        fs.put(str(root / "shards"), "bucket/", recursive=True)
        yield "s3://bucket"


def _preflight(value: str) -> None:
    check_data_files(load_config(None, [f"data.train={value}"]))


def _refused(value: str) -> str:
    with pytest.raises(ConfigError) as e:
        _preflight(value)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("'data.train': ")
    return msg


def test_urls_patterns_and_file_urls_pass_the_preflight(root: Path, http: str) -> None:
    local = root / "shards"
    for value in (
        f"{local}/shard-{{000000..000003}}.tar",
        f"file://{local}",
        f"file://{local}/shard-{{000000..000003}}.tar",
        f"{http}/shards/",
        f"{http}/shards/shard-{{000000..000003}}.tar",
    ):
        _preflight(value)
    names = [Path(u).name for u in shards.resolve_shards(f"{http}/shards")]
    assert names == [f"shard-00000{i}.tar" for i in range(4)]  # a listing, not http://http://


def test_what_cannot_be_read_is_one_line_naming_the_url(root: Path, http: str) -> None:
    msg = _refused(f"{http}/missing/shard-{{000000..000001}}.tar")
    assert f"{http}/missing/shard-000000.tar" in msg and "FileNotFoundError" in msg
    assert f"{http}/html/shard-000000.tar is not a readable tar shard" in _refused(
        f"{http}/html/shard-{{000000..000000}}.tar"
    )
    assert "names no tar shards" in _refused(f"{http}/missing/")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/shards/shard-{{0..1}}.tar"
    assert "http://127.0.0.1:" in _refused(dead) and "cannot read shard" in _refused(dead)
    msg = _refused(f"{root}/shards/shard-{{000000..000009}}.tar")
    assert "6 of the 10 shards" in msg and "shard-000004.tar" in msg
    (root / "notar").mkdir(exist_ok=True)  # a local folder whose .tar is no tar
    (root / "notar" / "shard-000000.tar").write_text("hi\n")
    assert "shard-000000.tar is not a readable tar shard (3 bytes" in _refused(str(root / "notar"))


def test_cli_refuses_before_writing(root: Path, http: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    overrides = tiny_overrides(root, out, **{"data.train": f"{http}/missing/s-{{0..1}}.tar"})
    overrides = [o for o in overrides if not o.startswith("data.eval=")]
    assert main(["train", str(REPO / "configs" / "clip.yaml"), *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vltrain: error: 'data.train': cannot read shard ")
    assert f"{http}/missing/s-0.tar" in err and "Traceback" not in err
    assert not out.exists()


def test_s3_preflight_and_errors(s3: str) -> None:
    _preflight(f"{s3}/shards/")
    _preflight(f"{s3}/shards/shard-{{000000..000003}}.tar")
    msg = _refused("s3://no-such-bucket/shards/shard-{000000..000001}.tar")
    assert "s3://no-such-bucket/shards/shard-000000.tar" in msg
    assert "AWS_ENDPOINT_URL" in msg  # the fix: where credentials and endpoint come from
    assert "names no tar shards" in _refused(f"{s3}/elsewhere/")


def _stream(urls: list[str], workers: int) -> list:
    loader = streaming.StreamLoader(
        urls,
        4,
        0,
        1,
        streams=2,
        seed=0,
        buffer=5,
        decode=shard_decode.SampleDecoder(8, 0),
        collate=lambda g: [tuple(s["key"]) for s in g],
        num_workers=workers,
    )
    it = iter(loader)
    first = [next(it).data for _ in range(6)]
    state = loader.state_dict()
    loader.load_state_dict(state)  # a resume mid-epoch: seeks into remote files
    it = iter(loader)
    return first + [next(it).data for _ in range(12)]


def test_http_and_s3_stream_like_local_disk(root: Path, http: str, s3: str) -> None:
    local = shards.resolve_shards(root / "shards")
    reference = _stream(local, 0)
    assert _stream(shards.resolve_shards(f"{http}/shards"), 1) == reference
    assert _stream(shards.resolve_shards(f"{s3}/shards/"), 1) == reference


def test_a_server_without_byte_ranges_is_refused_at_the_preflight(root: Path) -> None:
    """python -m http.server answers a range request with the whole file; a stream that starts
    inside a shard then failed in a loader worker, after the run had started."""
    big = root / "big"
    make_shards(big, 40, shard_size=40)  # one shard well past fsspec's first read
    with http_server(big, ranges=False) as url:
        assert "does not answer byte ranges" in _refused(f"{url}/shards/")
    with http_server(big) as url:
        _preflight(f"{url}/shards/")
