"""The drafter's feature noise (``drafter.noise`` with ``drafter.noise_warmup_steps``): the
noise actually added to the target features the drafter reads follows the linear warmup, and
evaluation reads them clean. A negative control puts the seed's bug back (a schedule computed
but never applied) and shows the check catches it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.stages.drafter_fixtures import TEXTS, tiny_lm
from vltrain.cli import main

pytest.importorskip("transformers")

NOISE, WARMUP, STEPS = 0.5, 4, 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("noise")
    lm = tiny_lm(d / "lm")
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    args = ["data", "regenerate", "--model", str(lm), "--data", str(d / "prompts.jsonl")]
    assert main([*args, "--out", str(d / "answers.jsonl"), "--max-new-tokens", "16"]) == 0
    return lm, d / "answers.jsonl"


def _measured_noise(setup, out: Path, monkeypatch) -> tuple[list[float], list[float]]:
    """(std of the noise on the features of each training forward, max |noise| of each
    evaluation forward), measured between what the target gave and what the drafter read."""
    from tests.config.test_config import PRESETS
    from vltrain.inference.draft_target import DraftTarget
    from vltrain.objectives.drafter import BlockDraftLoss

    lm, answers = setup
    clean: list[torch.Tensor] = []
    train: list[float] = []
    evals: list[float] = []
    inputs, forward = DraftTarget.inputs, BlockDraftLoss.forward

    def spy_inputs(self, batch, split="train"):
        inp = inputs(self, batch, split)
        clean.append(inp.context.features.detach().clone())
        return inp

    def spy_forward(self, features, ctx_pos, ctx_valid, *rest):
        noise = (features.detach() - clean[-1])[ctx_valid]  # (N, F) real positions only
        if self.training:
            train.append(float(noise.std()))
        else:
            evals.append(float(noise.abs().max()))
        return forward(self, features, ctx_pos, ctx_valid, *rest)

    monkeypatch.setattr(DraftTarget, "inputs", spy_inputs)
    monkeypatch.setattr(BlockDraftLoss, "forward", spy_forward)
    preset = next(p for p in PRESETS if p.name == "drafter_smollm2.yaml")
    over = [
        f"run.out_dir={out}",
        f"model.target={lm}",
        f"data.train={answers}",
        f"data.eval={answers}",
        "data.batch_size=4",
        f"train.max_steps={STEPS}",
        "train.eval_every=0",
        "train.save_every=0",
        "optim.warmup_steps=1",
        "log.progress=false",
        "log.tensorboard=false",
        "drafter.block_size=4",
        "drafter.eval_prompts=2",
        "drafter.eval_max_new_tokens=4",
        "data.length_buckets=0",
        f"drafter.noise={NOISE}",
        f"drafter.noise_warmup_steps={WARMUP}",
    ]
    assert main(["train", str(preset), *over]) == 0
    return train, evals


def follows_schedule(train: list[float], evals: list[float]) -> bool:
    """Step 0: none; mid-warmup (step 2 of 4): half the std; after warmup: the full std; none
    at evaluation. Thousands of noise values a step: their std is within 10% of the target."""
    want = [NOISE * min(1.0, s / WARMUP) for s in range(STEPS)]
    if len(train) != STEPS or not evals:
        return False
    ok = train[0] == 0.0 and max(evals) == 0.0
    return ok and all(abs(got - w) <= 0.1 * w for got, w in zip(train[1:], want[1:], strict=True))


def test_the_applied_noise_follows_the_warmup(setup, tmp_path, monkeypatch) -> None:
    train, evals = _measured_noise(setup, tmp_path / "run", monkeypatch)
    assert train[2] == pytest.approx(NOISE / 2, rel=0.1)  # mid-warmup
    assert train[WARMUP] == pytest.approx(NOISE, rel=0.1)  # after warmup
    assert follows_schedule(train, evals), (train, evals)


@pytest.mark.parametrize("bug", ["never_applied", "std_zero"])
def test_a_no_op_noise_schedule_is_caught(setup, tmp_path, monkeypatch, bug: str) -> None:
    """Negative controls, the seed's bug: the noise computed but the clean features passed on,
    or a schedule that is 0 at every step."""
    from vltrain.inference import draft_target

    if bug == "never_applied":
        add = draft_target.FeatureNoise.__call__

        def computed_not_applied(self, inp):
            add(self, inp)
            return inp

        monkeypatch.setattr(draft_target.FeatureNoise, "__call__", computed_not_applied)
    else:
        monkeypatch.setattr(draft_target, "noise_std", lambda noise, warmup, step: 0.0)
    train, evals = _measured_noise(setup, tmp_path / "run", monkeypatch)
    assert not follows_schedule(train, evals)


def test_noise_std_schedule() -> None:
    from vltrain.inference.draft_target import noise_std

    assert [noise_std(0.2, 4, s) for s in (0, 2, 4, 9)] == [0.0, 0.1, 0.2, 0.2]
    assert noise_std(0.2, 0, 0) == 0.2
