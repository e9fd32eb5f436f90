"""Shared fixtures: one torch thread, a small synthetic dataset and a tiny-run config builder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# strict collectives with NCCL's rule emulated on gloo (vltrain/core/distributed.py): set at
# import, before vltrain is, so the torchrun and spawned processes the tests start inherit it
os.environ.setdefault("VLTRAIN_STRICT_COLLECTIVES", "cuda")
# the remote-code modelling files transformers imports (a DFlash export's) go to a temporary
# folder, not the user's ~/.cache/huggingface/modules: set before transformers is imported
os.environ.setdefault("HF_MODULES_CACHE", tempfile.mkdtemp(prefix="vltrain-tests-hf-modules-"))
REPO = Path(__file__).resolve().parents[1]


def kills(suite: int, full: int) -> int:
    """How many times a kill-and-resume test kills its run: `suite` in the test suite, `full`
    with VLTRAIN_FULL_KILLS=1 (the longer check; command in docs/internals.md "Tests")."""
    return full if os.environ.get("VLTRAIN_FULL_KILLS") == "1" else suite


@pytest.fixture(autouse=True)
def _spec_costs(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> None:
    """`vltrain generate --spec auto` caches measured costs in the user's cache dir: in tests,
    in a temporary file of the session instead."""
    path = tmp_path_factory.getbasetemp() / "spec_costs.json"
    monkeypatch.setenv("VLTRAIN_SPEC_COSTS", str(path))


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the test on one torch thread, restoring the count afterwards: tiny models run fastest
    single-threaded, and far faster when other jobs share the CPU. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic shapes dataset (train 128 / val 32 / test 32), written once."""
    from vltrain.data.synth import synth_command

    out = tmp_path_factory.mktemp("shapes")
    synth_command(str(out), 128, 32, 32, 0)
    return out


def tiny_overrides(data: Path, out: Path, **extra: object) -> list[str]:
    """Overrides for a few-second CPU run of the CLIP stage on `data`."""
    base = {
        "run.out_dir": out,
        "data.train": data / "train.jsonl",
        "data.eval": data / "val.jsonl",
        "data.batch_size": 16,
        "data.num_workers": 0,
        "data.tokenizer_vocab": 400,
        "train.max_steps": 6,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.log_every": 1,
        "optim.warmup_steps": 2,
        "log.progress": False,
        "log.tensorboard": False,
    }
    base.update(extra)
    if str(base.get("model.kind", "dual_encoder")) != "dual_encoder":
        del base["data.tokenizer_vocab"]  # HF backbones bring their own tokenizer
    return [f"{k}={v}" for k, v in base.items()]


def torchrun_vltrain(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`vltrain ARGS` under `torch.distributed.run` with 2 gloo processes; must exit 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "vltrain", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    # a rank's own error line first: torchrun's traceback of the other rank buries it
    errors = [x for x in res.stderr.splitlines() if "vltrain: error" in x or "Error:" in x]
    assert res.returncode == 0, "\n".join([*errors[:20], res.stdout[-3000:], res.stderr[-3000:]])
    return res


def hardlink_tree(src: Path, dst: Path) -> None:
    """Make `dst` a folder of hard links to `src`'s files: shares the bytes like a symlink
    would, but stays inside the data folder (a symlink out of it is a path_escape)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:  # another file system: copy
                shutil.copy2(f, dst / f.name)
