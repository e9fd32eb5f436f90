"""bench/bench_drafter.py's timing: per-prompt interleaving of the methods and the merge of
their per-prompt results (the numbers bench/RESULTS.md reports)."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench

pytest.importorskip("transformers")


def test_interleaving_rotates_the_order_and_merges_per_prompt_results() -> None:
    m = load_bench("bench_drafter")
    calls: list[tuple[str, str]] = []

    def method(name: str, tau: float, rounds: int):
        def run(prompts: list[str]) -> dict:
            (q,) = prompts
            calls.append((name, q))
            return {
                "seconds": 1.0 + len(q),
                "tokens": 10,
                "ids": [[len(q)]],
                "tau": tau * len(q),
                "rounds": rounds * len(q),
                "row_tau": [tau * len(q)],
                "draft_ms_per_round": 2.0 * len(q),
                "share_rounds_ge4": 0.5,
            }

        return run

    methods = {"a": method("a", 1.0, 2), ("b", 8, "native"): method("b", 2.0, 3)}
    got = m.interleaved(methods, ["x", "yy", "zzz"], rep=1)
    # prompt by prompt, every method in turn, the first method rotated by prompt and repeat
    assert calls == [("b", "x"), ("a", "x"), ("a", "yy"), ("b", "yy"), ("b", "zzz"), ("a", "zzz")]
    b = got[("b", 8, "native")]
    assert b["seconds"] == 2 + 3 + 4 and b["tokens"] == 30 and b["rounds"] == 3 + 6 + 9
    assert b["ids"] == [[1], [2], [3]] and b["row_tau"] == [2.0, 4.0, 6.0]
    # per-round figures weigh by rounds: tau = sum(accepted) / rounds over all prompts
    assert b["tau"] == pytest.approx((2 * 3 + 4 * 6 + 6 * 9) / 18)
    assert b["draft_ms_per_round"] == pytest.approx((2 * 3 + 4 * 6 + 6 * 9) / 18)
    assert b["share_rounds_ge4"] == pytest.approx(0.5)
    assert b["tokens_per_s"] == pytest.approx(30 / 9)


def test_the_timing_prompts_share_no_topic_with_any_prompt_that_trains_or_picks_a_drafter() -> None:
    """The timed speed-up is measured on prompts nothing was trained, evaluated or chosen on: not
    the training prompts, not HELD_OUT (the run's eval, which picks the checkpoint), not the 64
    held-out prompts (the reported tau) nor the 64 tuning prompts (decoding settings)."""
    m = load_bench("bench_drafter")
    h = load_bench("bench_drafter_heldout")
    qs = m.timing_prompts()
    assert len(qs) == len(set(qs)) == 16
    others = [*m.PROMPTS, *m.HELD_OUT, *h.held_out_prompts(), *h.tuning_prompts()]
    text = " ".join(others).lower()
    assert not set(qs) & set(others)
    assert all(t not in text for t in m.TIMING_TOPICS)
    assert all(any(t in q for q in qs) for t in m.TIMING_TOPICS)
    # the check refuses a topic another set uses
    m.TIMING_TOPICS[0] = "tides"
    with pytest.raises(SystemExit, match="tides"):
        m.timing_prompts()
