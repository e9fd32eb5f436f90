"""train.async_save: checkpoints written in the background are the synchronous save's bytes, a
kill -9 at any moment of a save leaves the newest complete checkpoint loadable and the resume
bit-identical, and sharded (fsdp) runs save through torch.distributed.checkpoint's async_save."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.conftest import REPO, kills, tiny_overrides
from vltrain.config import load_config
from vltrain.core import checkpoint
from vltrain.core.async_checkpoint import (
    AsyncWriter,
    Copies,
    snapshot,
    write_checkpoint_async,
)
from vltrain.runs import train

pytestmark = pytest.mark.usefixtures("one_thread")
KILLS = kills(4, 20)
CONFIG = REPO / "configs" / "clip.yaml"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_async_save_writes_the_sync_saves_bytes(shapes_dir: Path, tmp_path: Path) -> None:
    opts = {"train.max_steps": 4, "train.save_every": 2, "train.eval_every": 2}
    ckpts = {}
    for mode in ("false", "true"):
        out = tmp_path / f"async_{mode}"
        over = tiny_overrides(shapes_dir, out, **opts, **{"train.async_save": mode})
        train(load_config(None, over))
        ckpts[mode] = _files(out / "checkpoints")
    names = {n.split("/")[0] for n in ckpts["false"]}
    assert names == {"step_2", "step_4", "best"}  # step saves and a best copy
    assert ckpts["true"].keys() == ckpts["false"].keys()
    differ = [n for n in ckpts["false"] if ckpts["true"][n] != ckpts["false"][n]]
    assert differ == []


def test_the_writer_saves_the_state_at_submit_and_one_save_at_a_time(tmp_path: Path) -> None:
    model = nn.Linear(8, 8)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    writer, release, order = AsyncWriter(), threading.Event(), []

    def slow_export(module: nn.Module, folder: Path) -> None:
        release.wait(10)  # the write is still in flight while training goes on
        order.append(folder.name)

    def done(path: Path) -> None:
        order.append(path.name)

    state = {"loop": {"step": 1}, "buf": model.weight}  # a live tensor in the trainer state
    write_checkpoint_async(writer, tmp_path, 1, model, state, {}, slow_export, done)
    assert writer.busy and checkpoint.latest_checkpoint(tmp_path) is None  # not complete yet
    with torch.no_grad():  # the next training step changes the weights in place
        model.weight.add_(1.0)
    release.set()
    writer.wait()
    assert order == [".tmp_step_1_" + str(os.getpid()), "step_1"]
    saved = load_file(tmp_path / "step_1" / "model.safetensors")
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)
    buf = checkpoint.load_trainer_state(tmp_path / "step_1")["buf"]
    assert torch.equal(buf, at_save["weight"])  # negative control: the live weight moved
    assert not torch.equal(buf, model.weight.detach())


def test_the_optimizer_step_waits_for_the_background_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gated on the optimizer, the weights and its state are copied in the writer thread: the
    next optimizer step waits for that copy, and the file holds the weights at the save."""
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):  # AdamW state (moments, step) to save
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    moments = opt.state[model.weight]["exp_avg"].clone()
    writer, gate, real = AsyncWriter(opt), threading.Event(), Copies.run

    def slow_copy(self: Copies) -> None:
        gate.wait(10)
        real(self)

    monkeypatch.setattr(Copies, "run", slow_copy)
    state = {"optimizer": opt.state_dict()}
    write_checkpoint_async(writer, tmp_path, 1, model, state, {}, lambda m, f: None, print, opt)
    stepper = threading.Thread(target=opt.step)
    stepper.start()
    time.sleep(0.3)
    assert stepper.is_alive()  # blocked until the copy is taken
    assert torch.equal(model.weight.detach(), at_save["weight"])
    gate.set()
    stepper.join(10)
    writer.wait()
    assert not torch.equal(model.weight.detach(), at_save["weight"])  # the step ran after
    saved = load_file(tmp_path / "step_1" / "model.safetensors")
    assert all(torch.equal(saved[k], at_save[k]) for k in at_save)
    ts = checkpoint.load_trainer_state(tmp_path / "step_1")
    assert torch.equal(ts["optimizer"]["state"][0]["exp_avg"], moments)


def test_a_failed_background_save_raises_at_the_next_wait() -> None:
    writer = AsyncWriter()

    def fail() -> None:
        raise OSError("No space left on device")

    writer.submit(fail)
    with pytest.raises(OSError, match="No space left"):
        writer.wait()
    writer.wait()  # reported once


def test_snapshot_copies_tensors_and_keeps_aliasing() -> None:
    t = torch.ones(3)
    snap = snapshot({"a": t, "b": [t, 2], "c": (t,)})
    assert snap["a"] is snap["b"][0] is snap["c"][0] and snap["a"] is not t
    t.add_(1)
    assert torch.equal(snap["a"], torch.ones(3)) and snap["b"][1] == 2


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "model.safetensors")


@pytest.mark.slow
def test_kill_9_during_async_saves_keeps_a_loadable_checkpoint_and_exact_resume(
    shapes_dir: Path, tmp_path: Path
) -> None:
    """One run killed KILLS times (4; 20 with VLTRAIN_FULL_KILLS=1), each at a random moment
    while a background save is in flight, resumed each time; finally equal, bit for bit, to the
    uninterrupted run."""
    opts = {
        "train.max_steps": 30,
        "train.save_every": 1,
        "train.eval_every": 5,
        "train.keep_last": 2,
        "train.async_save": "true",
        "optim.warmup_steps": 0,
        "run.threads": 1,
    }
    ref = tmp_path / "ref"
    train(load_config(CONFIG, tiny_overrides(shapes_dir, ref, **opts)))
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "vltrain", "train", str(CONFIG)]
    cmd += tiny_overrides(shapes_dir, run, **opts)
    rng, kills, interrupted, steps = random.Random(0), 0, 0, []
    root = run / "checkpoints"
    while kills < KILLS:
        resume = ["train.resume=true"] if (run / "config.yaml").exists() else []
        proc = subprocess.Popen(
            [*cmd, *resume], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        # wait for this process's n-th save in flight, then kill at a random moment of it
        mine, seen, nth = f"_{proc.pid}", set(), rng.randint(1, 3)
        while proc.poll() is None and len(seen) < nth:
            seen.update(p.name for p in root.glob(".tmp_step_*") if p.name.endswith(mine))
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.02))
        if proc.poll() is not None:  # finished before a kill landed
            assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
        interrupted += any(p.name.endswith(mine) for p in root.glob(".tmp_step_*"))
        newest, skipped = checkpoint.newest_loadable(root)
        assert newest is not None and skipped == [], f"kill {kills}: {skipped}"
        assert newest == checkpoint.latest_checkpoint(root)
        steps.append(int(newest.name.split("_")[1]))
        best = root / "best"
        if best.exists():  # best is a complete copy of a checkpoint whose metric it names
            checkpoint.check_loadable(best)
            meta = json.loads((best / "best.json").read_text())
            assert meta["step"] <= steps[-1]
    assert kills == KILLS, f"the run finished after {kills} kills"
    assert interrupted > 0, "no kill landed while a save was in flight"  # not vacuous
    assert steps == sorted(steps) and steps[-1] < opts["train.max_steps"]
    res = subprocess.run([*cmd, "train.resume=true"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    final, expected = _weights(root / "step_30"), _weights(ref / "checkpoints" / "step_30")
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    rows = [json.loads(x) for x in (ref / "metrics.jsonl").read_text().splitlines()]
    want = {r["step"]: r["loss"] for r in rows if "loss" in r}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    got = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert got == want
    ref_best = json.loads((ref / "checkpoints" / "best" / "best.json").read_text())
    assert json.loads((root / "best" / "best.json").read_text()) == ref_best
    shutil.rmtree(ref)


@pytest.mark.slow
def test_fsdp_async_save_equals_the_sync_save(shapes_dir: Path, tmp_path: Path) -> None:
    """train.parallel=fsdp in one process: sharded checkpoints through dcp.async_save load
    back to the weights the synchronous save writes."""
    from vltrain.tools.export import export_checkpoint

    opts = {"train.max_steps": 4, "train.save_every": 2, "train.parallel": "fsdp"}
    weights = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        over = tiny_overrides(shapes_dir, out, **opts, **{"train.async_save": mode})
        train(load_config(None, over))
        ckpt = out / "checkpoints" / "step_4"
        assert checkpoint.is_sharded(ckpt)
        assert (out / "checkpoints" / "step_2" / "COMPLETE").exists()
        export_checkpoint(ckpt, tmp_path / f"export_{mode}")
        weights[mode] = load_file(tmp_path / f"export_{mode}" / "model.safetensors")
    assert weights["true"].keys() == weights["false"].keys()
    assert all(torch.equal(weights["true"][k], weights["false"][k]) for k in weights["false"])


@pytest.mark.slow
def test_fsdp_two_ranks_async_save_equals_the_sync_save(shapes_dir: Path, tmp_path: Path) -> None:
    """Two fsdp ranks under torchrun: dcp.async_save's thread talks on its own gloo group
    while training goes on; the checkpoints equal the synchronous ones."""
    from tests.conftest import torchrun_vltrain
    from vltrain.tools.export import export_checkpoint

    opts = {"train.max_steps": 4, "train.save_every": 2, "train.parallel": "fsdp"}
    weights = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        over = {**opts, "data.batch_size": 8, "train.async_save": mode}
        torchrun_vltrain(["train", str(CONFIG), *tiny_overrides(shapes_dir, out, **over)])
        for step in (2, 4):
            export_checkpoint(out / "checkpoints" / f"step_{step}", tmp_path / f"e_{mode}_{step}")
            weights[mode, step] = load_file(tmp_path / f"e_{mode}_{step}" / "model.safetensors")
    for step in (2, 4):
        a, b = weights["true", step], weights["false", step]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
    # negative control: the two saves hold different weights
    assert not all(torch.equal(weights["true", 2][k], weights["true", 4][k]) for k in b)
