"""bench/drafter_curves.py: a run's curve saved to the repository and compared at equal steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench


def _module():
    return load_bench("drafter_curves")


def _fake_run(folder: Path, losses: dict[int, float], evals: dict[int, float]) -> Path:
    folder.mkdir(parents=True)
    lines = [
        json.dumps({"step": s, "loss": v, "train_tau": 1.0 + s / 1000}) for s, v in losses.items()
    ]
    lines += [
        json.dumps({"step": s, "eval_tau": t, "eval_loss": 5.0 - t}) for s, t in evals.items()
    ]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "config.yaml").write_text(
        "stage: drafter\ndrafter:\n  layers: 4\ntrain:\n  max_steps: 20\n"
    )
    return folder


def test_save_keeps_evals_with_the_training_means_before_them(tmp_path: Path, monkeypatch) -> None:
    mod = _module()
    monkeypatch.setattr(mod, "KEEP", tmp_path / "keep")
    losses = {s: float(s) for s in range(1, 21)}  # loss = step: the window mean is known
    run = _fake_run(tmp_path / "run", losses, {10: 1.5, 20: 2.0})
    assert mod.main(["save", str(run), "--name", "r", "--note", "a test"]) == 0
    saved = json.loads((tmp_path / "keep" / "r.json").read_text())
    assert saved["note"] == "a test" and saved["last_step"] == 20
    assert saved["config"]["drafter"] == {"layers": 4}
    curve = mod.curve_of_run(run, window=5)
    assert [e["step"] for e in curve["evals"]] == [10, 20]
    assert curve["evals"][0]["train_loss"] == pytest.approx((6 + 7 + 8 + 9 + 10) / 5)
    assert curve["evals"][1]["train_tau"] == pytest.approx(1.0 + 18 / 1000)
    assert curve["evals"][1]["eval_loss"] == pytest.approx(3.0)


def test_compare_pairs_equal_steps_only(tmp_path: Path, capsys) -> None:
    mod = _module()
    a = _fake_run(tmp_path / "a", {s: 4.0 for s in range(1, 31)}, {10: 1.5, 20: 2.0, 30: 2.2})
    b = _fake_run(tmp_path / "b", {s: 3.5 for s in range(1, 21)}, {10: 1.6, 20: 2.3})
    rows = mod.compare(mod.load(str(a)), mod.load(str(b)))
    assert [r["step"] for r in rows] == [10, 20]  # b never reached step 30
    assert rows[1]["eval_tau"] == pytest.approx((2.0, 2.3, 0.3))
    assert rows[0]["train_loss"][2] == pytest.approx(-0.5)
    assert rows[0]["eval_tau_decode"] == (None, None, None)  # neither logged it: said, not 0
    assert mod.main(["compare", str(a), str(b)]) == 0
    assert "| 20 | " in capsys.readouterr().out


def test_the_committed_round_10_curve_loads() -> None:
    mod = _module()
    curve = mod.load("round10")
    assert [e["step"] for e in curve["evals"]] == list(range(1000, 13000, 1000))
    assert all(set(mod.COLUMNS) <= set(e) for e in curve["evals"])
