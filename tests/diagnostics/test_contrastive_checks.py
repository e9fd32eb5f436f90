"""The `contrastive_chance` check: loss at chance with a vanishing gradient, past warmup.

Golden series are recorded runs (Intel Xeon CPU, torch 2.13.0+cpu): the reduced quickstart CLIP
stage (`--steps 60 --batch-size 32`, warmup 12) collapsed at the LR peak and sat at ln 32 with
its grad norm down 1000x; the full quickstart (batch 128, warmup 50) also starts at chance, its
grad norm falls 47x while the LR ramps, and then it learns; bench_doctor.py's batch-32 clean
contrastive run (warmup 2) sits at chance for 7 steps with its grad norm down 300x, then climbs
out and learns (3.47 -> 3.15 by step 29).
"""

from __future__ import annotations

import json
import math
import random

import pytest

from vltrain.config import load_config
from vltrain.config.schema import dump_config
from vltrain.diagnostics.contrastive_checks import config_chance
from vltrain.diagnostics.doctor import Doctor, analyse_run
from vltrain.diagnostics.record import StepRecord
from vltrain.objectives.chance import infonce_chance

REDUCED_QS_LOSS = [
    3.5562, 3.5734, 3.5538, 3.481, 3.4683, 3.4674, 3.4664, 3.4656, 3.4652, 3.4652, 3.4649,
    3.4637, 3.4747, 3.5063, 3.4664, 3.4655, 3.4657, 3.4658, 3.4659, 3.4659, 3.4659, 3.4659,
    3.4658, 3.4658, 3.4658, 3.4658, 3.4658, 3.4658, 3.4658, 3.4658,
]  # fmt: skip
REDUCED_QS_GRAD = [
    9.51, 8.36, 4.52, 1.01, 0.191, 0.101, 0.0571, 0.0295, 0.0322, 0.0205, 0.0252, 0.088, 0.655,
    1.18, 0.0887, 0.0122, 0.00797, 0.00374, 0.00398, 0.00337, 0.00364, 0.00284, 0.00186,
    0.00206, 0.00127, 0.00113, 0.00113, 0.00121, 0.00113, 0.00134,
]  # fmt: skip
FULL_QS_LOSS = [
    4.959, 4.8756, 4.8834, 4.8788, 4.8597, 4.8522, 4.8518, 4.8478, 4.8423, 4.8408, 4.8371,
    4.8126, 4.776, 4.6626, 4.6331, 4.9112, 4.8051, 4.8547, 4.7209, 4.6343, 4.6023, 4.5304,
    4.4087, 4.6013, 4.5647, 4.8326, 4.8243, 4.4001, 4.4687, 4.6161, 4.5419, 4.5745, 4.412,
    4.5503, 4.2819, 4.5447, 4.4426, 4.3263, 4.2051, 4.3497,
]  # fmt: skip
FULL_QS_GRAD = [
    10.9, 3.35, 4.03, 2.99, 1.11, 0.594, 0.47, 0.261, 0.261, 0.23, 0.305, 0.716, 1.06, 2.23,
    8.66, 18.2, 20.8, 47.3, 14.5, 16.9, 23.6, 4.26, 11.2, 23.1, 9.87, 26.9, 24.3, 5.78, 6.95,
    14.9, 12.6, 5.44, 4.19, 10.5, 7.47, 17.2, 16.7, 6.44, 1.97, 10.4,
]  # fmt: skip

BATCH32_LOSS = [
    3.5559, 3.7358, 3.601, 3.4735, 3.4649, 3.4652, 3.4652, 3.463, 3.4624, 3.4648, 3.4652,
    3.4566, 3.4578, 3.4565, 3.4522, 3.4507, 3.4527, 3.431, 3.4018, 3.4222, 3.3785, 3.3615,
    3.2891, 3.2635, 3.2606, 3.2174, 3.2683, 3.2044, 3.2344, 3.1457,
]  # fmt: skip
BATCH32_GRAD = [
    10.5, 16.1, 5.83, 0.704, 0.259, 0.172, 0.0956, 0.0949, 0.0913, 0.066, 0.0535, 0.125, 0.104,
    0.148, 0.166, 0.202, 0.168, 0.454, 0.639, 0.741, 1.07, 1.74, 1.64, 2.1, 1.76, 3.46, 3.57,
    2.84, 3.49, 3.38,
]  # fmt: skip


def _cfg(*overrides: str):
    return load_config(None, ["train.save_every=0", *overrides])


def _records(losses, grads, chance: float | None) -> list[StepRecord]:
    return [
        StepRecord(step=i, loss=x, grad_norm=g, lr=1e-3, chance_loss=chance)
        for i, (x, g) in enumerate(zip(losses, grads, strict=True))
    ]


def _chance_findings(cfg, records) -> list:
    doc = Doctor(cfg, None, False)
    found = [f for r in records for f in doc.observe(r)]
    return [f for f in found + doc.finish() if f.check == "contrastive_chance"]


def test_reduced_quickstart_collapse_is_found_after_warmup():
    found = _chance_findings(
        _cfg("optim.warmup_steps=12"), _records(REDUCED_QS_LOSS, REDUCED_QS_GRAD, math.log(32))
    )
    assert len(found) == 1
    f = found[0]
    # steps 12-13 (the LR peak) leave chance; from 14 on it sits there: onset 14, 10 steps
    assert (f.severity, f.step, f.detected_at) == ("warn", 14, 23)
    assert f.evidence["chance"] == pytest.approx(math.log(32))
    assert f.evidence["drop"] > 100 and f.evidence["early_peak_grad_norm"] == 9.51


@pytest.mark.parametrize("warmup", [50, 0])
def test_full_quickstart_starts_at_chance_and_learns_no_finding(warmup):
    """Negative control: at chance for steps 4-11 with the grad norm 47x down, then it learns;
    not flagged even when warmup does not shield those steps (the drop is < 100x)."""
    recs = _records(FULL_QS_LOSS, FULL_QS_GRAD, math.log(128))
    assert _chance_findings(_cfg(f"optim.warmup_steps={warmup}"), recs) == []


def test_a_run_that_collapses_briefly_and_climbs_out_is_not_flagged():
    """Negative control: the batch-32 run at chance for steps 4-10 (grad norm 300x down), then
    learning; the old 5-step window flagged it at step 6, and without the climb guard a
    window's drop (94x at steps 5-14) is within 10% of the threshold."""
    recs = _records(BATCH32_LOSS, BATCH32_GRAD, math.log(32))
    assert _chance_findings(_cfg("optim.warmup_steps=2"), recs) == []
    short = _cfg("optim.warmup_steps=2", "doctor.chance_steps=5")
    assert [f.step for f in _chance_findings(short, recs)] == [6]


def _synthetic(n: int, collapse_at: int | None, learn_from: int | None) -> list[StepRecord]:
    """Loss at ln 32 (+-0.003 noise); grad norm ~2, decaying 10x per step from `collapse_at`;
    from `learn_from` the loss falls (a run that starts at chance and learns)."""
    rng = random.Random(0)
    out = []
    for s in range(n):
        loss = math.log(32) + rng.gauss(0, 0.003)
        if learn_from is not None and s >= learn_from:
            loss -= 0.1 * (s - learn_from + 1)
        g = 2.0 * (1 + rng.gauss(0, 0.1))
        if collapse_at is not None and s >= collapse_at:
            g *= 0.1 ** min(s - collapse_at + 1, 4)
        out.append(StepRecord(step=s, loss=loss, grad_norm=g, lr=1e-3, chance_loss=math.log(32)))
    return out


def test_collapse_found_at_its_onset_and_controls():
    cfg = _cfg("optim.warmup_steps=2")
    found = _chance_findings(cfg, _synthetic(30, collapse_at=10, learn_from=None))
    # grads <= peak / 100 from step 11 (two 10x decays): onset 11, found 9 steps later
    assert [(f.step, f.detected_at) for f in found] == [(11, 20)]
    # control: at chance the whole run but the gradient stays (slow start): nothing
    assert _chance_findings(cfg, _synthetic(30, collapse_at=None, learn_from=None)) == []
    # control: starts at chance, learns from step 6: nothing
    assert _chance_findings(cfg, _synthetic(30, collapse_at=None, learn_from=6)) == []
    # control: the same collapse inside warmup, then it learns: nothing
    late = _cfg("optim.warmup_steps=20")
    recs = _synthetic(30, collapse_at=10, learn_from=20)
    assert _chance_findings(late, recs) == []
    # control: no chance level (a caption stage): nothing, whatever the series
    for r in (recs := _synthetic(30, collapse_at=10, learn_from=None)):
        r.chance_loss = None
    assert _chance_findings(cfg, recs) == []


def test_tolerance_is_relative_to_chance():
    cfg = _cfg("optim.warmup_steps=2")
    recs = _synthetic(30, collapse_at=10, learn_from=None)
    for r in recs:  # 2% above chance: a loss that is not chance (e.g. a wrong chance level)
        r.loss += 0.02 * math.log(32)
    assert _chance_findings(cfg, recs) == []
    assert len(_chance_findings(_cfg("optim.warmup_steps=2", "doctor.chance_tolerance=0.03"),
                                recs)) == 1  # fmt: skip


def test_offline_replay_of_a_run_recorded_without_chance(tmp_path):
    """`vltrain doctor` on a run whose records predate chance_loss: chance from the config
    (global batch = per-rank batch x world size), exact only without hard negatives."""
    cfg = _cfg("optim.warmup_steps=12", "data.batch_size=16", f"run.out_dir={tmp_path}")
    assert config_chance(cfg, 2) == pytest.approx(infonce_chance(32, 0))
    assert config_chance(_cfg("objective.hard_negatives=1"), 1) is None
    assert config_chance(_cfg("objective.gather=false", "data.batch_size=16"), 2) == (
        pytest.approx(math.log(16))
    )
    dump_config(cfg, tmp_path / "config.yaml")
    (tmp_path / "run_card.json").write_text(json.dumps({"world_size": 2}))
    rows = _records(REDUCED_QS_LOSS, REDUCED_QS_GRAD, None)
    (tmp_path / "doctor_steps.jsonl").write_text(
        "".join(json.dumps({"step": r.step, "loss": r.loss, "grad_norm": r.grad_norm,
                            "lr": r.lr}) + "\n" for r in rows)
    )  # fmt: skip
    found = [f for f in analyse_run(tmp_path) if f.check == "contrastive_chance"]
    assert [f.step for f in found] == [14]
    # negative control: one process of batch 16 has chance ln 16, which this run is not at
    (tmp_path / "run_card.json").write_text(json.dumps({"world_size": 1}))
    assert [f for f in analyse_run(tmp_path) if f.check == "contrastive_chance"] == []


def test_a_run_collapsed_before_its_resume_is_found_after_it(tmp_path):
    """The reduced quickstart collapse, resumed from a checkpoint at step 16: the resumed
    doctor replays the run's doctor_steps.jsonl up to there, so its early grad-norm peak is
    step 0's (9.51), not the collapsed steps' after the resume, and it finds the collapse
    where the unbroken run does (onset 14, found at 23). Negative control: a doctor without
    the history (what a resume used to build) judges steps 16-29 alone and finds nothing."""
    from vltrain.diagnostics.doctor import read_history

    cfg = _cfg("optim.warmup_steps=12", "train.resume=true")
    recs = _records(REDUCED_QS_LOSS, REDUCED_QS_GRAD, math.log(32))
    first = Doctor(cfg, tmp_path, True)  # the run before the crash: steps 0-19 written
    for r in recs[:20]:
        first.observe(r)
    first.close()
    history = read_history(tmp_path, 16)  # the checkpoint holds 16 finished steps
    assert [r["step"] for r in history.steps] == list(range(16))
    resumed = Doctor(cfg, tmp_path, True, history=history)
    found = [f for r in recs[16:] for f in resumed.observe(r)]
    resumed.close()
    chance = [f for f in found if f.check == "contrastive_chance"]
    assert [(f.step, f.detected_at) for f in chance] == [(14, 23)]
    assert chance[0].evidence["early_peak_grad_norm"] == 9.51
    steps = [
        json.loads(x)["step"] for x in (tmp_path / "doctor_steps.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(30))  # steps 16-19 once, not twice
    blind = Doctor(cfg, None, False)
    assert not [f for r in recs[16:] for f in blind.observe(r) if f.check == "contrastive_chance"]
