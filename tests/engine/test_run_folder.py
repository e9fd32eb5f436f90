"""The run folder never lies: best survives a kill, resume refuses a different run, starting
over needs train.overwrite, checkpoints are self-contained, a preempted run saves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_overrides
from vltrain.config import load_config
from vltrain.config.core import ConfigError
from vltrain.core import checkpoint
from vltrain.runs import train
from vltrain.tools.loading import load_trained


def _cfg(data: Path, out: Path, **extra: object):
    over = {"train.max_steps": 4, "train.save_every": 2, "train.eval_every": 2, **extra}
    return load_config(None, tiny_overrides(data, out, **over))


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_kill_between_step_and_best_is_repaired(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    real = checkpoint.update_best
    calls = {"n": 0}

    def killed_at_second(root, src, metric, value, step):
        calls["n"] += 1
        if calls["n"] == 2:  # step_4 is on disk and names itself best; `best` still says 2
            raise KeyboardInterrupt
        real(root, src, metric, value, step)

    monkeypatch.setattr(checkpoint, "update_best", killed_at_second)
    cfg = _cfg(shapes_dir, run, **{"train.best_mode": "min", "train.best_metric": "eval_loss"})
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(checkpoint, "update_best", real)
    ckpts = run / "checkpoints"
    assert json.loads((ckpts / "best" / "best.json").read_text())["step"] == 2
    assert checkpoint.best_step_of(ckpts / "step_4") == 4
    # every loader of `best` gets the true best at once (read-only), and resume repairs it
    assert checkpoint.resolve_checkpoint(run) == ckpts / "step_4"
    resumed = load_config(run / "config.yaml", ["train.resume=true", "train.max_steps=6"])
    resumed.train.allow_changes = ["train.max_steps"]
    train(resumed)
    assert json.loads((ckpts / "best" / "best.json").read_text())["step"] in (4, 6)


def test_resume_refuses_another_run_and_allows_named_changes(
    shapes_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    train(_cfg(shapes_dir, run, **{"train.max_steps": 2}))
    saved = run / "config.yaml"
    before = saved.read_text()
    with pytest.raises(ConfigError, match=r"optim.lr: 0.0005 -> 0.01.*allow_changes"):
        train(load_config(saved, ["train.resume=true", "optim.lr=1e-2"]))
    with pytest.raises(ConfigError, match="train.max_steps: 2 -> 1000"):
        train(load_config(saved, ["train.resume=true", "train.max_steps=1000"]))
    with pytest.raises(ConfigError, match="global batch of 8"):
        over = ["train.resume=true", "data.batch_size=8", "train.allow_changes=[data.batch_size]"]
        train(load_config(saved, over))
    assert saved.read_text() == before  # nothing in the folder was written by a refused resume
    # the README's resume line on a finished run is a no-op that keeps the summary
    summary = json.loads((run / "summary.json").read_text())
    again = train(load_config(saved, ["train.resume=true"]))
    assert again == summary and "val" in again
    # a summary written before it had "step" (the final step) reads with one
    old = {k: v for k, v in summary.items() if k != "step"}
    (run / "summary.json").write_text(json.dumps(old))
    assert train(load_config(saved, ["train.resume=true"]))["step"] == 2 == summary["step"]
    # an explicitly allowed change proceeds (and is logged)
    grown = train(
        load_config(
            saved,
            ["train.resume=true", "train.max_steps=4", "train.allow_changes=[train.max_steps]"],
        )
    )
    assert grown["steps"] == 4


def test_resume_on_nothing_and_start_over_in_a_used_folder(shapes_dir: Path, tmp_path: Path):
    with pytest.raises(ConfigError, match="holds no config.yaml.*wrong run.out_dir"):
        train(_cfg(shapes_dir, tmp_path / "typo", **{"train.resume": True}))
    run = tmp_path / "run"
    train(_cfg(shapes_dir, run, **{"train.max_steps": 6, "train.save_every": 3}))
    with pytest.raises(ConfigError, match="already holds a run.*train.overwrite=true"):
        train(_cfg(shapes_dir, run))
    assert (run / "checkpoints" / "step_6").is_dir()  # refused: the old run is intact
    stopped = tmp_path / "stopped"  # a run that stopped before its first checkpoint
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match="saved no checkpoint") as e:
        train(_cfg(shapes_dir, stopped))
    assert "train.overwrite=true" in str(e.value) and "train.resume" not in str(e.value)
    train(_cfg(shapes_dir, run, **{"train.overwrite": True}))
    steps = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert steps == ["step_2", "step_4"]  # the old step_3/step_6 are gone, the new ones kept
    assert max(_losses(run)) == 4


def test_checkpoints_carry_their_tokenizer_and_loaders_never_write(
    shapes_dir: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    train(_cfg(shapes_dir, src, **{"train.max_steps": 2}))
    ckpt = src / "checkpoints" / "step_2"
    moved = tmp_path / "moved"
    (src).rename(moved)  # the run moves: its checkpoint still holds everything
    cfg, stage, model = load_trained(moved)
    assert stage.tokenizer.vocab_size > 0
    ckpt = moved / "checkpoints" / "step_2"
    import shutil

    shutil.rmtree(ckpt / "tokenizer")
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(ConfigError, match="tokenizer.json is missing"):
        load_trained(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing trained or written


def test_init_from_refuses_a_different_tokenizer_already_present(
    shapes_dir: Path, tmp_path: Path
) -> None:
    src = tmp_path / "src"
    train(_cfg(shapes_dir, src, **{"train.max_steps": 2}))
    dst = tmp_path / "dst"
    (dst / "tokenizer").mkdir(parents=True)
    other = tmp_path / "other"
    train(_cfg(shapes_dir, other, **{"train.max_steps": 2, "data.tokenizer_vocab": 300}))
    for f in (other / "tokenizer").iterdir():
        (dst / "tokenizer" / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ConfigError, match=r"already holds a run that saved no checkpoint \("):
        train(_cfg(shapes_dir, dst, **{"model.init_from": src}))  # the stale one is not kept
    from vltrain.data.tokenizer import prepare_tokenizer

    init = src / "checkpoints" / "step_2"
    with pytest.raises(ConfigError, match="another tokenizer than model.init_from"):
        prepare_tokenizer(dst / "tokenizer", init, list, 400, is_main=True)
    prepare_tokenizer(src / "tokenizer", init, list, 400, is_main=True)  # control: same files


def test_keys_that_would_be_ignored_duplicate_yaml_and_non_finite_floats(tmp_path: Path):
    from vltrain.stages import load_run_config

    for over in (
        "model.freeze=[vision]",
        "model.vision_init_from=somewhere",
        "model.lora_r=4",
        "model.connector=gated_xattn",
        "model.path=x",
        "data.length_buckets=4",
        "caption.mode=sft",
        "rl.k=8",
        "objective.siglip_init_scale=3",
        "model.pooling=mean",
    ):
        with pytest.raises(ConfigError, match="would be ignored"):
            load_run_config(None, [over])
    load_run_config(None, ["objective.loss=siglip", "objective.siglip_init_scale=3"])  # control
    yml = tmp_path / "dup.yaml"
    yml.write_text("optim:\n  lr: 1.0e-3\ntrain:\n  max_steps: 3\noptim:\n  eps: 1.0e-8\n")
    with pytest.raises(ConfigError, match="duplicate key 'optim'"):
        load_config(yml)
    for bad in ("optim.lr=inf", "optim.weight_decay=.inf", "optim.lr_scale={vision: .nan}"):
        with pytest.raises(ConfigError, match="finite"):
            load_config(None, [bad])


def test_symlink_out_of_the_data_folder_is_a_path_escape(tmp_path: Path) -> None:
    from vltrain.data.images import BadSample
    from vltrain.data.readers import resolve_image_path

    outside = tmp_path / "secret.png"
    outside.write_bytes(b"x")
    data = tmp_path / "data"
    data.mkdir()
    (data / "link.png").symlink_to(outside)
    (data / "real.png").write_bytes(b"x")
    (data / "inside.png").symlink_to(data / "real.png")
    with pytest.raises(BadSample) as info:
        resolve_image_path(data / "d.jsonl", "link.png")
    assert info.value.reason == "path_escape"
    assert resolve_image_path(data / "d.jsonl", "inside.png") == data / "inside.png"  # control


def test_truncated_newest_checkpoint_falls_back_naming_it(shapes_dir: Path, tmp_path: Path):
    run = tmp_path / "run"
    train(_cfg(shapes_dir, run, **{"train.max_steps": 4}))
    weights = run / "checkpoints" / "step_4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match="step_4/model.safetensors"):
        checkpoint.check_loadable(weights.parent)
    path, skipped = checkpoint.newest_loadable(run / "checkpoints")
    assert path.name == "step_2" and "step_4" in skipped[0]
    (run / "summary.json").unlink()
    over = ["train.resume=true"]
    summary = train(load_config(run / "config.yaml", over))  # resumes from step 2, redoes 3-4
    assert summary["steps"] == 4


def test_pickle_in_trainer_state_is_refused_without_advice_to_unpickle(tmp_path: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / "trainer_state.pt").write_bytes(pickle.dumps({"x": Evil()}))
    torch.save({"ok": torch.zeros(1)}, tmp_path / "ok.pt")
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.load_trainer_state(tmp_path)
    assert "refused for safety" in str(info.value)
    assert "weights_only=False" not in str(info.value)


def _run_cli(args: list[str], **kw) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "vltrain", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.slow
def test_sigterm_stops_at_a_step_boundary_saves_and_resumes_exactly(
    shapes_dir: Path, tmp_path: Path
) -> None:
    over = {"train.max_steps": 14, "train.save_every": 0, "train.eval_every": 0}
    full, part = tmp_path / "full", tmp_path / "part"
    base = tmp_path / "base.yaml"
    base.write_text("stage: contrastive\n")  # the defaults, plus the overrides below
    args = lambda out: ["train", str(base), *tiny_overrides(shapes_dir, out, **over)]  # noqa: E731
    assert _run_cli(args(full)).wait(timeout=600) == 0
    proc = _run_cli(args(part))
    metrics = part / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and (
        not metrics.is_file() or len(metrics.read_text().splitlines()) < 3
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    text = err.decode()
    assert "SIGTERM received: stopped at step" in text and "Traceback" not in text
    saved = checkpoint.latest_checkpoint(part / "checkpoints")
    stopped_at = int(saved.name.split("_")[1])
    assert 3 <= stopped_at < 14
    resume = _run_cli(["train", str(part / "config.yaml"), "train.resume=true"])
    assert resume.wait(timeout=600) == 0
    want, got = _losses(full), _losses(part)
    assert got == want  # every step, before and after the stop, bit-identical


def test_every_rank_reads_the_run_folder_before_rank_0_rewrites_it(
    shapes_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resume planning reads config.yaml on every rank; rank 0 rewrites it. A barrier between
    the two: without it a slower rank read the rewritten file (the new data.batch_size) and
    refused a 1 -> 2 rank resume with a spurious "global batch" error (test_fsdp reshards)."""
    from vltrain.core import distributed
    from vltrain.engine import loop, run_dir

    order: list[str] = []
    real_plan, real_dump = run_dir.plan_run, loop.dump_config
    monkeypatch.setattr(run_dir, "plan_run", lambda *a: order.append("plan") or real_plan(*a))
    monkeypatch.setattr(distributed, "barrier", lambda: order.append("barrier"))
    monkeypatch.setattr(loop, "dump_config", lambda *a: order.append("write") or real_dump(*a))
    from vltrain.stages.contrastive import ContrastiveStage

    loop.Trainer(_cfg(shapes_dir, tmp_path / "run"), stage=ContrastiveStage)
    assert order[:4] == ["plan", "barrier", "write", "barrier"]


def test_resume_on_another_world_size_with_the_same_global_batch_needs_no_allow(
    shapes_dir: Path, tmp_path: Path
) -> None:
    """2 ranks x 2 resumed as 1 rank x 4 (or back): the global batch and the data order are
    the same, and the resume needed train.allow_changes=[data.batch_size] anyway."""
    from vltrain.engine import run_dir

    run = tmp_path / "run"
    train(_cfg(shapes_dir, run, **{"train.max_steps": 2, "data.batch_size": 4}))
    saved = run / "config.yaml"
    half = load_config(saved, ["train.resume=true", "data.batch_size=2", "train.max_steps=4"])
    half.train.allow_changes = ["train.max_steps"]
    plan = run_dir.plan_run(half, world_size=2)
    assert plan.changed == ["data.batch_size", "train.max_steps"]
    assert any("data.batch_size changed 4 -> 2" in m for m in plan.messages)
    with pytest.raises(ConfigError, match="data.batch_size: 4 -> 2"):  # another global batch
        run_dir.plan_run(half, world_size=1)
