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


@pytest.mark.slow
def test_jobs_and_seeds_train_in_processes(shapes_dir, tmp_path, monkeypatch):
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
    # seeds: every point once per seed, in its own folder; seed 0 is the config's own run
    seeded = sweep(str(CONFIG), _overrides(shapes_dir), budgets, sizes[:1], tmp_path / "seeds",
                   jobs=2, seeds=[0, 1])  # fmt: skip
    assert [(r["size"], r["seed"]) for r in seeded] == [("1x32", 0), ("1x32", 1)]
    assert [Path(r["run"]).name for r in seeded] == ["C1.2e09_1x32_s0", "C1.2e09_1x32_s1"]
    assert seeded[0]["loss"] == pytest.approx(one[0]["loss"], abs=1e-6)
    assert seeded[1]["loss"] != pytest.approx(seeded[0]["loss"], abs=1e-4)
    with open(tmp_path / "seeds" / "runs.csv") as f:
        assert [r["seed"] for r in csv.DictReader(f)] == ["0", "1"]
    # a process that fails stops the sweep with its folder named; nothing is half-recorded
    monkeypatch.setattr("sys.executable", "/bin/false")
    with pytest.raises(ConfigError, match="runs failed: .*C1.2e09_1x3"):
        sweep(str(CONFIG), _overrides(shapes_dir), budgets, sizes, tmp_path / "bad", jobs=2)
    assert not (tmp_path / "bad" / "runs.csv").exists()


def _fake_sweep(folder: Path, data: Path, sizes: list[str]) -> Path:
    """A sweep folder's sweep.json and runs.csv (N = the blocks + a fixed 4,000)."""
    folder.mkdir(parents=True)
    meta = {"config": str(CONFIG), "overrides": _overrides(data), "stage": "caption"}
    (folder / "sweep.json").write_text(json.dumps(meta))
    rows = ["budget,size,params,tokens,flops,loss,steps,seed,run"]
    for s in sizes:
        n = parse_sizes([s])[0].block_params + 4000
        rows.append(f"1e11,{s},{n},1e6,1e11,1.0,10,0,x")
    (folder / "runs.csv").write_text("\n".join(rows) + "\n")
    return folder


def test_prediction_stays_in_the_swept_family(shapes_dir, tmp_path):
    """A depth-1 sweep's prediction and its check neighbours are depth-1 widths (the general
    rule would pick 2x96 for ~220k: another family than the one measured); a sweep over
    several depths keeps the general rule."""
    from vltrain.runs.sweep import predicted_config

    fixed_depth = _fake_sweep(tmp_path / "d1", shapes_dir, ["1x32", "1x64", "1x128"])
    got = [
        predicted_config(fixed_depth, n, 1e12, tmp_path / f"p{i}.yaml").label
        for i, n in enumerate((35e3, 88e3, 221e3))
    ]
    assert got == ["1x48", "1x80", "1x128"]
    cfg = load_run_config(tmp_path / "p2.yaml", [])
    assert (cfg.model.text_layers, cfg.model.text_width) == (1, 128)
    assert cfg.train.max_flops == 1e12
    mixed = _fake_sweep(tmp_path / "mixed", shapes_dir, ["1x48", "2x64", "2x96"])
    assert predicted_config(mixed, 221e3, 1e12, tmp_path / "m.yaml").label == "2x96"
