"""A 2-budget x 2-size isoFLOP sweep end to end: budgets set each run's length, finished runs
are skipped, a killed run resumes to the uninterrupted result, the CSV feeds the fit."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from vltrain.config.core import ConfigError
from vltrain.runs import train
from vltrain.runs.sweep import sweep
from vltrain.scaling.budget import resolve_budget
from vltrain.scaling.sizes import parse_sizes
from vltrain.stages import load_run_config

CONFIG = Path(__file__).parents[2] / "bench" / "scaling" / "caption_sweep.yaml"


def _overrides(data: Path) -> list[str]:
    return [
        f"data.train={data / 'train.jsonl'}",
        f"data.eval={data / 'val.jsonl'}",
        "data.batch_size=16",
        "optim.warmup_steps=1",
        "train.save_every=2",
        "train.keep_last=5",
    ]


def test_budget_sets_the_schedule(shapes_dir, tmp_path):
    base = _overrides(shapes_dir) + [f"run.out_dir={tmp_path / 'r'}"]
    cfg = resolve_budget(load_run_config(CONFIG, base + ["train.max_samples=100"]))
    assert cfg.train.max_steps == 7  # ceil(100 / 16)
    from vltrain.scaling.budget import config_flops

    per_step = config_flops(cfg).per_sample * 16
    cfg = resolve_budget(load_run_config(CONFIG, base + [f"train.max_flops={10.5 * per_step}"]))
    assert cfg.train.max_steps == 10
    with pytest.raises(ConfigError, match="both set"):
        load_run_config(CONFIG, base + ["train.max_samples=10", "train.max_flops=1e9"])
    with pytest.raises(ConfigError, match="raise the budget"):
        resolve_budget(load_run_config(CONFIG, base + ["train.max_flops=1e3"]))


def test_micro_sweep_resumes_a_killed_run(shapes_dir, tmp_path):
    out = tmp_path / "sweep"
    sizes = parse_sizes(["1x32,1x64"])
    budgets = [1.2e9, 2.4e9]
    rows = sweep(str(CONFIG), _overrides(shapes_dir), budgets, sizes, out)
    assert len(rows) == 4
    for r in rows:  # each run used its budget: within one step's FLOPs below it
        per_step = r["flops"] / r["steps"]
        assert r["budget"] - per_step < r["flops"] <= r["budget"]
    assert rows[0]["steps"] > rows[1]["steps"]  # the smaller model gets more steps
    killed = Path(rows[2]["run"])
    done_loss = rows[2]["loss"]
    # kill -9 after an early checkpoint: the later ones and the summary never happened
    steps = sorted(int(p.name.split("_")[1]) for p in (killed / "checkpoints").glob("step_*"))
    assert len(steps) >= 3
    for s in steps[-2:]:
        shutil.rmtree(killed / "checkpoints" / f"step_{s}")
    (killed / "summary.json").unlink()
    calls = []

    def counting(cfg):
        calls.append((cfg.run.out_dir, cfg.train.resume))
        return train(cfg)

    again = sweep(str(CONFIG), _overrides(shapes_dir), budgets, sizes, out, train_fn=counting)
    assert calls == [(str(killed), True)]  # finished runs skipped, the killed one resumed
    assert again[2]["loss"] == pytest.approx(done_loss, abs=1e-6)  # exact resume
    assert json.loads((killed / "summary.json").read_text())["steps"] == rows[2]["steps"]
    with open(out / "runs.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["size"] for r in table] == ["1x32", "1x64"] * 2
    assert {"params", "tokens", "flops", "loss"} <= set(table[0])


def test_jobs_train_in_processes_with_the_same_rows(shapes_dir, tmp_path, monkeypatch):
    sizes = parse_sizes(["1x32,1x48"])
    budgets = [1.2e9]
    one = sweep(str(CONFIG), _overrides(shapes_dir), budgets, sizes, tmp_path / "one")
    two = sweep(str(CONFIG), _overrides(shapes_dir), budgets, sizes, tmp_path / "two", jobs=2)
    assert [r["size"] for r in two] == ["1x32", "1x48"]
    for a, b in zip(one, two, strict=True):
        # each run is the same deterministic run in its own process: same steps, same loss
        assert (a["steps"], a["params"], a["flops"]) == (b["steps"], b["params"], b["flops"])
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert (Path(b["run"]) / "sweep_process.log").is_file()
    # a process that fails stops the sweep with its folder named; nothing is half-recorded
    monkeypatch.setattr("sys.executable", "/bin/false")
    with pytest.raises(ConfigError, match="runs failed: .*C1.2e09_1x3"):
        sweep(str(CONFIG), _overrides(shapes_dir), budgets, sizes, tmp_path / "bad", jobs=2)
    assert not (tmp_path / "bad" / "runs.csv").exists()
