"""Models and datasets by hub id, offline: a tiny CLIP, a tiny Llama and a tiny parquet dataset
saved in hub-cache layout in a temp HF_HOME, read with HF_HUB_OFFLINE=1 (nothing is ever
downloaded: any request would raise huggingface_hub's OfflineModeIsEnabled)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pq = pytest.importorskip("pyarrow.parquet")

from huggingface_hub import constants  # noqa: E402
from PIL import Image  # noqa: E402

from tests.conftest import REPO, tiny_overrides  # noqa: E402
from tests.models.test_hf_embedders import clip_dir  # noqa: E402, F401  (fixture)
from tests.stages.drafter_fixtures import tiny_lm  # noqa: E402
from vltrain.cli import main  # noqa: E402
from vltrain.config import load_config  # noqa: E402
from vltrain.config.core import ConfigError  # noqa: E402
from vltrain.config.hub_ids import is_model_id, parse_dataset  # noqa: E402
from vltrain.core import hub  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CLIP_ID, LM_ID, DATA_ID = "tiny-org/tiny-clip", "tiny-org/tiny-llama", "tiny-org/shapes"
COLORS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "gray": (128,) * 3}


def put_in_cache(hub_cache: Path, repo_type: str, repo_id: str, files: Path) -> Path:
    """Copy the folder `files` into the hub cache as the main revision of `repo_id`."""
    repo = hub_cache / "--".join([f"{repo_type}s", *repo_id.split("/")])
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def write_parquet_splits(folder: Path, rows: int = 8) -> None:
    """data/{train,validation}-00000-of-00001.parquet: PNG bytes (HF Image storage) + captions,
    the layout the hub's parquet datasets use."""
    import pyarrow as pa

    (folder / "data").mkdir(parents=True)
    for split in ("train", "validation"):
        images, texts = [], []
        for i in range(rows):
            name = list(COLORS)[i % len(COLORS)]
            buf = io.BytesIO()
            Image.new("RGB", (20 + i, 24), COLORS[name]).save(buf, "PNG")
            images.append({"bytes": buf.getvalue(), "path": None})
            texts.append(f"a {name} picture number {i}")
        table = pa.table({"image": images, "text": texts})
        pq.write_table(table, folder / "data" / f"{split}-00000-of-00001.parquet")


@pytest.fixture(scope="module")
def hub_files(tmp_path_factory: pytest.TempPathFactory, clip_dir: str) -> dict[str, Path]:  # noqa: F811
    """The three repositories' files, written once (a tiny CLIP, a tiny Llama, a dataset)."""
    root = tmp_path_factory.mktemp("hub_files")
    data = root / "data"
    write_parquet_splits(data)
    return {"clip": Path(clip_dir), "lm": tiny_lm(root / "lm", layers=2), "data": data}


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp HF_HOME with an empty hub cache, HF_HUB_OFFLINE=1, in this process: the
    variables and the values huggingface_hub and datasets read from them at import."""
    home = tmp_path / "hf_home"
    (home / "hub").mkdir(parents=True)
    for var, value in (("HF_HOME", home), ("HF_HUB_OFFLINE", 1), ("HF_DATASETS_OFFLINE", 1)):
        monkeypatch.setenv(var, str(value))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return home


def test_hub_id_syntax_and_a_local_path_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert is_model_id("openai/clip-vit-base-patch32")
    for not_an_id in ("", "clip", "/abs/org/name", "./org/name", "a/b/c", "org/name.gguf"):
        assert not is_model_id(not_an_id), not_an_id
    assert parse_dataset("hf://datasets/org/name") == ("org/name", None)
    assert parse_dataset("hf://datasets/org/name:train[:10%]") == ("org/name", "train[:10%]")
    assert parse_dataset("hf://datasets/org/name/data/shard-{0..3}.tar") is None  # tar shards
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)  # a relative folder spelled like an id
    assert not is_model_id("org/name")


def test_loading_a_config_pins_the_split_of_every_hub_dataset(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "data.train=hf://datasets/org/name",
            "data.eval=hf://datasets/org/name",
            "data.test=hf://datasets/org/name:test[:5]",
            "data.split=train[:80%]",
        ],
    )
    assert cfg.data.train == "hf://datasets/org/name:train[:80%]"
    assert cfg.data.eval == "hf://datasets/org/name:validation"
    assert cfg.data.test == "hf://datasets/org/name:test[:5]"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"data": {"train": cfg.data.train}}))
    assert load_config(tmp_path / "c.yaml").data.train == cfg.data.train  # idempotent
    with pytest.raises(ConfigError, match="data.split"):  # a split nothing reads
        load_config(None, ["data.train=x.jsonl", "data.split=validation"])


def test_a_hub_model_and_dataset_train_offline_from_the_cache(
    hf_home: Path, hub_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    put_in_cache(hf_home / "hub", "model", CLIP_ID, hub_files["clip"])
    put_in_cache(hf_home / "hub", "dataset", DATA_ID, hub_files["data"])
    run = tmp_path / "run"
    over = tiny_overrides(
        tmp_path,
        run,
        **{
            "model.kind": "hf_clip",
            "model.path": CLIP_ID,
            "data.train": f"hf://datasets/{DATA_ID}",
            "data.eval": f"hf://datasets/{DATA_ID}",
            "data.batch_size": 4,
            "train.max_steps": 2,
            "optim.warmup_steps": 0,
        },
    )
    assert main(["train", _config(tmp_path), *over]) == 0, capsys.readouterr().err
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["path"] == CLIP_ID  # the id, not the cache's absolute path
    assert saved["data"]["train"] == f"hf://datasets/{DATA_ID}:train"
    assert saved["data"]["eval"] == f"hf://datasets/{DATA_ID}:validation"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] == 2 and summary["val"]["eval_n_images"] == 8
    assert not any(summary["bad_samples"].values())
    exported = run / "checkpoints" / "step_2" / "hf_model"
    assert (exported / "tokenizer.json").is_file()  # processor files re-saved from the cache


def test_a_hub_causal_lm_target_loads_from_the_cache(
    hf_home: Path, hub_files: dict[str, Path]
) -> None:
    from vltrain.inference.hf_target import load_hf_causal_lm

    with pytest.raises(ConfigError, match="model.target"):
        load_hf_causal_lm(LM_ID)
    put_in_cache(hf_home / "hub", "model", LM_ID, hub_files["lm"])
    model, tok = load_hf_causal_lm(LM_ID)
    assert model.config.num_hidden_layers == 2 and tok("say hello")["input_ids"]


def _config(folder: Path) -> str:
    """A config file for the CLI: the contrastive stage, everything else from overrides."""
    (folder / "hub.yaml").write_text("stage: contrastive\n")
    return str(folder / "hub.yaml")


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vltrain: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_a_hub_id_missing_from_the_cache_offline_is_one_line_at_load(
    hf_home: Path, hub_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run = tmp_path / "run"
    hf = {"model.kind": "hf_clip", "model.path": CLIP_ID, "data.batch_size": 4}
    over = tiny_overrides(hub_files["data"], run, **hf)
    err = _error(capsys, ["train", _config(tmp_path), *over])
    folder = hf_home / "hub" / "models--tiny-org--tiny-clip"
    assert f"'model.path'='{CLIP_ID}'" in err and str(folder) in err
    assert "HF_HUB_OFFLINE" in err and "HF_HOME" in err and f"hf download {CLIP_ID}" in err
    assert not run.exists()  # refused before anything was written

    put_in_cache(hf_home / "hub", "model", CLIP_ID, hub_files["clip"])
    missing = {**hf, "data.train": "hf://datasets/tiny-org/nothing-here"}
    err = _error(capsys, ["train", _config(tmp_path), *tiny_overrides(tmp_path, run, **missing)])
    assert "datasets--tiny-org--nothing-here" in err and "HF_HUB_OFFLINE" in err
    assert "--repo-type dataset" in err

    put_in_cache(hf_home / "hub", "dataset", DATA_ID, hub_files["data"])
    split = {
        **hf,
        "data.train": f"hf://datasets/{DATA_ID}",
        "data.eval": f"hf://datasets/{DATA_ID}:test",
    }
    err = _error(capsys, ["train", _config(tmp_path), *tiny_overrides(tmp_path, run, **split)])
    assert "no split 'test'" in err and "train, validation" in err
    assert not run.exists()


def test_the_local_files_only_switch_is_named_when_online(
    hf_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, model.local_files_only=true is what forbids the download (and the error says
    how to allow it); with it false the check passes and transformers would download."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    with pytest.raises(ConfigError, match="set model.local_files_only=false"):
        hub.check_model_id(CLIP_ID, "model.path", local_files_only=True)
    hub.check_model_id(CLIP_ID, "model.path", local_files_only=False)
    with pytest.raises(ConfigError, match="model.target is read from the cache only"):
        hub.check_model_id(LM_ID, "model.target", local_files_only=True)


def test_a_fresh_process_reads_hf_home_and_hf_hub_offline_from_the_environment(
    tmp_path: Path, hub_files: dict[str, Path]
) -> None:
    """No in-process patching: the variables alone decide where the cache is and that nothing
    is downloaded (the cached model passes, the missing dataset is refused at load)."""
    home = tmp_path / "home"
    put_in_cache(home / "hub", "model", CLIP_ID, hub_files["clip"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    over = tiny_overrides(
        tmp_path,
        tmp_path / "run",
        **{
            "model.kind": "hf_clip",
            "model.path": CLIP_ID,
            "data.train": f"hf://datasets/{DATA_ID}",
        },
    )
    res = subprocess.run(
        [sys.executable, "-m", "vltrain", "train", _config(tmp_path), *over],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    assert (
        "'data.train'" in res.stderr
        and str(home / "hub" / "datasets--tiny-org--shapes") in res.stderr
    )
    assert "model.path" not in res.stderr  # the cached model passed the same check
