"""Real tiny runs through the loop's doctor hook (what reaches the console), `vltrain doctor`
exit codes, the report (ablation verdicts, rounded numbers, grouped findings)."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import tiny_overrides
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.config.schema import dump_config
from vltrain.diagnostics import checks
from vltrain.diagnostics.doctor import DoctorAbort
from vltrain.diagnostics.record import Finding, StepRecord
from vltrain.engine import loop
from vltrain.runs import run_report, train
from vltrain.runs.run_report import (
    RunData,
    ablation,
    build_report,
    grouped_findings,
    rounded,
    write_report,
)


@pytest.fixture(scope="module")
def clean_run(shapes_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "run"
    train(load_config(None, tiny_overrides(shapes_dir, out, **{"train.max_steps": 8})))
    return out


def test_clean_run_writes_records_and_no_warnings(clean_run, capsys):
    rows = [json.loads(x) for x in (clean_run / "doctor_steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(8))
    assert all(r["stepped"] and r["sample_ids"] and r["update_ratio"] for r in rows)
    assert json.loads((clean_run / "run_card.json").read_text())["torch"]
    found = [json.loads(x) for x in (clean_run / "doctor.jsonl").read_text().splitlines()]
    assert [f for f in found if f["severity"] != "info"] == []
    assert main(["doctor", str(clean_run)]) == 0
    assert "no findings" in capsys.readouterr().out


def test_lr_not_applied_aborts_with_fail_on_error(shapes_dir, tmp_path, monkeypatch):
    real = loop.set_lr

    def broken_set_lr(optimizer, step, max_steps, cfg):  # a scheduler bug: LR written as 0
        lr = real(optimizer, step, max_steps, cfg)
        for g in optimizer.param_groups:
            g["lr"] = 0.0
        return lr

    monkeypatch.setattr(loop, "set_lr", broken_set_lr)
    extra = {"doctor.fail_on": "error", "train.max_steps": 4}
    with pytest.raises(DoctorAbort, match="lr_mismatch"):
        train(load_config(None, tiny_overrides(shapes_dir, tmp_path / "run", **extra)))
    found = [json.loads(x) for x in (tmp_path / "run" / "doctor.jsonl").read_text().splitlines()]
    assert {(f["check"], f["step"]) for f in found} >= {("lr_mismatch", 0)}


def test_console_prints_warnings_and_info_stays_in_the_file(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """Info findings (a dozen minor blips per short run) go to doctor.jsonl, not the console."""

    def blips(self: checks.Spikes, rec: StepRecord) -> list[Finding]:  # info each step, 1 warn
        found = [Finding("info", "grad_spike", rec.step, f"grad blip at step {rec.step}")]
        if rec.step == 2:
            found.append(Finding("warn", "loss_spike", rec.step, "a loss spike"))
        return found

    monkeypatch.setattr(checks.Spikes, "observe", blips)
    out = tmp_path / "run"
    train(load_config(None, tiny_overrides(shapes_dir, out, **{"train.max_steps": 4})))
    found = [json.loads(x) for x in (out / "doctor.jsonl").read_text().splitlines()]
    # negative control: there were info findings to print, and they are all kept in the file
    assert [(f["severity"], f["step"]) for f in found if f["check"] == "grad_spike"] == [
        ("info", s) for s in range(4)
    ]
    console = [x for x in capsys.readouterr().err.splitlines() if x.startswith("doctor:")]
    assert console == ["doctor: WARN  step 2 [loss_spike] a loss spike"]


def test_findings_before_the_first_step_reach_the_console(
    shapes_dir: Path, tmp_path: Path, capsys
) -> None:
    """The checks run before the first step (eval data inside the training data here) print
    as the step checks do; they used to reach doctor.jsonl only."""
    out = tmp_path / "run"
    extra = {"train.max_steps": 2, "data.eval": shapes_dir / "train.jsonl"}
    train(load_config(None, tiny_overrides(shapes_dir, out, **extra)))
    found = [json.loads(x) for x in (out / "doctor.jsonl").read_text().splitlines()]
    assert [(f["check"], f["step"]) for f in found if f["severity"] == "error"] == [
        ("eval_overlap", 0)
    ]
    console = [x for x in capsys.readouterr().err.splitlines() if x.startswith("doctor:")]
    assert len(console) == 1 and "[eval_overlap]" in console[0] and "ERROR" in console[0]


def _fake_run(path: Path, losses: list[float]) -> Path:
    path.mkdir(parents=True)
    cfg = load_config(None, ["train.save_every=0", "optim.warmup_steps=0"])  # judged from step 0
    dump_config(cfg, path / "config.yaml")
    rows = [
        {"step": i, "loss": x, "grad_norm": 1.0 + 0.01 * (i % 3), "lr": 1e-3}
        for i, x in enumerate(losses)
    ]
    (path / "doctor_steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_doctor_exit_codes_and_json(tmp_path, capsys):
    calm = [2.0 - 0.01 * i + 0.005 * (i % 2) for i in range(30)]
    assert main(["doctor", str(_fake_run(tmp_path / "ok", calm))]) == 0
    spiky = list(calm)
    spiky[20] = 6.0
    assert main(["doctor", str(_fake_run(tmp_path / "warn", spiky))]) == 1
    capsys.readouterr()
    zero = calm[:10] + [0.0] * 5
    assert main(["doctor", "--json", str(_fake_run(tmp_path / "err", zero))]) == 2
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines and all({"severity", "check", "step", "message"} <= set(x) for x in lines)
    assert ("error", "degenerate_loss", 10) in {
        (x["severity"], x["check"], x["step"]) for x in lines
    }


def test_report_is_self_contained_with_ablation(clean_run, tmp_path):
    twin = tmp_path / "seed1"
    shutil.copytree(clean_run, twin)
    cfg = (twin / "config.yaml").read_text().replace("seed: 0", "seed: 1")
    (twin / "config.yaml").write_text(cfg)
    html = build_report([str(clean_run), str(twin)])
    assert html.count("<svg") >= 4 and "<polyline" in html
    assert "config diff" in html and "ablation" in html and "run.seed" in html
    # the twin differs in seed only, with the same metrics: no change beyond seed noise
    assert "<td>within seed noise (seed std 0)</td>" in html
    stripped = html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "http://" not in stripped and "https://" not in stripped and "<script" not in stripped
    out = write_report([str(clean_run)], tmp_path / "r" / "report.html")
    assert out.read_text().startswith("<!DOCTYPE html>")


def _metric_run(path: Path, value: float, **config: object) -> Path:
    """A finished run as the report reads it: its config and one eval of eval_R@1_mean."""
    path.mkdir(parents=True)
    dump_config(load_config(None, [f"{k}={v}" for k, v in config.items()]), path / "config.yaml")
    (path / "metrics.jsonl").write_text(json.dumps({"step": 8, "eval_R@1_mean": value}) + "\n")
    (path / "summary.json").write_text(json.dumps({"best_metric": "eval_R@1_mean"}))
    return path


def test_report_of_a_tune_study_shows_its_trials_table(tmp_path: Path) -> None:
    """A study folder holds trials.csv and one run per trial; the report used to look for
    trials.csv inside each trial run, so the table never showed."""
    study = tmp_path / "s1"
    for n, value in enumerate((0.50, 0.60)):
        _metric_run(study / f"trial_{n:04d}", value, **{"optim.lr": 0.001 * (n + 1)})
    trials = "number,state,value,params.optim.lr\n0,COMPLETE,0.5,0.001\n1,PRUNED,0.6,0.002\n"
    (study / "trials.csv").write_text(trials)
    (study / "summary.json").write_text(json.dumps({"best": {"number": 0}}))
    html = build_report([str(study)])
    assert "<h2>tune study s1: trials</h2>" in html
    assert '<tr class="best"><td>0</td><td>COMPLETE</td><td>0.5</td>' in html
    assert "<td>1</td><td>PRUNED</td>" in html and "params.optim.lr" in html
    assert "<h2>trial_0000</h2>" in html and "<h2>trial_0001</h2>" in html  # its runs follow
    # negative control: the same runs given one by one are not a study
    runs = [str(study / "trial_0000"), str(study / "trial_0001")]
    assert "tune study" not in build_report(runs) and "PRUNED" not in build_report(runs)


def verdicts(runs: list[Path]) -> dict[str, str]:
    """{variant: the ablation's verdict, up to its first colon or parenthesis}."""
    _, rows = ablation([RunData(p) for p in runs])
    return {row[0]: row[-1].split(":")[0].split(" (")[0] for row in rows}


def test_ablation_verdicts_weigh_the_delta_against_the_seed_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _metric_run(tmp_path / "base", 0.50)
    seed1 = _metric_run(tmp_path / "seed1", 0.52, **{"run.seed": 1})  # seed std 0.0141
    lr = _metric_run(tmp_path / "lr", 0.60, **{"optim.lr": 0.002})  # delta 0.10 > 2 std
    wd = _metric_run(tmp_path / "wd", 0.51, **{"optim.weight_decay": 0.2})  # 0.01 < 2 std
    runs = [base, seed1, lr, wd]
    want = {"seed1": "within seed noise", "lr": "real", "wd": "within seed noise"}
    assert verdicts(runs) == want
    assert verdicts([base, lr]) == {"lr": "no seed spread"}
    # the verdicts follow the numbers: seeds 0.30 apart make the same +0.10 noise
    noisy = _metric_run(tmp_path / "noisy", 0.80, **{"run.seed": 1})
    assert verdicts([base, noisy, lr])["lr"] == "within seed noise"
    # negative control: an ablation that loses the seed spread calls every change real, and
    # the comparison above catches it
    lost = SimpleNamespace(stdev=lambda values: 0.0, fmean=statistics.fmean)
    monkeypatch.setattr(run_report, "statistics", lost)
    assert verdicts(runs) == {"seed1": "real", "lr": "real", "wd": "real"} != want


def test_report_numbers_are_rounded_and_repeated_findings_grouped() -> None:
    assert rounded(0.123456789) == "0.1235" and rounded(2.0) == "2"
    assert rounded(12345.678) == "12346" and rounded("0.000123456") == "0.0001235"
    assert rounded(3) == 3 and rounded("007") == "007" and rounded("lr=1e-3") == "lr=1e-3"
    assert rounded(float("nan")) != rounded(float("nan"))  # non-finite: left as they are
    found = [
        Finding("info", "grad_spike", s, f"grad norm {1.5 + s / 10:.4g} is {s} MADs up", "fix")
        for s in range(10, 22)
    ]
    found.insert(3, Finding("warn", "loss_spike", 13, "loss 9.1 is 12 MADs up", "look"))
    rows = grouped_findings(found)
    assert [r[:2] for r in rows] == [["warn", 1], ["info", 12]]  # the most severe first
    assert rows[1][2] == "10, 11, 12, 13, 14, 15, 16, 17, ... 21"
    assert rows[1][4] == "grad norm 2.5 is 10 MADs up"  # the first one's message
