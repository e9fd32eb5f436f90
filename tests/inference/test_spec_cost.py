"""`vltrain generate --spec`: the cost model's decision, and the command that uses it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vltrain.inference.spec_cost import SpecCosts, cache_path, cached_costs, choose, predict


def _costs(step: float, verify: dict[int, float], draft: float = 0.0) -> SpecCosts:
    return SpecCosts(step=step, draft=draft, verify={1: step, **verify})


def test_the_amd_case_does_not_choose_a_32_node_tree() -> None:
    """Issue 57's AMD EPYC rerun: verify of 8/16/32 tokens at 2.1/2.5/3.2x a decode step;
    with tau 3.07 a 32-node tree (33 fed tokens) would be slower than greedy decoding."""
    amd = _costs(1.0, {8: 2.1, 16: 2.5, 32: 3.2}, draft=0.1)
    tree_only = predict(amd, 8, 0.0, 3.07, 32)
    assert tree_only["tree"] < 1.0 and choose(tree_only) == "none"
    both = predict(amd, 8, 2.27, 3.07, 32)  # the held-out chain tau beside it
    assert choose(both) != "tree"
    # the Intel figures (1.5/1.8/2.2x): the drafter pays there
    intel = _costs(1.0, {8: 1.5, 16: 1.8, 32: 2.2}, draft=0.1)
    assert choose(predict(intel, 8, 2.27, 3.07, 32)) in ("chain", "tree")


def test_the_fastest_prediction_wins_and_a_small_gain_is_not_taken() -> None:
    c = _costs(1.0, {8: 1.0, 16: 1.2, 32: 1.6})
    p = predict(c, 8, 2.0, 3.0, 16)
    assert p == pytest.approx({"none": 1.0, "chain": 2.0, "tree": 3.0 / 1.225})
    assert choose(p) == "tree"
    assert choose(predict(c, 8, 2.0, 2.2, 16)) == "chain"  # the tree's verify eats its gain
    assert choose({"none": 1.0, "chain": 1.03}) == "none"  # under MIN_GAIN: not worth it
    assert choose(predict(c, 8, 0.0, 0.0, 16)) == "none"  # no measured tau: nothing to pick
    assert c.verify_at(12) == pytest.approx(1.1) and c.verify_at(48) == pytest.approx(2.0)


def test_costs_are_measured_once_and_cached(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def measure() -> SpecCosts:
        calls.append(1)
        return _costs(0.01, {8: 0.02, 16: 0.03, 32: 0.05})

    path = tmp_path / "c" / "spec_costs.json"
    first, fresh = cached_costs("k", measure, path)
    again, fresh2 = cached_costs("k", measure, path)
    assert fresh and not fresh2 and len(calls) == 1 and again == first
    cached_costs("other", measure, path)  # another machine / target / drafter: measured
    assert len(calls) == 2 and set(json.loads(path.read_text())) == {"k", "other"}
    monkeypatch.delenv("VLTRAIN_SPEC_COSTS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "vltrain" / "spec_costs.json"


def test_generate_spec_auto_says_what_it_picked(tmp_path, capsys, monkeypatch) -> None:
    """A tiny drafter run (its eval records tau): auto measures this machine once (cached),
    says in one line what it picked; the lines equal greedy decoding's whichever it picks;
    planted costs where the drafter pays pick it, where it does not pick none and say so."""
    from tests.stages.drafter_fixtures import TEXTS, tiny_lm
    from tests.stages.test_drafter_stage import _train_args
    from vltrain.cli import main
    from vltrain.inference import spec_cost

    lm = tiny_lm(tmp_path / "lm", layers=4)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": t, "completion": t}) + "\n" for t in TEXTS))
    run = tmp_path / "run"
    args = _train_args(lm, tmp_path, run, "train.max_steps=2", "drafter.eval_prompts=2")
    assert main([a.replace(f"{tmp_path}/answers.jsonl", str(data)) for a in args]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS[:2]))
    base = ["generate", "--model", str(lm), "--prompts", str(prompts), "--max-new-tokens", "8"]
    capsys.readouterr()
    assert main(base) == 0
    plain = capsys.readouterr().out
    stats = tmp_path / "stats.json"
    draft = [*base, "--draft", str(run), "--stats", str(stats)]

    def spec_line(err: str) -> str:
        lines = [x for x in err.splitlines() if x.startswith("vltrain: --spec auto:")]
        assert len(lines) == 1, err
        return lines[0]

    monkeypatch.setenv("VLTRAIN_SPEC_COSTS", str(tmp_path / "measured.json"))
    assert main(draft) == 0
    got = capsys.readouterr()
    assert got.out == plain and "predicted over greedy decoding" in spec_line(got.err)
    assert json.loads(stats.read_text())["spec"] in ("none", "chain", "tree")
    table = json.loads((tmp_path / "measured.json").read_text())
    assert len(table) == 1 and set(next(iter(table.values()))["verify"]) == {"1", "8", "16", "32"}

    def planted(verify: float):
        return lambda *a, **k: _costs(1.0, {8: verify, 16: verify, 32: verify})

    monkeypatch.setattr(spec_cost, "measure_costs", planted(1e-3))  # verify nearly free
    monkeypatch.setenv("VLTRAIN_SPEC_COSTS", str(tmp_path / "cheap.json"))
    assert main(draft) == 0
    got = capsys.readouterr()
    assert got.out == plain and spec_line(got.err).startswith("vltrain: --spec auto: chain (")
    assert json.loads(stats.read_text())["rounds"] > 0
    monkeypatch.setattr(spec_cost, "measure_costs", planted(50.0))  # verify very dear
    monkeypatch.setenv("VLTRAIN_SPEC_COSTS", str(tmp_path / "dear.json"))
    assert main(draft) == 0
    got = capsys.readouterr()
    assert got.out == plain and "does not pay on this machine" in spec_line(got.err)
    st = json.loads(stats.read_text())
    assert st["spec"] == "none" and st["rounds"] == 0
    assert main([*draft, "--spec", "chain"]) == 0  # forced: no line, the drafter runs
    got = capsys.readouterr()
    assert got.out == plain and "--spec auto" not in got.err
    assert json.loads(stats.read_text())["rounds"] > 0
