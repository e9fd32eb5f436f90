"""End-to-end CLI: data synth, train errors, and the quickstart at a tiny size."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vltrain.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_python_dash_m_and_help_work() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vltrain", "quickstart", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--steps" in out and "--size" in out and "--out" in out


def test_data_synth_writes_the_three_splits(tmp_path: Path) -> None:
    assert (
        main(
            [
                "data",
                "synth",
                "--out",
                str(tmp_path),
                "--n-train",
                "20",
                "--n-val",
                "5",
                "--n-test",
                "5",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    for split, n in (("train", 20), ("val", 5), ("test", 5)):
        lines = (tmp_path / f"{split}.jsonl").read_text().splitlines()
        assert len(lines) == n
        rec = json.loads(lines[0])
        assert (tmp_path / rec["image"]).is_file() and rec["text"] and rec["negatives"]


def test_config_mistakes_exit_2_with_a_hint_and_no_traceback(tmp_path: Path, capsys) -> None:
    code = main(["train", str(REPO / "configs" / "clip.yaml"), "optim.lrr=1e-3"])
    err = capsys.readouterr().err
    assert code == 2 and "did you mean optim.lr" in err and "Traceback" not in err
    code = main(["train", str(tmp_path / "nope.yaml")])
    assert code == 2 and "config file not found" in capsys.readouterr().err


@pytest.mark.slow
def test_quickstart_end_to_end_at_a_tiny_size(tmp_path: Path, capsys) -> None:
    out = tmp_path / "qs"
    code = main(
        [
            "quickstart",
            "--out",
            str(out),
            "--steps",
            "8",
            "--n-train",
            "64",
            "--n-eval",
            "24",
            "--batch-size",
            "16",
            "--num-workers",
            "0",
            "--caption-steps",
            "6",
            "--rl-steps",
            "2",
            "log.progress=false",
            "data.tokenizer_vocab=400",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "| image->text R@1 |" in printed and "hard-negative acc" in printed
    assert "| CIDEr-D |" in printed and "| BLEU-4 |" in printed
    assert (out / "caption_finetune" / "checkpoints" / "best" / "best.json").is_file()
    # the all-stages table: one row per stage with its held-out test metrics, also in report.md
    report = (out / "report.md").read_text()
    table = [x for x in report.splitlines() if x.startswith("| ") and "---" not in x]
    assert [x.split("|")[1].strip() for x in table] == [
        "stage",
        "CLIP (contrastive)",
        "caption pretrain",
        "caption finetune",
        "caption RL",
    ]
    head = [c.strip() for c in table[0].split("|")[1:-1]]
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[1:-1]] for r in table[1:]}
    col = {name: head.index(name) for name in ("hard-neg acc", "CIDEr-D greedy", "CIDEr-D beam")}
    assert cells["CLIP (contrastive)"][col["hard-neg acc"]] != "-"
    assert cells["CLIP (contrastive)"][col["CIDEr-D greedy"]] == "-"
    for stage in ("caption finetune", "caption RL"):  # before and after RL, greedy and beam
        assert float(cells[stage][col["CIDEr-D greedy"]]) >= 0.0
        assert float(cells[stage][col["CIDEr-D beam"]]) >= 0.0
    assert cells["caption RL"][1] == "2" and report.splitlines()[-1].startswith("Total time")
    assert "All stages, held-out test split" in printed
    # the machine the times came from: CPU, threads, a GEMM rate measured then (hosts differ)
    gemm = re.search(r"fp32 GEMM (\d+) GFLOP/s measured now", printed)
    assert gemm and int(gemm.group(1)) > 0 and gemm.group(0) in report
    rl = json.loads((out / "caption_rl" / "summary.json").read_text())
    assert rl["test"]["n_images"] == 24 and "beam_CIDEr-D" in rl["test"]
    run = out / "clip"
    assert (run / "config.yaml").is_file() and (run / "summary.json").is_file()
    assert (run / "checkpoints" / "step_8" / "model.safetensors").is_file()
    assert (run / "checkpoints" / "best" / "best.json").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["test"]["i2t_R@1"] <= 1.0 and summary["test"]["n_images"] == 24
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 8
    # re-running from the dumped config reproduces the run's resolved config
    again = main(["train", str(run / "config.yaml"), f"run.out_dir={tmp_path / 'again'}"])
    assert again == 0
    a = json.loads((run / "summary.json").read_text())["val"]
    b = json.loads((tmp_path / "again" / "summary.json").read_text())["val"]
    assert a == b


def test_a_missing_optional_dependency_names_the_extra(tmp_path: Path, capsys, monkeypatch) -> None:
    """`--model` without transformers installed: one line naming `vltrain[hf]`, exit 2."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ModuleNotFoundError
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert main(["generate", "--model", str(tmp_path), "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "pip install 'vltrain[hf]'" in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "numpy_not_an_extra", None)
    monkeypatch.setattr(
        "vltrain.tools.speculate.load_hf_causal_lm",
        lambda path: __import__("numpy_not_an_extra"),
    )
    try:  # a missing module that is no extra of ours stays a real error
        main(["generate", "--model", str(tmp_path), "--prompts", str(prompts)])
        raise AssertionError("expected ModuleNotFoundError")
    except ModuleNotFoundError as e:
        assert e.name == "numpy_not_an_extra"
