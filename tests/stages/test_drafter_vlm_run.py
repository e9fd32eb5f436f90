"""The drafter stage with a caption *run* of kind llava or hf_vlm as ``model.target`` (LoRA runs:
merged in memory): the drafter trains on the run's model, and `vltrain generate --checkpoint RUN
--draft DRAFTER` prints exactly the plain greedy captions (speculative decoding is lossless)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.stages.test_caption_hf import PRESET, data, models, overrides  # noqa: F401 (fixtures)
from tests.stages.test_drafter_vlm import _overrides as drafter_overrides
from vltrain.cli import main
from vltrain.data.readers import read_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")


def _drafter_overrides(target: Path, data: Path, run: Path) -> list[str]:  # noqa: F811
    return drafter_overrides(target, data, run, eval_file="val.jsonl")


@pytest.mark.parametrize("kind", ["llava", "hf_vlm"])
def test_drafter_for_a_vlm_caption_run_is_lossless(
    kind: str,
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    extra: dict[str, object] = {"caption.mode": "sft", "model.lora_r": 4, "model.lora_alpha": 64}
    extra["caption.instruction"] = "describe the image."
    if kind == "llava":
        extra["model.freeze"] = "[vision]"
    cap = tmp_path / "caption"
    assert main(["train", str(PRESET[kind]), *overrides(kind, models, data, cap, **extra)]) == 0
    drafter = tmp_path / "drafter"
    over = _drafter_overrides(cap, data, drafter)
    assert main(["train", str(REPO / "configs" / "drafter.yaml"), *over]) == 0
    rows = [json.loads(x) for x in (drafter / "metrics.jsonl").read_text().splitlines()]
    m = next(r for r in reversed(rows) if "eval_tau_decode" in r)
    assert m["eval_tau_decode"] >= 1.0 and "eval_tau_decode_tree" in m
    paths = [str(data / r["image"]) for r in read_jsonl(data / "val.jsonl")[:6]]
    base = ["generate", "--checkpoint", str(cap), "--images", *paths, "--max-new-tokens", "10"]
    capsys.readouterr()
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert sum(len(json.loads(x)["caption"]) for x in plain.splitlines()) > 6
    for budget in ("0", "6"):
        assert main([*base, "--draft", str(drafter), "--tree-budget", budget]) == 0
        got = capsys.readouterr()
        assert got.out == plain
        assert json.loads(got.err.strip().splitlines()[-1])["rounds"] > 0


def test_a_non_vlm_run_is_refused_as_a_target(
    data: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    run = tmp_path / "notvlm"
    run.mkdir()
    (run / "config.yaml").write_text("stage: caption\nmodel:\n  kind: captioner\n")
    over = _drafter_overrides(run, data, tmp_path / "r")
    assert main(["train", str(REPO / "configs" / "drafter.yaml"), *over]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vltrain: error:") and "caption run of model.kind" in err, err
    assert not (tmp_path / "r").exists()
