"""A full disk at any write (checkpoint weights and trainer state, the `best` copy, an export,
metrics.jsonl) ends in one `vltrain: error:` line naming the path and the free space, never the
serialiser's own error; the failed save's temp folder is gone at once, what a killed save left
is removed when the run starts again, and the next save succeeds once there is space.

The ENOSPC tests make the writers fail the way they do on a full disk (always run); the last
test fills a real tmpfs it mounts (root with CAP_SYS_ADMIN; skipped with a message elsewhere).
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors import SafetensorError

from tests.conftest import REPO, tiny_overrides
from vltrain.cli import main, os_error_message
from vltrain.core import checkpoint
from vltrain.core.files import is_disk_full, write_failure
from vltrain.engine import run_dir
from vltrain.engine.logging import RunLogger

pytestmark = pytest.mark.usefixtures("one_thread")

# what safetensors raises when the disk fills under save_model
SAFETENSORS_FULL = (
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
    'left on device" })'
)


def _train_args(shapes_dir: Path, out: Path, **extra: object) -> list[str]:
    over = {"train.max_steps": 4, "train.save_every": 2, "train.eval_every": 2, **extra}
    return ["train", str(REPO / "configs" / "clip.yaml"), *tiny_overrides(shapes_dir, out, **over)]


def _one_error_line(err: str, *parts: str) -> str:
    lines = [x for x in err.splitlines() if x.startswith("vltrain: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "SafetensorError" not in err and "Error while serializing" not in err
    assert "[(" not in lines[0]  # no Python list of copy errors
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def _temps(run: Path) -> list[Path]:
    return [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_disk_full_messages_name_the_path_and_the_free_space(tmp_path: Path) -> None:
    assert is_disk_full(SafetensorError(SAFETENSORS_FULL))
    assert is_disk_full(shutil.Error([("a", "b", "[Errno 28] No space left on device")]))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(RuntimeError("shape mismatch"))
    msg = write_failure(tmp_path / "new" / "model.safetensors", SafetensorError(SAFETENSORS_FULL))
    assert msg.startswith(f"cannot write {tmp_path}/new/model.safetensors: disk full (")
    assert f"free on {tmp_path})" in msg
    cli = os_error_message(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "m")))
    assert cli.startswith(f"disk full {tmp_path}/m: No space left on device (") and "free" in cli


def test_a_full_disk_during_training_is_one_error_and_the_next_save_works(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The weights of step 4 hit a full disk: one line naming step_4 and the free space, no
    temp folder; what a killed save left (planted) goes at the next start; resume finishes."""
    run = tmp_path / "run"
    real = checkpoint.save_model
    calls = []

    def full_at_second_save(model, path):
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"x" * 1000)  # a partial file, as a real full disk leaves
            raise SafetensorError(SAFETENSORS_FULL)
        return real(model, path)

    monkeypatch.setattr(checkpoint, "save_model", full_at_second_save)
    assert main(_train_args(shapes_dir, run)) == 2
    _one_error_line(capsys.readouterr().err, f"{run}/checkpoints/step_4", "disk full", "free on")
    assert _temps(run) == [] and (run / "checkpoints" / "step_2" / checkpoint.MARKER).is_file()
    # a kill -9 during a best copy and a metrics rewrite left these (pid 1 is never ours)
    (run / "checkpoints" / ".tmp_best_1").mkdir()
    (run / "checkpoints" / ".tmp_best_1" / "model.safetensors").write_bytes(b"partial")
    (run / ".metrics.jsonl.abc123.tmp").write_text("partial")
    monkeypatch.setattr(checkpoint, "save_model", real)  # space is back
    assert main(["train", str(run / "config.yaml"), "train.resume=true"]) == 0
    assert "removed" in capsys.readouterr().err
    assert _temps(run) == [] and not (run / ".metrics.jsonl.abc123.tmp").exists()
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    checkpoint.check_loadable(run / "checkpoints" / "step_4")


def test_a_full_disk_while_copying_best_leaves_no_temp_copy(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """copytree used to raise shutil.Error with a Python list as its message, and its temp
    copy stayed, keeping the disk full for the next save."""
    root = tmp_path / "checkpoints"
    src = root / "step_2"
    src.mkdir(parents=True)
    (src / "model.safetensors").write_bytes(b"w" * 4096)
    (src / checkpoint.MARKER).write_text("{}")
    real = shutil._fastcopy_sendfile  # how copy2 copies file bytes on Linux

    def full(fsrc, fdst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "_fastcopy_sendfile", full)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.update_best(root, src, "eval_loss", 1.0, 2)
    msg = str(info.value)
    assert msg.startswith(f"cannot write {root}/best: disk full (") and "free on" in msg
    assert "[(" not in msg and not (root / "best").exists()
    assert sorted(p.name for p in root.iterdir()) == ["step_2"]  # no .tmp_best_*
    monkeypatch.setattr(shutil, "_fastcopy_sendfile", real)
    checkpoint.update_best(root, src, "eval_loss", 1.0, 2)
    assert (root / "best" / "model.safetensors").stat().st_size == 4096


def test_a_full_disk_in_the_trainer_state_write_removes_the_temp_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    def full(obj, f, *a, **k):  # what torch says when its zip writer hits a full disk
        Path(f).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:595] . PytorchStreamWriter "
                           "failed writing file data/0: file write failed")  # fmt: skip

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(checkpoint.CheckpointError, match=r"step_3: .*PytorchStreamWriter.*free"):
        checkpoint.write_checkpoint(tmp_path, 3, torch.nn.Linear(2, 2), {"x": 1})
    assert list(tmp_path.iterdir()) == []


def test_metrics_jsonl_never_holds_half_a_line(tmp_path: Path) -> None:
    from vltrain.config import load_config

    cfg = load_config(None, tiny_overrides(tmp_path, tmp_path, **{"log.tensorboard": False}))
    logger = RunLogger(cfg, tmp_path, True, 0)
    logger.log(1, {"loss": 1.0})

    class FullDisk:  # writes part of the line, then the disk is full
        def __init__(self, f) -> None:
            self.f, self.calls = f, 0

        def __getattr__(self, name):
            return getattr(self.f, name)

        def write(self, data: bytes) -> int:
            self.calls += 1
            if self.calls > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data[:5])

    logger.file = FullDisk(logger.file)
    with pytest.raises(OSError) as info:
        logger.log(2, {"loss": 0.5})
    assert info.value.filename == str(tmp_path / "metrics.jsonl")
    assert "free on" in os_error_message(info.value)
    logger.file = logger.file.f
    logger.log(3, {"loss": 0.25})  # space is back
    logger.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3]


def test_an_atomic_rewrite_on_a_full_disk_names_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vltrain.core import files

    target = tmp_path / "summary.json"
    target.write_text("old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full)
    with pytest.raises(OSError) as info:
        files.atomic_write_text(target, "new")
    assert info.value.filename == str(target) and "free on" in os_error_message(info.value)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [target.name]


def test_a_full_disk_during_export_is_one_error_and_leaves_no_partial_export(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from vltrain.tools import export

    run = tmp_path / "run"
    assert main(_train_args(shapes_dir, run, **{"train.max_steps": 2})) == 0
    capsys.readouterr()
    out = tmp_path / "exported"

    def full(model, path):
        Path(path).write_bytes(b"partial")
        raise SafetensorError(SAFETENSORS_FULL)

    monkeypatch.setattr(export, "save_model", full)
    assert main(["export", str(run), "--out", str(out)]) == 2
    _one_error_line(capsys.readouterr().err, str(out), "disk full", "nothing was exported")
    assert not out.exists()


def test_stale_temps_of_a_killed_save_are_removed_and_best_restored(tmp_path: Path) -> None:
    """A kill -9 between the two renames of a best update leaves no `best`: the old copy comes
    back; the temp copies, an old step folder and temp files go."""
    root = tmp_path / "checkpoints"
    for name in (".old_best_1", ".tmp_best_1", ".tmp_step_6_1", ".old_step_4_1"):
        (root / name).mkdir(parents=True)
        (root / name / "model.safetensors").write_bytes(b"w")
    (root / ".old_best_1" / "best.json").write_text('{"step": 4}')  # the complete old copy
    (tmp_path / "config.yaml.tmp").write_text("partial")
    done = run_dir.clean_stale(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["best"]
    assert json.loads((root / "best" / "best.json").read_text()) == {"step": 4}
    assert not (tmp_path / "config.yaml.tmp").exists()
    assert len(done) == 5 and "restored" in done[0]


def _mount_tmpfs(where: Path, size: int) -> str | None:
    where.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True, text=True,
    )  # fmt: skip
    return None if res.returncode == 0 else (res.stderr.strip() or f"exit {res.returncode}")


def test_a_real_small_file_system_fills_up(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """On a tmpfs the test mounts: after step 2's checkpoint the file system is shrunk to
    leave a quarter of a checkpoint free; step 4's save fails with one line, its temp folder
    goes (the space is free again), and after growing the file system resume finishes."""
    fs = tmp_path / "fs"
    why = _mount_tmpfs(fs, 256 * 2**20)
    if why is not None:
        pytest.skip(f"cannot mount a tmpfs here ({why}); the ENOSPC tests above cover the logic")
    try:
        run = fs / "run"
        real_prune = checkpoint.prune
        used: list[int] = []

        def shrink_after_first_save(root: Path, keep: int) -> None:
            real_prune(root, keep)
            if not used:
                ckpt = sum(f.stat().st_size for f in (root / "step_2").rglob("*") if f.is_file())
                used.append(shutil.disk_usage(fs).used)
                size = used[0] + ckpt // 4
                subprocess.run(["mount", "-o", f"remount,size={size}", str(fs)], check=True)

        monkeypatch.setattr(checkpoint, "prune", shrink_after_first_save)
        assert main(_train_args(shapes_dir, run, **{"train.eval_every": 0})) == 2
        err = capsys.readouterr().err
        _one_error_line(err, f"{run}/checkpoints/step_4", "disk full", "MiB free on")
        assert _temps(run) == []
        assert shutil.disk_usage(fs).used <= used[0] + 2**20  # the failed save's bytes are freed
        monkeypatch.setattr(checkpoint, "prune", real_prune)
        subprocess.run(["mount", "-o", "remount,size=256m", str(fs)], check=True)
        assert main(["train", str(run / "config.yaml"), "train.resume=true"]) == 0
        checkpoint.check_loadable(run / "checkpoints" / "step_4")
    finally:
        subprocess.run(["umount", "-l", str(fs)], check=False)


def test_a_bug_in_what_is_saved_is_not_reported_as_a_write_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the file system's failures become 'cannot write ... free': a bug (here an
    AttributeError while saving) surfaces as itself, and the temp folder still goes."""
    import torch

    def buggy(obj, f, *a, **k):
        raise AttributeError("'DraftTarget' object has no attribute 'config_sha256'")

    monkeypatch.setattr(checkpoint.torch, "save", buggy)
    with pytest.raises(AttributeError, match="config_sha256"):
        checkpoint.write_checkpoint(tmp_path, 3, torch.nn.Linear(2, 2), {"x": 1})
    assert list(tmp_path.iterdir()) == []
