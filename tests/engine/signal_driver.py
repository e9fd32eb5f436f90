"""`python -m tests.engine.signal_driver WHERE STEP SIGNAL ARGS...`: the vltrain CLI (ARGS) with
one hook that sends SIGNAL to this process's whole process group (the trainer and its DataLoader
workers, as SLURM, Kubernetes and `timeout` do) at a fixed moment of step STEP, so a signal test
stops at a known boundary without timing luck.

WHERE: `step` (after the optimizer step, before evaluation and saving), `save` (inside the
checkpoint write, between the weights and the trainer state) or `eval` (inside the evaluation).
Under torchrun only rank SIGNAL_RANK (default 0) sends; `TARGET=rank` in the environment sends
to that process alone instead of its group.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from vltrain.cli import main
from vltrain.core import checkpoint
from vltrain.engine import loop


def _install(where: str, step: int, sig: int) -> None:
    fired: list[bool] = []
    state = {"step": -1}

    def fire(at: int) -> None:
        if fired or at != step or os.environ.get("RANK", "0") != os.environ.get("SIGNAL_RANK", "0"):
            return
        fired.append(True)
        # sent by a child, as `kill` or a cluster's agent would: a DataLoader worker tells its
        # parent's signals from outside ones (torch's worker handler exits quietly on the former)
        group, me = os.getpgrp(), os.getpid()
        child = os.fork()
        if child == 0:
            if os.environ.get("TARGET") == "rank":
                os.kill(me, sig)
            else:
                os.killpg(group, sig)
            os._exit(0)
        os.waitpid(child, 0)

    real_save_eval = loop.Trainer._maybe_eval_and_save

    def after_step(self, model, logger):
        state["step"] = self.state.step
        if where == "step":
            fire(self.state.step)
        return real_save_eval(self, model, logger)

    loop.Trainer._maybe_eval_and_save = after_step
    if where == "eval":
        real_eval = loop.Trainer.evaluate

        def evaluate(self, model, split):
            fire(self.state.step)
            return real_eval(self, model, split)

        loop.Trainer.evaluate = evaluate
    if where == "save":
        real_torch_save = torch.save

        def save(obj, f, *a, **k):  # the trainer state, written after the weights
            if str(f).endswith("trainer_state.pt"):
                fire(state["step"])
            return real_torch_save(obj, f, *a, **k)

        checkpoint.torch.save = save  # type: ignore[attr-defined]


if __name__ == "__main__":
    _install(sys.argv[1], int(sys.argv[2]), signal.Signals[sys.argv[3]].value)
    raise SystemExit(main(sys.argv[4:]))
