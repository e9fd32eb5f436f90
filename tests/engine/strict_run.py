"""`vltrain` under torchrun, recording which code's collectives pass strict mode's checkpoint.

    python -m torch.distributed.run ... -m tests.engine.strict_run MODE OUT_DIR vltrain-args...

MODE: "placed" (vltrain as shipped), "unplaced" (placement stops marking its tensors from the
first training step on), "legacy" (the helpers vltrain had before issue 11). Each rank writes
OUT_DIR/rank<R>.json: {"<helper> <- <caller>": number of collectives}, where the caller is the
first vltrain function outside distributed.py on the stack.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from vltrain.core import distributed
from vltrain.engine import loop

calls: Counter[str] = Counter()


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if mod.startswith("vltrain.") and mod != distributed.__name__:
            return f"{mod}.{frame.f_code.co_qualname}"
        frame = frame.f_back
    return "?"


def _record(check: Any) -> Any:
    def recording(where: str, tensors: list) -> None:
        if not where.startswith("torch.distributed."):  # a helper, not the raw-call guard
            calls[f"{where} <- {_caller()}"] += 1
        check(where, tensors)

    return recording


def _patch(mode: str) -> None:
    if mode == "unplaced":
        vote = loop._vote

        def unplaced_from_first_step(*args: Any, **kwargs: Any) -> tuple[int, int]:
            distributed._mark = lambda t: t  # placement still copies, but no longer marks
            return vote(*args, **kwargs)

        loop._vote = unplaced_from_first_step
    elif mode == "legacy":
        from tests.engine import legacy_distributed

        for name in ("barrier", "all_reduce_sum", "all_reduce_mean", "all_reduce_max"):
            setattr(distributed, name, getattr(legacy_distributed, name))
        for name in ("broadcast_object", "all_gather_object", "all_gather_with_grad"):
            setattr(distributed, name, getattr(legacy_distributed, name))
        distributed.all_gather_no_grad = legacy_distributed.all_gather_no_grad
    elif mode != "placed":
        raise SystemExit(f"unknown mode {mode!r}")


def main() -> int:
    mode, out, *args = sys.argv[1:]
    distributed._check = _record(distributed._check)
    _patch(mode)
    from vltrain.cli import main as vltrain_main

    try:
        return vltrain_main(args)
    finally:
        Path(out, f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(calls, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
