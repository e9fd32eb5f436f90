"""The run card: what trained it (commit, dirty tree), where (machine), with what (versions)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vltrain.core.files import atomic_write_text


def _git(*args: str) -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        res = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return res.stdout.strip() if res.returncode == 0 else ""


def cpu_model() -> str:
    """The CPU model name (/proc/cpuinfo on Linux, else what `platform` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_gemm_gflops(seconds: float = 0.3, n: int = 1024) -> float:
    """fp32 GFLOP/s of (n x n) @ (n x n) on the CPU with torch's current threads, timed for about
    `seconds` after one warm-up: hosts labelled with the same CPU model run the same code up
    to ~1.6x apart (bench/RESULTS.md "Quickstart, round 5"), so a time means little without it."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: thread pool and packing buffers
    reps, t0 = 0, time.perf_counter()
    while reps < 2 or time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e9


def run_card(world_size: int, device: str) -> dict[str, Any]:
    """Commit and dirty state of the vltrain source, machine, versions, start time."""
    import torch

    status = _git("status", "--porcelain", "--untracked-files=no")
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return {
        "commit": _git("rev-parse", "--short=12", "HEAD") or "unknown (not a git checkout)",
        "dirty": bool(status),
        "host": platform.node(),
        "cpu": cpu_model(),
        "gpu": gpu,
        "device": device,
        "world_size": world_size,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_run_card(out_dir: Path, world_size: int, device: str) -> None:
    atomic_write_text(out_dir / "run_card.json", json.dumps(run_card(world_size, device), indent=2))
