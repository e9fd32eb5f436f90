"""`vltrain --version`, `vltrain presets`, synth --force, mine's output records, safe writes."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest

import vltrain
from vltrain.cli import main, os_error_message
from vltrain.cli.presets import list_presets, preset_dir, purpose
from vltrain.core.files import OutputError, atomic_write_text
from vltrain.tools.mine import mine_record


def test_version_prints_the_package_version(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vltrain {vltrain.__version__}"


def test_every_shipped_preset_states_its_purpose(capsys) -> None:
    rows = list_presets()
    names = sorted(p.name for p in preset_dir().glob("*.yaml"))
    assert [n for n, _ in rows] == names and len(names) >= 10
    missing = [n for n, text in rows if len(text) < 20]
    assert not missing, f"presets without a first-comment purpose line: {missing}"
    assert all("\n" not in text and not text.startswith("vltrain ") for _, text in rows)
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in names)


def test_purpose_reads_one_sentence_and_stops_at_commands() -> None:
    two_lines = "# Fine-tune a model, the vision\n# tower at 0.1x lr. Then more.\nstage: x\n"
    assert purpose(two_lines) == "Fine-tune a model, the vision tower at 0.1x lr"
    assert purpose("# Train CLIP\n# vltrain train configs/clip.yaml\n") == "Train CLIP"
    assert purpose("stage: contrastive\n# a late comment\n") == ""  # negative control


def test_synth_refuses_a_used_folder_and_force_replaces_only_its_files(tmp_path: Path) -> None:
    args = ["data", "synth", "--out", str(tmp_path), "--n-val", "1", "--n-test", "1"]
    assert main([*args, "--n-train", "6"]) == 0
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="is not empty"):
        from vltrain.data.synth import prepare_output_folder

        prepare_output_folder(tmp_path, force=False)
    assert main([*args, "--n-train", "2"]) == 2  # refused: still 6 records
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 6
    assert main([*args, "--n-train", "2", "--force"]) == 0
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 2
    images = sorted(p.name for p in (tmp_path / "images").iterdir())
    assert images == ["test_00000.png", "train_00000.png", "train_00001.png", "val_00000.png"]
    assert (tmp_path / "notes.txt").read_text() == "mine"  # not the data set's: kept


def test_mined_records_never_keep_labels_of_other_negatives() -> None:
    rec = {"image": "a.png", "text": ["x"], "negatives": ["n1", "n2"], "negative_kinds": ["c", "s"]}
    replaced = mine_record(rec, ["m1"], append=False)
    assert replaced["negatives"] == ["m1"] and "negative_kinds" not in replaced
    appended = mine_record(rec, ["m1"], append=True)
    assert appended["negatives"] == ["n1", "n2", "m1"]
    assert appended["negative_kinds"] == ["c", "s", "mined"]
    assert rec["negatives"] == ["n1", "n2"]  # the input record is not modified


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    p = tmp_path / "out.jsonl"
    p.write_text("old\n")

    with pytest.raises(TypeError):
        atomic_write_text(p, 123)  # type: ignore[arg-type]  # fails inside the write
    assert p.read_text() == "old\n" and [x.name for x in tmp_path.iterdir()] == ["out.jsonl"]
    atomic_write_text(p, "new\n")
    assert p.read_text() == "new\n" and oct(p.stat().st_mode & 0o777) != oct(0o600)


def test_os_errors_name_the_path_and_say_what_happened() -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/runs/a/model.safetensors")
    msg = os_error_message(full)
    assert re.fullmatch(
        r"disk full /runs/a/model\.safetensors: No space left on device "
        r"\([0-9.]+ [KMGT]?i?B free on /[^;]*; free space or write elsewhere\)",
        msg,
    ), msg
    denied = PermissionError(errno.EACCES, "Permission denied", "/runs/b")
    assert os_error_message(denied) == "permission denied /runs/b: Permission denied"
    moved = OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b")
    assert os_error_message(moved) == "cannot use /a -> /b: Invalid cross-device link"
    assert os_error_message(FileNotFoundError("no config.yaml for X")) == "no config.yaml for X"


def test_config_docs_out_is_written_whole_and_a_folder_is_refused(tmp_path: Path, capsys) -> None:
    assert main(["config-docs", "--out", str(tmp_path / "ref.md")]) == 0
    assert (tmp_path / "ref.md").read_text().startswith("# Config reference")
    assert main(["config-docs", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert json.dumps(sorted(p.name for p in tmp_path.iterdir())) == '["ref.md"]'
