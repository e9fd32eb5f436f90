"""Several `vltrain train` runs under one torchrun launch, one after another in one process group
(as `vltrain tune` runs its trials): the clean matrix's 2-process cells share the launch's
start-up (torchrun and two interpreters importing torch, ~6 s each cell on 2 shared cores).

    python -m torch.distributed.run ... -m tests.diagnostics.matrix_runs RUNS.json

RUNS.json: a list of `vltrain` argument lists, each `["train", CONFIG, overrides...]`. A run
that raises ends the launch (a peer may wait in a collective), naming the run on stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vltrain.cli import build_parser
from vltrain.core import distributed
from vltrain.runs import train
from vltrain.stages import load_run_config


def main(path: str) -> None:
    runs = json.loads(Path(path).read_text())
    try:
        for argv in runs:
            args = build_parser().parse_args(argv)
            try:
                train(load_run_config(args.config, args.overrides))
            except BaseException:
                print(f"matrix_runs: run failed: {' '.join(argv)}", file=sys.stderr, flush=True)
                raise
    except BaseException:
        distributed.shutdown()
        raise
    distributed.shutdown(finished=True)


if __name__ == "__main__":
    main(sys.argv[1])
