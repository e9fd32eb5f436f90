"""Rank-0 logging: metrics.jsonl, progress bar, TensorBoard, and the experiment trackers
(Weights & Biases, MLflow: `vltrain.engine.trackers`)."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from vltrain.config.extras import install_hint
from vltrain.config.schema import Config
from vltrain.core.files import atomic_write_lines
from vltrain.engine import trackers
from vltrain.engine.stops import TrainingStopped


def _clean(value: Any) -> Any:
    """JSON-safe scalars (NaN/inf become strings so the file stays valid JSON)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after `last_step` (a resumed run rewrites that part of history)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
    atomic_write_lines(path, kept)  # a kill here leaves the old history, never a cut one


class RunLogger:
    """Writes metrics on rank 0 and is a no-op elsewhere."""

    def __init__(self, cfg: Config, out_dir: Path, enabled: bool, start_step: int) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self.tb = None
        self.trackers: list[trackers.Tracker] = []
        self.finished = False  # set by the loop once the run reached its end
        self.bar = None
        self.t0 = time.time()
        if not enabled:
            return
        truncate_metrics(self.path, start_step)
        self.file = open(self.path, "ab", buffering=0)  # unbuffered: see _append
        if cfg.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step)
            except ImportError:
                print(
                    "vltrain: tensorboard not installed; skipping TensorBoard logs "
                    f"({install_hint('tensorboard')})",
                    file=sys.stderr,
                )
        self.trackers = trackers.open_trackers(cfg, out_dir)
        if cfg.log.progress:
            self._make_bar(cfg.train.max_steps, start_step)

    def _make_bar(self, total: int, start: int) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(
            total=total,
            initial=start,
            dynamic_ncols=True,
            file=sys.stderr,
            desc="train",
            unit="step",
            smoothing=0.1,
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Append one JSON line (with `step`) and mirror it to TensorBoard/W&B."""
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._append(json.dumps(row) + "\n")
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)
        for tracker in self.trackers:
            tracker.log(step, numeric)

    def _append(self, line: str) -> None:
        """Append one whole line: a failed write (a full disk) is cut back off, so the history
        never holds half a line, and raised naming the file."""
        data, start = line.encode(), self.file.tell()
        try:
            while data:
                data = data[self.file.write(data) :]
        except OSError as e:
            with contextlib.suppress(OSError):
                self.file.truncate(start)
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def progress(self, step: int, loss: float, lr: float, samples_per_s: float) -> None:
        """Advance the bar to `step` and show loss, lr and throughput."""
        if self.bar is None:
            return
        self.bar.set_postfix(
            loss=f"{loss:.4f}", lr=f"{lr:.2e}", sps=f"{samples_per_s:.0f}", refresh=False
        )
        self.bar.update(step - self.bar.n)

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        """Close every output. Called from Trainer.run's `finally`: a run that did not finish
        ended by the exception in flight there (the trackers record FAILED, or KILLED for a
        stop at a checkpoint)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        stopped = isinstance(sys.exc_info()[1], (TrainingStopped, KeyboardInterrupt))
        status = "FINISHED" if self.finished else "KILLED" if stopped else "FAILED"
        for tracker in self.trackers:
            tracker.close(status)
