"""Atomic checkpoints: a kill at any moment leaves the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from vltrain.core import checkpoint

CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from pathlib import Path
    from torch import nn
    from vltrain.core import checkpoint
    root, stall = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    checkpoint.write_checkpoint(root, 1, model, {"step": 1})
    real = {"save_model": checkpoint.save_model, "torch_save": torch.save,
            "fsync": checkpoint._fsync_tree, "rename": Path.rename}

    def stall_forever(*a, **k):
        print("STALLED", flush=True)
        time.sleep(600)

    def half_then_stall(*a, **k):  # write part of the weights file, then hang
        real["save_model"](*a, **k)
        p = Path(a[1])
        p.write_bytes(p.read_bytes()[:100])
        stall_forever()

    if stall == "weights":
        checkpoint.save_model = half_then_stall
    elif stall == "state":
        torch.save = lambda *a, **k: stall_forever()
    elif stall == "fsync":
        checkpoint._fsync_tree = lambda *a, **k: stall_forever()
    with torch.no_grad():
        model.weight.add_(1.0)
    checkpoint.write_checkpoint(root, 2, model, {"step": 2})
    print("DONE", flush=True)
    """
)


@pytest.mark.parametrize("stall", ["weights", "state", "fsync"])
def test_kill_during_save_leaves_previous_checkpoint_loadable(tmp_path: Path, stall: str) -> None:
    root = tmp_path / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), stall], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline().strip()
    assert line == "STALLED", f"child did not reach the stall point: {line!r}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(p.name.startswith(".tmp_step_2") for p in root.iterdir())  # the kill hit a save
    latest = checkpoint.latest_checkpoint(root)
    assert latest is not None and latest.name == "step_1"
    torch.manual_seed(0)
    expected = nn.Linear(64, 64)
    loaded = nn.Linear(64, 64)
    checkpoint.load_weights(loaded, latest)
    assert torch.equal(loaded.weight, expected.weight)
    assert checkpoint.load_trainer_state(latest) == {"step": 1}
    checkpoint.prune(root, keep_last=3)  # stale temp folders of dead processes are cleaned
    assert not any(p.name.startswith(".tmp_") for p in root.iterdir())


def test_uninterrupted_save_is_found_and_pruned(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    for step in (2, 4, 6, 8):
        checkpoint.write_checkpoint(tmp_path, step, model, {"step": step})
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_8"
    checkpoint.prune(tmp_path, keep_last=2)
    assert [s for s, _ in checkpoint.complete_checkpoints(tmp_path)] == [6, 8]
    # a folder without the COMPLETE marker is never picked (negative control on the marker)
    (tmp_path / "step_10").mkdir()
    (tmp_path / "step_10" / "model.safetensors").write_bytes(b"garbage")
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_8"


def test_trainer_state_refuses_arbitrary_pickle(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    torch.save({"x": Evil()}, ckpt / "trainer_state.pt")
    with pytest.raises(
        checkpoint.CheckpointError, match="non-tensor Python objects and is refused for safety"
    ):
        checkpoint.load_trainer_state(ckpt)


def test_rng_state_round_trips_through_weights_only_load(tmp_path: Path) -> None:
    import random

    import numpy as np

    state = checkpoint.rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_a_stray_model_file_at_a_run_top_never_wins_over_its_checkpoints(tmp_path: Path) -> None:
    """`vltrain export RUN --out RUN` once left RUN/model.safetensors, which every loader then
    preferred to the run's newer checkpoints."""
    from safetensors.torch import save_model

    checkpoint.write_checkpoint(tmp_path / "checkpoints", 4, nn.Linear(4, 4), {"step": 4})
    save_model(nn.Linear(4, 4), str(tmp_path / "model.safetensors"))
    assert checkpoint.resolve_checkpoint(tmp_path).name == "step_4"
    assert checkpoint.resolve_loadable(tmp_path)[0].name == "step_4"
    # negative control: an export folder (weights, no checkpoints/) still loads as itself
    export = tmp_path / "export"
    export.mkdir()
    save_model(nn.Linear(4, 4), str(export / "model.safetensors"))
    assert checkpoint.resolve_checkpoint(export) == export


def test_sharded_checkpoint_in_one_process_is_quiet(tmp_path, recwarn) -> None:
    """A sharded (DCP) checkpoint saved and loaded in one process (fsdp at one rank, a 2 -> 1
    resume, export) is meant: DCP's "torch.distributed is disabled" warning printed twice per
    resume."""
    import torch

    from vltrain.core.checkpoint import load_shards, save_shards

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_shards(model, opt, tmp_path / "shards")
    other = torch.nn.Linear(3, 2)
    load_shards(other, torch.optim.AdamW(other.parameters()), tmp_path / "shards")
    assert torch.equal(other.weight, model.weight)
    assert not [w for w in recwarn if "torch.distributed is disabled" in str(w.message)]
