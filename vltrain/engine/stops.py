"""How a run stops on purpose: the exceptions the loop raises, the logger and the CLI read."""

from __future__ import annotations


class TrainingAborted(RuntimeError):
    """Training stopped on purpose (non-finite steps, bad data); the message says why."""


class TrainingStopped(TrainingAborted):
    """SIGTERM or SIGINT (to this rank, another rank, the process group or torchrun): every
    rank stopped at the same step boundary and a checkpoint was written; `signal` is the
    signal number (SIGTERM on a rank that was stopped by another rank's signal)."""

    def __init__(self, message: str, signal: int) -> None:
        super().__init__(message)
        self.signal = signal
