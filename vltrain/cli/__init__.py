"""`vltrain <command>`: parse, validate, dispatch; user errors print without a traceback.

Each command is a module here with `add_parser(subparsers)` and `run(args) -> exit code`,
listed once in COMMANDS.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Sequence

from vltrain.cli import (
    config_docs,
    data,
    doctor,
    eval,
    export,
    generate,
    mine,
    pipeline,
    presets,
    quickstart,
    report,
    scaling,
    train,
    tune,
)

#: top-level commands, in --help order
COMMANDS = (
    train,
    pipeline,
    data,
    quickstart,
    tune,
    scaling,
    eval,
    generate,
    mine,
    export,
    doctor,
    report,
    presets,
    config_docs,
)

# errno -> what it means for the user (strerror is kept after it)
OS_ERRORS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "read-only file system",
    errno.ENOENT: "not found",
    errno.EISDIR: "is a directory, not a file",
    errno.ENOTDIR: "a parent is a file, not a directory",
    errno.EEXIST: "already exists",
}


def version() -> str:
    """The installed distribution's version, else the package's own `__version__`."""
    from importlib import metadata

    try:
        return metadata.version("vltrain")
    except metadata.PackageNotFoundError:
        from vltrain import __version__

        return __version__


def os_error_message(e: OSError) -> str:
    """`<what> <path>: <strerror>` for an OSError, naming both paths of a failed rename."""
    what = OS_ERRORS.get(e.errno or -1, "cannot use")
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    reason = e.strerror or str(e)
    if not paths:  # raised with a message only, e.g. FileNotFoundError("no config.yaml ...")
        return str(e) if not e.strerror else f"{what}: {reason}"
    hint = ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        from vltrain.core.files import free_space

        where = e.filename if e.filename is not None else e.filename2
        hint = f" ({free_space(where)}; free space or write elsewhere)"
    return f"{what} {paths}: {reason}{hint}"


def worker_message(e: BaseException) -> str:
    """The message of an error a DataLoader worker raised, without the traceback torch wraps
    it in ("Caught DataError in DataLoader worker process 0. Original Traceback ...")."""
    text = str(e)
    if not text.startswith("Caught ") or "Original Traceback" not in text:
        return text
    for marker in (f"\n{type(e).__module__}.{type(e).__name__}: ", f"\n{type(e).__name__}: "):
        if marker in text:
            return text[text.rindex(marker) + len(marker) :].strip()
    return text.rstrip().rsplit("\n", 1)[-1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vltrain", description=__doc__.split("\n")[0])
    p.add_argument("--version", action="version", version=f"vltrain {version()}")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `vltrain` console script."""
    from vltrain.config.core import ConfigError
    from vltrain.config.extras import install_hint
    from vltrain.core.checkpoint import CheckpointError
    from vltrain.core.files import OutputError
    from vltrain.data.readers import DataError
    from vltrain.data.records import DataQualityError
    from vltrain.diagnostics.doctor import DoctorAbort
    from vltrain.engine.stops import TrainingAborted, TrainingStopped

    args = build_parser().parse_args(argv)
    try:
        try:
            return args.fn(args)
        except BaseException:  # a failed loader's workers ignore SIGTERM: exit would wait
            from vltrain.data.loaders import stop_workers

            stop_workers()
            raise
    except TrainingStopped as e:  # SIGTERM/SIGINT: a checkpoint was written; not an error
        print(f"vltrain: {e}", file=sys.stderr)
        return 128 + e.signal
    except (
        ConfigError,
        DataError,
        DataQualityError,
        TrainingAborted,
        DoctorAbort,
        CheckpointError,
        OutputError,
    ) as e:
        print(f"vltrain: error: {worker_message(e)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional dependency the install lacks
        hint = install_hint(e.name or "")
        if hint is None:
            raise
        print(f"vltrain: error: this command needs {e.name}: {hint}", file=sys.stderr)
        return 2
    except OSError as e:  # a path the user gave or the disk: name it, no traceback
        print(f"vltrain: error: {os_error_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vltrain: interrupted", file=sys.stderr)
        return 130
