"""Training from tar shards: 2 processes equal 1 with the same global batch, and a run killed
with SIGKILL and resumed equals the uninterrupted run bit for bit (CPU, fp32), from local disk,
an HTTP server and an S3 server (both started here, on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import tiny_overrides, torchrun_vltrain
from tests.data.stream_servers import http_server, s3_server
from vltrain.data.shards import write_shards

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "clip.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


@pytest.fixture(scope="module")
def shard_dir(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wds") / "shards"
    write_shards(shapes_dir / "train.jsonl", out, 16)  # 128 samples, 8 shards
    return out


def _args(shapes_dir: Path, shard_dir: object, out: Path, **extra: object) -> list[str]:
    opts = {"data.train": shard_dir, "data.streams": 4, "data.shuffle_buffer": 20, **extra}
    return ["train", str(CONFIG), *tiny_overrides(shapes_dir, out, **opts)]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step}" / "model.safetensors")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _vltrain(args: list[str], env: dict[str, str] = ENV) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "vltrain", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow
def test_two_processes_from_shards_equal_one_process(
    shapes_dir: Path, shard_dir: Path, tmp_path: Path
) -> None:
    steps = {"train.max_steps": 5, "train.save_every": 5, "optim.lr": 2e-3}
    _vltrain(_args(shapes_dir, shard_dir, tmp_path / "one", **steps, **{"data.batch_size": 16}))
    torchrun_vltrain(
        _args(shapes_dir, shard_dir, tmp_path / "two", **steps, **{"data.batch_size": 8})
    )
    one, two = _weights(tmp_path / "one", 5), _weights(tmp_path / "two", 5)
    assert _max_diff(one, two) < 1e-5
    # negative control: another sample order (data.streams=2) moves the weights measurably
    other = {"data.batch_size": 16, "data.streams": 2}
    _vltrain(_args(shapes_dir, shard_dir, tmp_path / "other", **steps, **other))
    assert _max_diff(one, _weights(tmp_path / "other", 5)) > 1e-4


def _kill_resume_equals_full(
    shapes_dir: Path, data: object, tmp_path: Path, opts: dict, kill_after: int, env=ENV
) -> None:
    """Train `opts` once uninterrupted and once killed with SIGKILL (trainer and loader worker,
    mid-step) after checkpoint `kill_after`, then resumed: losses and weights bit for bit."""
    steps = opts["train.max_steps"]
    full, part = tmp_path / "full", tmp_path / "part"
    _vltrain(_args(shapes_dir, data, full, **opts), env)

    cmd = [sys.executable, "-m", "vltrain", *_args(shapes_dir, data, part, **opts)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    marker = part / "checkpoints" / f"step_{kill_after}" / "COMPLETE"
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its loader worker, mid-step
    proc.wait()
    assert not (part / "checkpoints" / f"step_{steps}").exists()

    _vltrain(_args(shapes_dir, data, part, **opts, **{"train.resume": True}), env)
    a, b = _losses(full), _losses(part)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert [a[s] for s in sorted(a)] == [b[s] for s in sorted(a)]  # bit for bit
    assert _max_diff(_weights(full, steps), _weights(part, steps)) == 0.0
    for run in (full, part):  # epochs stay epochs: the doctor sees no sample twice in one
        assert "sample_repeated" not in (run / "doctor.jsonl").read_text()


@pytest.mark.slow
def test_kill_9_and_resume_from_shards_equals_uninterrupted_run(
    shapes_dir: Path, shard_dir: Path, tmp_path: Path
) -> None:
    # 128 samples / 16 = 8 steps per epoch: the kill lands in epoch 1 and the run crosses the
    # epoch-2 boundary after resuming. Dropout makes the RNG stream matter; a worker process
    # makes the DataLoader's read-ahead matter.
    opts = {
        "train.max_steps": 20,
        "train.save_every": 3,
        "model.dropout": 0.1,
        "data.num_workers": 1,
    }
    _kill_resume_equals_full(shapes_dir, shard_dir, tmp_path, opts, kill_after=9)


REMOTE_OPTS = {  # shuffle buffers larger than the whole set (4 x 1000 > 128 samples)
    "train.max_steps": 12,
    "train.save_every": 3,
    "model.dropout": 0.1,
    "data.num_workers": 1,
    "data.shuffle_buffer": 1000,
}


@pytest.mark.slow
def test_kill_9_and_resume_over_http_equals_uninterrupted_run(
    shapes_dir: Path, shard_dir: Path, tmp_path: Path
) -> None:
    """Shards from an HTTP server (a brace pattern of URLs); the kill lands in epoch 0 and
    the resumed run crosses into epoch 1."""
    with http_server(shard_dir.parent) as url:
        data = f"{url}/{shard_dir.name}/shard-{{000000..000007}}.tar"
        _kill_resume_equals_full(shapes_dir, data, tmp_path, REMOTE_OPTS, kill_after=6)


@pytest.mark.slow
def test_kill_9_and_resume_from_s3_equals_uninterrupted_run(
    shapes_dir: Path, shard_dir: Path, tmp_path: Path
) -> None:
    """Shards in a bucket of moto's S3 server (a folder URL, listed by s3fs), reached through
    the standard AWS environment (AWS_ENDPOINT_URL and keys)."""
    pytest.importorskip("s3fs", reason="pip install s3fs 'moto[server]' for the S3 tests")
    pytest.importorskip("moto.server", reason="pip install 'moto[server]' for the S3 tests")
    import fsspec

    with s3_server() as env:
        fs = fsspec.filesystem("s3")
        fs.mkdir("bucket")
        fs.put(str(shard_dir), "bucket/", recursive=True)
        env = {**ENV, **env}
        _kill_resume_equals_full(
            shapes_dir, "s3://bucket/shards/", tmp_path, REMOTE_OPTS, kill_after=6, env=env
        )


@pytest.mark.slow
def test_damaged_shard_is_counted_up_to_the_threshold(shapes_dir: Path, tmp_path: Path) -> None:
    """A shard with a bad header mid-way (tarfile.ReadError): each lost sample counts as
    `corrupt`; above data.max_bad_fraction the run stops with one error naming the shard."""
    shard_dir = tmp_path / "shards"
    paths = write_shards(shapes_dir / "train.jsonl", shard_dir, 16).shards
    broken = bytearray(Path(paths[3]).read_bytes())
    broken[3 * 1024 + 148 : 3 * 1024 + 156] = b"0000000\0"
    Path(paths[3]).write_bytes(bytes(broken))
    opts = {"train.max_steps": 4, "optim.warmup_steps": 1}
    cmd = [sys.executable, "-m", "vltrain", *_args(shapes_dir, shard_dir, tmp_path / "a", **opts)]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert "vltrain: error:" in res.stderr and "corrupt:" in res.stderr
    assert "shard-000003.tar: bad tar header checksum" in res.stderr

    more = {**opts, "data.max_bad_fraction": 0.5, "data.num_workers": 1}
    _vltrain(_args(shapes_dir, shard_dir, tmp_path / "b", **more))
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["step"] == 4 and summary["bad_samples"]["corrupt"] >= 1
