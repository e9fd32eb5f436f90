"""Where a study lives: SQLite (default), a journal file, or any SQLAlchemy URL.

Also the two things a resumable search needs besides storage: failing the trials of workers
that died, and keeping storage passwords out of every log line, error, config dump and report.

Dead workers are found two ways. Every trial records its worker (host, pid, process start
time); on start, a RUNNING trial whose worker ran on this host and no longer exists is marked
FAIL at once (this covers kill -9 and the journal storage, which has no heartbeats). For SQL
storages, trials also send Optuna heartbeats, so a trial whose worker died on another machine is
failed once it has been silent for two heartbeat intervals.
"""

from __future__ import annotations

import json
import os
import re
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from vltrain.config.core import ConfigError


class TuneError(ConfigError):
    """A search cannot start or continue; the message says why and what to do."""


@dataclass
class StorageSpec:
    """A resolved `tune.storage`: its kind, what to open, and a printable (redacted) form."""

    kind: str  # "sqlite", "journal" or "rdb"
    target: str  # a SQLAlchemy URL, or the journal file path
    secrets: tuple[str, ...] = ()

    @property
    def display(self) -> str:
        """The URL or path with any password replaced by ***."""
        return scrub(self.target, self.secrets)


_QUERY_SECRET = re.compile(r"([?&][^=&]*(?:pass|secret|token|key)[^=&]*=)([^&]+)", re.I)


def url_secrets(url: str) -> tuple[str, ...]:
    """Every form in which `url`'s password (and secret query values) could be printed."""
    out: set[str] = set()
    try:
        parts = urlsplit(url)
        if parts.password:
            out |= {parts.password, unquote(parts.password), quote(unquote(parts.password))}
    except ValueError:
        pass
    m = re.match(r"^[^:/]+://[^:/@]*:(.+)@[^@]*$", url)  # passwords holding '/' or '@'
    if m:
        out |= {m.group(1), unquote(m.group(1))}
    for q in _QUERY_SECRET.finditer(url):
        out |= {q.group(2), unquote(q.group(2))}
    return tuple(sorted((s for s in out if s), key=len, reverse=True))


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """`text` with every secret replaced by ***."""
    for s in secrets:
        text = text.replace(s, "***")
    return text


def redact(url: str) -> str:
    """A storage URL safe to print: `postgresql://user:***@host/db`."""
    return scrub(url, url_secrets(url))


def resolve_storage(value: str, study_dir: Path) -> StorageSpec:
    """Turn `tune.storage` into a StorageSpec (see TuneConfig.storage for the forms)."""
    value = value.strip()
    if value.startswith("env:"):
        var = value[4:]
        if not os.environ.get(var):
            raise TuneError(
                f"tune.storage is {value!r} but environment variable {var} is unset "
                "or empty; export it with the storage URL"
            )
        value = os.environ[var].strip()
    if not value:
        return StorageSpec("sqlite", f"sqlite:///{(study_dir / 'study.db').resolve()}")
    if value == "journal" or value.startswith("journal:"):
        path = Path(value[8:]) if value.startswith("journal:") else study_dir / "journal.log"
        return StorageSpec("journal", str(path.resolve()))
    if "://" in value:
        kind = "sqlite" if value.startswith("sqlite") else "rdb"
        return StorageSpec(kind, value, url_secrets(value))
    raise TuneError(
        f"tune.storage {redact(value)!r} is not understood; use '' (SQLite in the "
        "study dir), 'journal', 'journal:PATH', a SQLAlchemy URL such as "
        "postgresql://user@host/db, or env:VAR"
    )


def open_storage(spec: StorageSpec, heartbeat_interval: int) -> Any:
    """Open (creating if needed) the Optuna storage; errors never show the password."""
    import optuna

    try:
        if spec.kind == "journal":
            from optuna.storages import JournalStorage

            try:
                from optuna.storages.journal import JournalFileBackend
            except ImportError:  # optuna < 4
                from optuna.storages import JournalFileStorage as JournalFileBackend

            Path(spec.target).parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(spec.target))
        if spec.kind == "sqlite":
            path = spec.target.split(":///", 1)[-1]
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
        hb = heartbeat_interval or None
        kwargs = {"connect_args": {"timeout": 60}} if spec.kind == "sqlite" else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.storages.RDBStorage(
                spec.target,
                engine_kwargs=kwargs,
                heartbeat_interval=hb,
                grace_period=2 * hb if hb else None,
            )
    except Exception as e:
        detail = scrub(f"{type(e).__name__}: {e}", spec.secrets)
        hint = (
            "install its database driver (e.g. pip install psycopg2-binary for "
            "postgresql://) and check that the server is reachable"
            if spec.kind == "rdb"
            else "check that the folder is writable"
        )
        raise TuneError(f"cannot open study storage {spec.display}: {detail}; {hint}") from None


# ---- dead workers --------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a live process from /proc, or None where /proc is unavailable."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may contain spaces
    return fields[0], fields[19]


def worker_identity() -> dict[str, Any]:
    """Who runs a trial: host, pid and process start time (so a reused pid is not mistaken)."""
    stat = _proc_stat(os.getpid())
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": stat[1] if stat else ""}


def worker_alive(worker: dict[str, Any]) -> bool:
    """False only when `worker` ran on this host and its process is gone (or a zombie)."""
    if worker.get("host") != socket.gethostname():
        return True  # another machine: heartbeats decide
    pid = int(worker.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    except (OSError, ValueError):
        return False
    stat = _proc_stat(pid)
    if stat is None:
        return True
    state, start = stat
    return state != "Z" and (not worker.get("start") or start == worker["start"])


def fail_dead_trials(study: Any, storage: Any) -> list[int]:
    """Mark FAIL every RUNNING trial whose worker died on this host; returns their numbers."""
    from optuna.trial import TrialState

    failed = []
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if not worker or worker_alive(worker):
            continue
        reason = (
            f"its worker (pid {worker['pid']} on {worker['host']}) died while it was "
            "running; marked failed when the search was resumed"
        )
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        try:
            storage.set_trial_user_attr(trial_id, "fail_reason", reason)
            storage.set_trial_state_values(trial_id, TrialState.FAIL)
        except Exception:
            continue
        run_dir = t.user_attrs.get("run_dir")
        if run_dir:  # the worker may have died before it created the folder: write it anyway
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            status = {"number": t.number, "state": "FAIL", "reason": reason, "params": t.params}
            (Path(run_dir) / "trial.json").write_text(json.dumps(status, indent=2))
        failed.append(t.number)
    return failed
