"""`vltrain pipeline`: stages chained by best checkpoint; restart skips; interrupted resumes;
the same under torchrun (2 processes) through caption pretrain -> finetune -> rl."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.conftest import REPO, torchrun_vltrain
from vltrain.cli import main
from vltrain.config.core import ConfigError
from vltrain.runs.pipeline import load_pipeline, plan, run_pipeline


def _pipeline(tmp: Path, data: Path) -> Path:
    """pretrain (3 steps) -> finetune (4 steps, checkpoint every 2) on a 32-image subset."""
    (tmp / "images").mkdir()
    for split, n in (("train", 32), ("val", 4)):
        lines = (data / f"{split}.jsonl").read_text().splitlines()[:n]
        (tmp / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        for line in lines:  # a link out of the data folder would be a path_escape
            rel = json.loads(line)["image"]
            shutil.copy(data / rel, tmp / rel)
    for name in ("caption_pretrain.yaml", "caption_finetune.yaml"):
        shutil.copy(REPO / "configs" / name, tmp / name)
    shared = {
        "data.train": tmp / "train.jsonl",
        "data.eval": tmp / "val.jsonl",
        "data.batch_size": 8,
        "data.num_workers": 0,
        "data.tokenizer_vocab": 400,
        "data.length_buckets": 0,
        "data.max_text_len": 24,
        "caption.max_new_tokens": 5,
        "caption.num_beams": 2,
        "train.eval_every": 0,
        "train.log_every": 1,
        "optim.warmup_steps": 1,
        "log.progress": False,
        "log.tensorboard": False,
    }
    spec = {
        "root": str(tmp / "root"),
        "overrides": [f"{k}={v}" for k, v in shared.items()],
        "stages": [
            {"name": "pre", "config": "caption_pretrain.yaml", "overrides": ["train.max_steps=3"]},
            {
                "name": "ft",
                "config": "caption_finetune.yaml",
                "overrides": {"train.max_steps": 4, "train.save_every": 2},
            },
        ],
    }
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_pipeline_chains_skips_and_resumes(
    shapes_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    path = _pipeline(tmp_path, shapes_dir)
    root = tmp_path / "root"
    stages = load_pipeline(path)
    assert stages[1].cfg.model.init_from == str(root / "pre")  # chained to the previous stage
    rows = run_pipeline(path)
    assert [(r["name"], r["action"], r["summary"]["steps"]) for r in rows] == [
        ("pre", "train", 3),
        ("ft", "train", 4),
    ]
    first_ft = rows[1]["summary"]
    ft_cfg = yaml.safe_load((root / "ft" / "config.yaml").read_text())
    assert ft_cfg["model"]["init_from"] == str(root / "pre")
    report = (root / "report.md").read_text()
    assert "| pre | train | 3 |" in report and "| ft | train | 4 |" in report
    assert "eval_CIDEr-D" in report

    # restart: both finished -> nothing trains (metrics files untouched)
    before = {n: (root / n / "metrics.jsonl").read_text() for n in ("pre", "ft")}
    assert main(["pipeline", str(path)]) == 0
    assert "| pre | skip | 3 |" in (root / "report.md").read_text()
    assert "| ft | skip | 4 |" in capsys.readouterr().out
    assert before == {n: (root / n / "metrics.jsonl").read_text() for n in ("pre", "ft")}

    # only keys a resume may change (run_dir.HARMLESS) differ: still skipped, not retrained;
    # negative control: a key that changes the model's training is not harmless
    spec = yaml.safe_load(path.read_text())
    for extra, actions in (
        (["data.num_workers=1", "data.eval_batch_size=4", "train.log_every=2"], ["skip"] * 2),
        (["optim.lr=0.5"], ["train"] * 2),
    ):
        spec["overrides"] += extra
        (tmp_path / "changed.yaml").write_text(yaml.safe_dump(spec))
        changed = load_pipeline(tmp_path / "changed.yaml")
        plan(changed)
        assert [st.action for st in changed] == actions, extra

    # interrupt the second stage after its step-2 checkpoint: it resumes, the first is skipped
    (root / "ft" / "summary.json").unlink()
    shutil.rmtree(root / "ft" / "checkpoints" / "step_4")
    rows = run_pipeline(path)
    assert [r["action"] for r in rows] == ["skip", "resume"]
    out = capsys.readouterr()
    assert "at step 2" in out.out + out.err  # continued from step_2, not retrained from 0
    assert rows[1]["summary"]["steps"] == 4
    log = (root / "ft" / "metrics.jsonl").read_text()
    # resume reproduces the uninterrupted stage (CPU fp32)
    assert rows[1]["summary"]["val"]["eval_loss"] == pytest.approx(
        first_ft["val"]["eval_loss"], abs=1e-6
    )
    steps = [json.loads(x)["step"] for x in log.splitlines() if "loss" in json.loads(x)]
    assert steps[-1] == 4

    # rank 0's plan decides for every rank: this "rank" sees an unfinished stage, rank 0 a
    # finished one (a lagging shared file system), so it skips too instead of training alone
    (root / "ft" / "summary.json").unlink()
    seen = []

    def rank0_says_skip(action: str, src: int = 0) -> str:
        seen.append(action)
        return "skip"

    monkeypatch.setattr("vltrain.core.distributed.broadcast_object", rank0_says_skip)
    rows = run_pipeline(path)
    assert seen == ["skip", "resume"]  # what this rank alone would have done
    assert [r["action"] for r in rows] == ["skip", "skip"]
    assert (root / "ft" / "metrics.jsonl").read_text() == log  # nothing trained


def test_shipped_pipeline_preset_loads_and_chains() -> None:
    stages = load_pipeline(REPO / "configs" / "pipeline.yaml")
    assert [s.name for s in stages] == ["pretrain", "finetune", "rl"]
    assert [s.cfg.stage for s in stages] == ["caption", "caption", "rl"]
    assert [s.cfg.model.init_from for s in stages] == [
        "",
        "runs/pipeline/pretrain",
        "runs/pipeline/finetune",
    ]
    # the decoder is random at the start: the first stage must train it, not the connector alone
    assert stages[0].cfg.model.freeze == ["vision"]
    assert {s.cfg.caption.strategy for s in stages} == {"greedy"}  # one eval_CIDEr-D column
    assert len({s.cfg.data.max_text_len for s in stages}) == 1  # init_from needs the same


def test_pipeline_errors_name_the_stage(tmp_path: Path) -> None:
    shutil.copy(REPO / "configs" / "caption_pretrain.yaml", tmp_path / "p.yaml")
    bad = {"root": "r", "stages": [{"name": "a", "config": "p.yaml", "overrides": ["optim.lrr=1"]}]}
    (tmp_path / "pl.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="stage 'a'.*optim.lr"):
        load_pipeline(tmp_path / "pl.yaml")
    (tmp_path / "pl.yaml").write_text(yaml.safe_dump({"root": "r", "stagez": []}))
    with pytest.raises(ConfigError, match="stagez"):
        load_pipeline(tmp_path / "pl.yaml")


def _torchrun_pipeline(path: Path, cwd: Path) -> str:
    """`vltrain pipeline PATH` under 2 processes (gloo); returns stdout."""
    return torchrun_vltrain(["pipeline", str(path)], cwd).stdout


@pytest.fixture(scope="module")
def ddp_pipeline(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """pretrain -> finetune -> rl (3 steps each, eval at 2 and 3) of the shipped presets under
    torchrun. Finetune freezes the connector and rl the vision tower (its preset), so their
    weights show which checkpoint each stage started from."""
    tmp = tmp_path_factory.mktemp("ddp_pipeline")
    path = _pipeline(tmp, shapes_dir)
    spec = yaml.safe_load(path.read_text())
    every = ["train.max_steps=3", "train.eval_every=2"]
    spec["stages"] = [
        {
            "name": "pre",
            "config": str(REPO / "configs" / "caption_pretrain.yaml"),
            "overrides": every,
        },
        {
            "name": "ft",
            "config": str(REPO / "configs" / "caption_finetune.yaml"),
            "overrides": [*every, "model.freeze=[connector]"],
        },
        {
            "name": "rl",
            "config": str(REPO / "configs" / "rl.yaml"),
            "overrides": [*every, "data.batch_size=4", "rl.k=2", "rl.max_new_tokens=6"],
        },
    ]
    path.write_text(yaml.safe_dump(spec))
    return path, tmp / "root", _torchrun_pipeline(path, tmp)


def _part(run: Path, ckpt: str, prefix: str) -> dict[str, torch.Tensor]:
    w = load_file(run / "checkpoints" / ckpt / "model.safetensors")
    part = {k: v for k, v in w.items() if k.startswith(prefix)}
    assert part, (run, prefix)
    return part


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_torchrun_pipeline_chains_three_stages_from_best(ddp_pipeline) -> None:
    _, root, out = ddp_pipeline
    names = ("pre", "ft", "rl")
    summaries = {n: json.loads((root / n / "summary.json").read_text()) for n in names}
    for n in names:
        assert summaries[n]["steps"] == 3, n
        ts = torch.load(root / n / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=True)
        assert ts["world_size"] == 2, n
    for prev, n in (("pre", "ft"), ("ft", "rl")):
        cfg = yaml.safe_load((root / n / "config.yaml").read_text())
        assert cfg["model"]["init_from"] == str(root / prev)
    # tiny captioners score CIDEr-D 0 at both evals; the tie keeps step 2 as best, so "best"
    # and "latest" (step 3) are different checkpoints below
    assert summaries["pre"]["best_step"] == summaries["ft"]["best_step"] == 2
    # finetune (connector frozen) holds pretrain's *best* connector, not its latest
    pre_best = _part(root / "pre", "best", "connector.")
    assert not _same(pre_best, _part(root / "pre", "step_3", "connector."))  # control
    for ckpt in ("step_2", "step_3"):
        assert _same(_part(root / "ft", ckpt, "connector."), pre_best)
    # rl (vision frozen) holds finetune's best vision tower, which finetune had changed
    ft_best = _part(root / "ft", "best", "vision.")
    assert not _same(ft_best, _part(root / "ft", "step_3", "vision."))  # control
    assert not _same(ft_best, _part(root / "pre", "best", "vision."))  # control
    assert _same(_part(root / "rl", "step_3", "vision."), ft_best)
    # rank 0 alone prints and writes the report
    report = (root / "report.md").read_text()
    assert report.count("# Pipeline report") == 1
    for n in names:
        assert f"| {n} | train | 3 |" in report
        assert out.count(f"| {n} | train | 3 |") == 1
        assert out.count(f"stage '{n}': train") == 1
    assert "eval_beam_CIDEr-D" in report  # the rl stage's beam eval made it into the table


@pytest.mark.slow
def test_torchrun_pipeline_restart_skips_finished_stages(ddp_pipeline) -> None:
    path, root, _ = ddp_pipeline
    names = ("pre", "ft", "rl")
    before = {n: (root / n / "metrics.jsonl").read_text() for n in names}
    ckpts = {n: sorted(p.name for p in (root / n / "checkpoints").iterdir()) for n in names}
    out = _torchrun_pipeline(path, path.parent)
    for n in names:
        assert out.count(f"stage '{n}': skip") == 1
        assert f"| {n} | skip | 3 |" in (root / "report.md").read_text()
    assert before == {n: (root / n / "metrics.jsonl").read_text() for n in names}
    assert ckpts == {n: sorted(p.name for p in (root / n / "checkpoints").iterdir()) for n in names}
