"""Writing user-visible files safely: through a temp file + rename, never over an input.

A command killed mid-write (or out of disk) leaves the old file intact instead of a half-written
one, and `vltrain mine --out X --data X` is refused instead of reading a file it truncates.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path


class OutputError(ValueError):
    """An output path that cannot be written as asked (a folder, the command's own input)."""


def check_output_path(out: str | os.PathLike[str], option: str = "--out") -> Path:
    """`out` as a Path, refusing an empty path and an existing directory."""
    if not str(out).strip():
        raise OutputError(f"{option} is empty; give a file path")
    p = Path(out)
    if p.is_dir():
        raise OutputError(f"{option} {p} is a directory; give a file path, e.g. {p / 'out.txt'}")
    return p


def run_folder_of(path: str | os.PathLike[str]) -> Path | None:
    """The run folder `path` is (or lies inside), or None: a folder holding config.yaml and
    either checkpoints/ or metrics.jsonl, as every `vltrain train` leaves one."""
    p = Path(path).resolve()
    for folder in (p, *p.parents):
        if (folder / "config.yaml").is_file() and (
            (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file()
        ):
            return folder
    return None


def check_not_input(
    out: str | os.PathLike[str],
    inputs: Iterable[str | os.PathLike[str]],
    option: str = "--out",
    own_run: str | os.PathLike[str] | None = None,
) -> None:
    """Refuse an output that is (after resolving symlinks and `..`) one of the inputs, or lies
    inside a run folder other than `own_run` (a run's files belong to the run that wrote them:
    a report, an export or a metrics file written there could replace config.yaml, the
    history or the weights the loaders pick)."""
    target = Path(out).resolve()
    run = run_folder_of(target)
    if run is not None and (own_run is None or Path(own_run).resolve() != run):
        raise OutputError(
            f"{option} {out} is inside the run folder {run}, whose files belong to the run "
            f"(config.yaml, metrics.jsonl, checkpoints/); write it outside, e.g. "
            f"{run.parent / (run.name + '_' + (target.name if target != run else 'export'))}"
        )
    for src in inputs:
        if Path(src).resolve() == target:
            raise OutputError(
                f"{option} {out} is the input file {src}; writing it would destroy the data "
                "being read. Choose another output file."
            )


#: errnos of a full disk or an exhausted quota
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# how the writers that do not raise OSError say it: safetensors ("IoError(Os { code: 28, kind:
# StorageFull, ...})"), shutil.copytree (a list of (src, dst, "[Errno 28] No space ...")) and
# strerror itself
_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "StorageFull", "code: 28,")


def is_disk_full(e: BaseException | None) -> bool:
    """Whether `e`, or an exception it was raised from, reports a full disk or quota."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return True
        if any(text in str(e) for text in _DISK_FULL_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


#: how serialisers report an I/O failure that is not an OSError (torch's zip writer)
_WRITE_FAILED_TEXT = ("PytorchStreamWriter failed", "file write failed")


def is_write_failure(e: BaseException) -> bool:
    """Whether `e` is the file system failing a write (an OSError, a full disk however the
    serialiser words it, safetensors' or torch's writer failing), not a bug in what is written."""
    if isinstance(e, OSError) or is_disk_full(e) or type(e).__name__ == "SafetensorError":
        return True
    return any(text in str(e) for text in _WRITE_FAILED_TEXT)


def free_space(path: str | os.PathLike[str]) -> str:
    """The free space of the file system holding `path` (its nearest existing folder), e.g.
    `3.2 MiB free on /mnt/runs`."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        free = shutil.disk_usage(p).free
    except OSError:
        return "free space unknown"
    size = f"{free / 2**30:.1f} GiB" if free >= 2**30 else f"{free / 2**20:.1f} MiB"
    return f"{size} free on {p}"


def write_failure(path: str | os.PathLike[str], e: BaseException) -> str:
    """`cannot write PATH: disk full (3.2 MiB free on /mnt/runs)`, or the error's first line
    instead of "disk full" when it is something else."""
    if is_disk_full(e):
        reason = "disk full"
    else:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = lines[0][:300]
    return f"cannot write {path}: {reason} ({free_space(path)})"


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write `text` to `path` through a temp file in the same folder, fsync, then rename."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # what open() would give, not mkstemp's 0600
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a failed write: name the file
            raise OSError(e.errno, e.strerror, str(p)) from None
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_lines(path: str | os.PathLike[str], lines: Iterable[str]) -> int:
    """Write one line per item (newline added) atomically; returns the number written."""
    rows = list(lines)
    atomic_write_text(path, "".join(f"{row}\n" for row in rows))
    return len(rows)


def file_version(path: str | os.PathLike[str]) -> tuple[str, int | None, int | None]:
    """(resolved path, size, mtime_ns) of `path` (size and mtime None when it does not exist):
    the key of a per-process cache of something derived from the file's content."""
    p = Path(path)
    st = p.stat() if p.exists() else None
    return str(p.resolve()), st and st.st_size, st and st.st_mtime_ns
