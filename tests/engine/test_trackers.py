"""MLflow (the default store inside the run folder, and a plain file store) and W&B (offline
mode) on tiny CPU runs: params/config, metrics per step, the summary artifact, run names and
tags, and resume into the same tracker run; a logger whose package is missing is refused at
load naming the extra; only rank 0 logs."""

from __future__ import annotations

import glob
import json
import re
import struct
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, tiny_overrides
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.config.extras import install_hint
from vltrain.engine.logging import RunLogger
from vltrain.engine.trackers import metric_name, read_ids

CLIP = str(REPO / "configs" / "clip.yaml")


def _train(data: Path, run: Path, **extra: object) -> None:
    over = tiny_overrides(data, run, **{"train.max_steps": 3, "optim.warmup_steps": 0, **extra})
    assert main(["train", CLIP, *over]) == 0


def _resume(run: Path, steps: int, *extra: str) -> None:
    more = [f"train.max_steps={steps}", "train.allow_changes=[train.max_steps]", *extra]
    assert main(["train", str(run / "config.yaml"), "train.resume=true", *more]) == 0


def _saved(run: Path) -> dict:
    import yaml

    return yaml.safe_load((run / "config.yaml").read_text())


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_mlflow_params_metrics_summary_and_resume_into_the_same_run(
    shapes_dir: Path, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    run = tmp_path / "run"
    _train(shapes_dir, run, **{"log.mlflow": True, "optim.lr": 0.002})
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(f"sqlite:///{run.resolve() / 'mlruns' / 'mlflow.db'}")
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.info.run_name == "run"
    assert got.data.params["optim.lr"] == "0.002" and got.data.params["stage"] == "contrastive"
    assert got.data.params["data.batch_size"] == "16"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert history == pytest.approx(_losses(run)) and sorted(history) == [1, 2, 3]
    assert "eval_i2t_R_at_1" in got.data.metrics  # MLflow names allow no '@'
    artifacts = {f.path for f in client.list_artifacts(run_id)}
    assert {"summary.json", "config.yaml"} <= artifacts
    assert (run / "mlruns" / "artifacts").is_dir()  # everything stays inside the run folder

    _resume(run, 5)
    assert json.loads((run / "trackers.json").read_text())["mlflow"] == run_id
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED" and got.data.tags["changed.train.max_steps"] == "5"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert sorted(history) == [1, 2, 3, 4, 5] and history == pytest.approx(_losses(run))
    assert len(client.search_runs([got.info.experiment_id])) == 1  # no second run


def test_mlflow_uri_overrides_the_store(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """log.mlflow_uri: MLflow's plain file store (MLflow 3 asks for MLFLOW_ALLOW_FILE_STORE)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "shared_mlruns").as_uri()
    run = tmp_path / "run"
    _train(shapes_dir, run, **{"log.mlflow": True, "log.mlflow_uri": uri})
    assert not (run / "mlruns").exists()
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    got = MlflowClient(uri).get_run(run_id)
    assert got.info.status == "FINISHED" and sorted(got.data.metrics) and got.data.params


def wandb_records(run_file: Path) -> list:
    """The records of an offline W&B run file (a leveldb-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, chunk = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # block trailer / padding
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def _key(item: object) -> str:
    return item.key or "/".join(item.nested_key)


def _wandb_run(path: str) -> tuple[object, dict[str, str], dict[int, float]]:
    """(run record, config, step -> loss) of one offline run folder."""
    records = wandb_records(Path(glob.glob(f"{path}/run-*.wandb")[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    items = [i for r in records if r.HasField("config") for i in r.config.update]
    config = {_key(i): json.loads(i.value_json) for i in [*run.config.update, *items]}
    losses = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {_key(i): json.loads(i.value_json) for i in r.history.item}
            if "loss" in row:
                losses[row["_step"]] = row["loss"]
    return run, config, losses


def test_wandb_offline_names_tags_group_and_resume_into_the_same_run(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    opts = {
        "log.wandb": True,
        "log.wandb_project": "proj",
        "log.wandb_entity": "team",
        "log.wandb_tags": "[tiny, cpu]",
        "log.wandb_group": "sweep-1",
    }
    try:
        _train(shapes_dir, run, **opts)
        run_id = json.loads((run / "trackers.json").read_text())["wandb"]
        (first,) = glob.glob(str(run / "wandb" / f"offline-run-*-{run_id}"))
        record, config, losses = _wandb_run(first)
        assert (record.run_id, record.entity, record.project) == (run_id, "team", "proj")
        assert record.display_name == "run" and list(record.tags) == ["tiny", "cpu"]
        assert record.run_group == "sweep-1" and config["optim.lr"] == _saved(run)["optim"]["lr"]
        assert losses == pytest.approx(_losses(run))

        _resume(run, 5)
        assert json.loads((run / "trackers.json").read_text())["wandb"] == run_id
        folders = glob.glob(str(run / "wandb" / "offline-run-*"))
        assert len(folders) == 2 and all(re.search(rf"-{run_id}(-\d+)?$", f) for f in folders)
        (second,) = set(folders) - {first}
        record, config, losses = _wandb_run(second)
        assert record.run_id == run_id and sorted(losses) == [4, 5]
        assert config["train.max_steps"] == 5
    finally:
        wandb.teardown()  # stop the W&B service process this test started


def _no_wandb_credentials(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """As on a fresh cluster node: no API key, no `wandb login` (.netrc), no WANDB_MODE."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.mark.slow  # two W&B service starts (~25 s)
def test_wandb_without_credentials_logs_offline_with_a_warning_and_resumes_the_same_run(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A resumed run with log.wandb=true on a machine without W&B credentials was an
    11-frame UsageError; now both runs log offline into the run folder, under one run id."""
    wandb = pytest.importorskip("wandb")
    _no_wandb_credentials(monkeypatch, tmp_path / "home")
    run = tmp_path / "run"
    try:
        _train(shapes_dir, run, **{"log.wandb": True, "train.max_steps": 1})
        err = capsys.readouterr().err
        assert "vltrain: warning: log.wandb=true but no W&B credentials" in err
        assert "Traceback" not in err
        run_id = json.loads((run / "trackers.json").read_text())["wandb"]
        assert glob.glob(str(run / "wandb" / f"offline-run-*-{run_id}"))
        _resume(run, 2)
        assert "no W&B credentials" in capsys.readouterr().err
        assert json.loads((run / "trackers.json").read_text())["wandb"] == run_id
        folders = glob.glob(str(run / "wandb" / "offline-run-*"))
        assert len(folders) == 2 and all(re.search(rf"-{run_id}(-\d+)?$", f) for f in folders)
    finally:
        wandb.teardown()


@pytest.mark.parametrize("how", ["log.wandb_mode=online", "WANDB_MODE=online"])
def test_wandb_online_without_credentials_is_refused_at_load(
    how: str, shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    pytest.importorskip("wandb")
    _no_wandb_credentials(monkeypatch, tmp_path / "home")
    run = tmp_path / "run"
    over = tiny_overrides(shapes_dir, run, **{"log.wandb": True})
    if how.startswith("WANDB_MODE"):
        monkeypatch.setenv("WANDB_MODE", "online")
    else:
        over.append(how)
    assert main(["train", CLIP, *over]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vltrain: error: log.wandb=true with ") and err.count("\n") == 1
    assert "no W&B credentials" in err and "log.wandb_mode=offline" in err
    assert not run.exists()
    # a netrc entry for the W&B host (what `wandb login` writes) is a credential
    (tmp_path / "home" / ".netrc").write_text("machine api.wandb.ai login user password k\n")
    (tmp_path / "home" / ".netrc").chmod(0o600)
    from vltrain.engine.trackers import wandb_credentials

    assert wandb_credentials()


@pytest.mark.parametrize("logger", ["mlflow", "wandb"])
def test_a_logger_without_its_package_is_refused_at_load_naming_the_extra(
    logger: str, shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, logger, None)  # as if not installed
    run = tmp_path / "run"
    over = tiny_overrides(shapes_dir, run, **{f"log.{logger}": True})
    assert main(["train", CLIP, *over]) == 2
    err = capsys.readouterr().err
    assert (
        err == f"vltrain: error: 'log.{logger}'=true needs {logger}: pip install 'vltrain[log]'\n"
    )
    assert not run.exists()  # before anything was written, let alone computed


def test_every_optional_package_names_its_extra(tmp_path: Path, monkeypatch, capsys) -> None:
    expected = {
        "mlflow": "log",
        "wandb": "log",
        "tensorboard": "log",
        "matplotlib": "scaling",
        "datasets": "datasets",
        "pyarrow.parquet": "datasets",
        "gguf": "gguf",
        "transformers": "hf",
    }
    for module, extra in expected.items():
        assert install_hint(module) == f"pip install 'vltrain[{extra}]'"
    extras = _pyproject_extras()
    for module, extra in expected.items():  # the extra exists and installs that package
        top = module.split(".")[0].replace("_", "-")
        assert any(req.startswith(top) for req in extras[extra]), (module, extra)
    # through the CLI: a parquet source without datasets installed
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [b"x"], "text": ["a"]}), tmp_path / "d.parquet")
    monkeypatch.setitem(sys.modules, "datasets", None)
    over = tiny_overrides(tmp_path, tmp_path / "run", **{"data.train": tmp_path / "d.parquet"})
    assert main(["train", CLIP, *over, "data.eval="]) == 2
    assert "pip install 'vltrain[datasets]'" in capsys.readouterr().err


def _pyproject_extras() -> dict[str, list[str]]:
    import tomllib

    text = (REPO / "pyproject.toml").read_text()
    return tomllib.loads(text)["project"]["optional-dependencies"]


def test_only_rank_0_opens_trackers(shapes_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, tiny_overrides(shapes_dir, tmp_path / "run", **{"log.mlflow": True}))
    for rank, folder in enumerate((tmp_path / "rank0", tmp_path / "rank1")):
        folder.mkdir()
        logger = RunLogger(cfg, folder, enabled=rank == 0, start_step=0)
        logger.log(1, {"loss": 1.0})
        logger.close()
    assert (tmp_path / "rank0" / "mlruns").is_dir()  # negative control: rank 0 does log
    assert list((tmp_path / "rank1").iterdir()) == []


def test_the_mlflow_status_says_how_the_run_ended(shapes_dir: Path, tmp_path: Path) -> None:
    """Closed from the loop's `finally`: FINISHED once the loop marks the end, KILLED for a stop
    at a checkpoint (a signal), FAILED for any other exception."""
    from mlflow.tracking import MlflowClient

    from vltrain.engine.loop import TrainingStopped

    cfg = load_config(None, tiny_overrides(shapes_dir, tmp_path / "run", **{"log.mlflow": True}))
    ends = {"FINISHED": None, "KILLED": TrainingStopped("stop", 15), "FAILED": ValueError("bug")}
    for status, error in ends.items():
        folder = tmp_path / status
        folder.mkdir()
        logger = RunLogger(cfg, folder, enabled=True, start_step=0)
        try:
            try:
                if error is not None:
                    raise error
                logger.finished = True
            finally:
                logger.close()
        except (TrainingStopped, ValueError):
            pass
        run_id = read_ids(folder)["mlflow"]
        client = MlflowClient(f"sqlite:///{folder.resolve() / 'mlruns' / 'mlflow.db'}")
        assert client.get_run(run_id).info.status == status


def test_metric_names_mlflow_accepts() -> None:
    assert metric_name("eval_R@1_mean") == "eval_R_at_1_mean"
    assert metric_name("bad_missing") == "bad_missing"
    assert metric_name("eval_nDCG@10") == "eval_nDCG_at_10"
