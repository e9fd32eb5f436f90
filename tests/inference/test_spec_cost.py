"""`vltrain generate --spec`: the cost model's decision, and the command that uses it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.inference.spec_helpers import EOS, PAD, left_padded_prompts, random_drafter
from vltrain.inference import speculative
from vltrain.inference.spec_cost import (
    CACHE_VERSION,
    SpecCosts,
    cache_path,
    cached_costs,
    choose,
    measure_costs,
    predict,
)


def _round(verify: float, draft: float = 0.0, walk: float = 0.0, compact: float = 0.0) -> dict:
    return {"draft": draft, "verify": verify, "walk": walk, "compact": compact}


def _costs(step: float, chain: dict, tree: dict | None = None, batch: int = 1) -> SpecCosts:
    return SpecCosts(step, {"chain": chain, **({"tree": tree} if tree else {})}, batch)


def test_the_amd_case_does_not_choose_a_32_node_tree() -> None:
    """Issue 57's AMD EPYC rerun: verify of 8/32 tokens at 2.1/3.2x a decode step; with tau
    3.07 a 32-node tree (33 fed tokens) would be slower than greedy decoding."""
    amd = _costs(1.0, _round(2.1, draft=0.1), _round(3.2, draft=0.1))
    tree_only = predict(amd, {"chain": 0.0, "tree": 3.07})
    assert tree_only["tree"] < 1.0 and choose(tree_only) == "none"
    both = predict(amd, {"chain": 2.27, "tree": 3.07})  # the held-out chain tau beside it
    assert choose(both) != "tree"
    # the Intel figures (1.5/2.2x): the drafter pays there
    intel = _costs(1.0, _round(1.5, draft=0.1), _round(2.2, draft=0.1))
    assert choose(predict(intel, {"chain": 2.27, "tree": 3.07})) in ("chain", "tree")


def test_the_walk_and_compaction_are_priced() -> None:
    """Session 37's SmolLM2 drafter on the Intel Xeon (tau 1.82; verify of 8 tokens 1.4x a
    step, drafter 0.17x): priced on draft + verify alone it was predicted 1.16x and picked,
    measured 0.87-0.99x. Its walk (~0.2 step) and compaction belong to every round: with
    them it is no longer worth picking."""
    without = _costs(1.0, _round(1.4, draft=0.17))
    assert predict(without, {"chain": 1.82})["chain"] == pytest.approx(1.82 / 1.57)
    assert choose(predict(without, {"chain": 1.82})) == "chain"
    measured = _costs(1.0, _round(1.4, draft=0.17, walk=0.2, compact=0.05))
    assert measured.round("chain") == pytest.approx(1.82)
    assert predict(measured, {"chain": 1.82})["chain"] == pytest.approx(1.0)
    assert choose(predict(measured, {"chain": 1.82})) == "none"


def test_the_fastest_prediction_wins_and_a_small_gain_is_not_taken() -> None:
    c = _costs(1.0, _round(1.0), _round(1.2, walk=0.025))
    p = predict(c, {"chain": 2.0, "tree": 3.0})
    assert p == pytest.approx({"none": 1.0, "chain": 2.0, "tree": 3.0 / 1.225})
    assert choose(p) == "tree"
    assert choose(predict(c, {"chain": 2.0, "tree": 2.2})) == "chain"  # its round eats its gain
    assert choose({"none": 1.0, "chain": 1.03}) == "none"  # under MIN_GAIN: not worth it
    assert choose(predict(c, {"chain": 0.0, "tree": 0.0})) == "none"  # no measured tau
    assert "tree" not in predict(_costs(1.0, _round(1.0)), {"chain": 2.0, "tree": 3.0})


def test_costs_are_measured_once_and_cached(tmp_path: Path, monkeypatch) -> None:
    calls = []

    def measure() -> SpecCosts:
        calls.append(1)
        return _costs(0.01, _round(0.02, draft=0.001, walk=0.002, compact=0.001), batch=4)

    path = tmp_path / "c" / "spec_costs.json"
    first, fresh = cached_costs("k", measure, path)
    again, fresh2 = cached_costs("k", measure, path)
    assert fresh and not fresh2 and len(calls) == 1 and again == first and again.batch == 4
    cached_costs("other", measure, path)  # another machine / target / drafter / batch: measured
    assert len(calls) == 2 and set(json.loads(path.read_text())) == {"k", "other"}
    table = json.loads(path.read_text())  # an entry of the verify-only model (version 1)
    table["k"] = {"step": 0.01, "draft": 0.001, "verify": {"1": 0.01, "8": 0.02}}
    path.write_text(json.dumps(table))
    _, fresh3 = cached_costs("k", measure, path)
    assert fresh3 and json.loads(path.read_text())["k"]["version"] == CACHE_VERSION
    monkeypatch.delenv("VLTRAIN_SPEC_COSTS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "vltrain" / "spec_costs.json"


def _tiny_target(tmp_path: Path, vocab: list[int] | None = None):
    """A tiny random Llama's native target (the forward `generate` picks for it) and a random
    drafter of block 4 for it; ``vocab``: a reduced draft vocabulary (the lazy walk)."""
    from tests.inference.test_speculative import hf_model
    from vltrain.inference.native_llama import causal_lm_target

    target = causal_lm_target(hf_model("llama", tmp_path), [0, 1], "auto", PAD)
    return target, random_drafter(target, block_size=4, vocab=vocab)


def test_measure_costs_times_real_rounds_at_the_given_batch(tmp_path, monkeypatch) -> None:
    """The rounds are timed by real decoding of the given batch: every part of a round is
    there, a planted 30 ms in the compaction shows in the compaction's part and in the
    round, and only the chain is measured without a tree budget."""
    target, drafter = _tiny_target(tmp_path)
    inputs = left_padded_prompts(3)
    costs = measure_costs(target, drafter, inputs, tree_budget=6, reps=2)
    assert costs.batch == 3 and set(costs.rounds) == {"chain", "tree"} and costs.step > 0
    for way in ("chain", "tree"):
        assert set(costs.rounds[way]) == set(speculative.PHASES)
        assert all(v > 0 for v in costs.rounds[way].values())
    compact = speculative._compact

    def slow(*a, **k):
        time.sleep(0.03)
        return compact(*a, **k)

    monkeypatch.setattr(speculative, "_compact", slow)
    slowed = measure_costs(target, drafter, inputs, reps=2)
    assert set(slowed.rounds) == {"chain"}
    assert slowed.rounds["chain"]["compact"] >= 0.03 and slowed.round("chain") >= 0.03


def test_timed_decoding_records_every_round_and_changes_nothing(tmp_path) -> None:
    """``timed=True`` records each round's parts (one dict per verify) and decodes the same
    tokens with the same acceptance (chain and tree, the lazy walk of a draft vocabulary)."""
    target, drafter = _tiny_target(tmp_path, vocab=[EOS, *range(3, 50)])
    inputs = left_padded_prompts(2)
    for budget in (0, 5):
        plain, st = speculative.speculative_generate(target, drafter, inputs, 12, budget)
        timed, st_t = speculative.speculative_generate(
            target, drafter, inputs, 12, budget, timed=True
        )
        assert timed == plain and st_t.accepted == st.accepted and st.phases == []
        assert len(st_t.phases) == st_t.target_calls - 1  # one per verify
        assert all(tuple(r) == speculative.PHASES for r in st_t.phases)


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

    path = tmp_path / "measured.json"
    monkeypatch.setenv("VLTRAIN_SPEC_COSTS", str(path))
    assert main(draft) == 0
    got = capsys.readouterr()
    assert got.out == plain and "predicted over greedy decoding" in spec_line(got.err)
    assert json.loads(stats.read_text())["spec"] in ("none", "chain", "tree")
    table = json.loads((tmp_path / "measured.json").read_text())
    (entry,) = table.values()  # the command's batch: its 2 prompts (--batch-size 16)
    assert entry["batch"] == 2 and set(entry["rounds"]["chain"]) == set(speculative.PHASES)
    assert "[costs measured now in " in spec_line(got.err)
    assert main(draft) == 0  # the same batch again: read from the cache
    assert spec_line(capsys.readouterr().err).endswith(f"measured before, cached in {path}]")
    assert main([*draft, "--batch-size", "1"]) == 0  # another batch: priced anew, at 1 row
    line = spec_line(capsys.readouterr().err)
    assert "at batch 1:" in line and "[costs measured now in " in line
    table = json.loads((tmp_path / "measured.json").read_text())
    assert sorted(e["batch"] for e in table.values()) == [1, 2]

    def planted(verify: float):
        return lambda *a, **k: _costs(1.0, _round(verify))

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
