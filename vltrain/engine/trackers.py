"""Experiment trackers beside metrics.jsonl: Weights & Biases and MLflow, written on rank 0.

Each tracker gets the numeric metrics of every logged step. Their run ids are kept in the run
folder (``trackers.json``), so ``train.resume=true`` continues the same W&B run
(``resume="allow"``) and the same MLflow run; ``train.overwrite=true`` deletes the file and the
next run starts new ones. MLflow also gets the resolved config, flattened, as params at the
start, and the run's summary.json, config.yaml, run_card.json and doctor.jsonl (those written)
as artifacts at the end. The packages are checked when the config loads (`check_trackers`).

W&B without credentials (no ``WANDB_API_KEY``, no ``wandb login`` entry in ~/.netrc) logs
offline into the run folder with a warning, unless online was asked for explicitly
(``log.wandb_mode=online`` or ``WANDB_MODE=online``): then the config is refused at load.
"""

from __future__ import annotations

import json
import netrc
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from vltrain.config import extras
from vltrain.config.core import ConfigError, to_dict
from vltrain.config.schema import Config
from vltrain.core.files import atomic_write_text

IDS_FILE = "trackers.json"
#: files of the run folder an MLflow run keeps as artifacts (those that exist at the end)
ARTIFACTS = ("summary.json", "config.yaml", "run_card.json", "doctor.jsonl")


class Tracker(Protocol):
    """What the run logger drives: one external experiment tracker."""

    name: str
    run_id: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, status: str) -> None:
        """End the run: `status` is FINISHED, FAILED or KILLED (stopped by a signal)."""


def check_trackers(cfg: Config) -> None:
    """The package of every tracker the config asks for is installed (ConfigError naming the
    extra otherwise)."""
    if cfg.log.wandb:
        extras.require("wandb", "'log.wandb'=true")
        if wandb_mode(cfg) == "online" and not wandb_credentials():
            how = (
                "log.wandb_mode=online"
                if cfg.log.wandb_mode == "online"
                else "WANDB_MODE=online (environment)"
            )
            raise ConfigError(
                f"log.wandb=true with {how} but no W&B credentials are set (WANDB_API_KEY, or "
                "`wandb login`): log in, or log offline with log.wandb_mode=offline and "
                "upload later with `wandb sync`"
            )
    if cfg.log.mlflow:
        extras.require("mlflow", "'log.mlflow'=true")


def wandb_mode(cfg: Config) -> str:
    """online, offline or disabled as asked (log.wandb_mode, else WANDB_MODE); auto when
    neither says: online with credentials, offline without (`WandbTracker`)."""
    mode = cfg.log.wandb_mode
    if mode == "auto":
        env = os.environ.get("WANDB_MODE", "").strip().lower()
        mode = {"dryrun": "offline", "run": "online", "": "auto"}.get(env, env)
    return mode


def wandb_credentials() -> bool:
    """An API key in the environment, or a ~/.netrc entry for the W&B host (`wandb login`)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").netloc
    home = Path.home()
    path = os.environ.get("NETRC") or next(
        (str(p) for p in (home / ".netrc", home / "_netrc") if p.is_file()), ""
    )
    try:
        entry = netrc.netrc(path).authenticators(host) if path else None
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def flat_config(cfg: Config) -> dict[str, Any]:
    """`section.key -> value` for every config leaf (W&B's run config, MLflow's params)."""
    out: dict[str, Any] = {}
    for name, value in to_dict(cfg).items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v for k, v in value.items()})
        else:
            out[name] = value
    return out


def open_trackers(cfg: Config, out_dir: Path) -> list[Tracker]:
    """The trackers `cfg.log` asks for, each continuing its run of this folder on resume."""
    ids = read_ids(out_dir) if cfg.train.resume else {}
    opened: list[Tracker] = []
    if cfg.log.wandb:
        opened.append(WandbTracker(cfg, out_dir, ids.get("wandb")))
    if cfg.log.mlflow:
        opened.append(MlflowTracker(cfg, out_dir, ids.get("mlflow")))
    if opened:
        ids.update({t.name: t.run_id for t in opened})
        atomic_write_text(out_dir / IDS_FILE, json.dumps(ids, indent=2) + "\n")
    return opened


def read_ids(out_dir: Path) -> dict[str, str]:
    """Tracker name -> run id of the runs this folder logged to ({} when none)."""
    path = out_dir / IDS_FILE
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in ids.items()} if isinstance(ids, dict) else {}


def run_name(cfg: Config) -> str:
    """The run folder's name: the default run name of every tracker."""
    return Path(cfg.run.out_dir).resolve().name


class WandbTracker:
    """A W&B run (project, entity, name, tags, group from ``log.wandb_*``)."""

    name = "wandb"

    def __init__(self, cfg: Config, out_dir: Path, run_id: str | None) -> None:
        import wandb
        from wandb.sdk.lib.runid import generate_id

        log = cfg.log
        self.run_id = run_id or generate_id()
        mode = wandb_mode(cfg)
        if mode == "auto":
            mode = "online" if wandb_credentials() else "offline"
            if mode == "offline":
                print(
                    "vltrain: warning: log.wandb=true but no W&B credentials (WANDB_API_KEY or "
                    f"`wandb login`): logging offline to {out_dir / 'wandb'}; upload it later "
                    "with `wandb sync`, or set log.wandb_mode=online to require a login",
                    file=sys.stderr,
                )
        self.mode = mode
        self.run = wandb.init(
            mode=mode,
            project=log.wandb_project,
            entity=log.wandb_entity or None,
            name=log.wandb_name or run_name(cfg),
            tags=list(log.wandb_tags) or None,
            group=log.wandb_group or None,
            dir=str(out_dir),
            id=self.run_id,
            resume="allow",
        )
        # on resume, keys allowed to change (train.allow_changes) take their new values
        self.run.config.update(flat_config(cfg), allow_val_change=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self, status: str) -> None:
        if status == "KILLED":  # stopped at a checkpoint, to be resumed
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class MlflowTracker:
    """An MLflow run in experiment ``log.mlflow_experiment`` of ``log.mlflow_uri`` (default: a
    store inside the run folder, sqlite at mlruns/mlflow.db with artifacts in
    mlruns/artifacts; MLflow 3 keeps its plain-file store in maintenance mode only)."""

    name = "mlflow"

    def __init__(self, cfg: Config, out_dir: Path, run_id: str | None) -> None:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.out_dir = out_dir
        store = (out_dir / "mlruns").resolve()
        if not cfg.log.mlflow_uri:
            store.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(cfg.log.mlflow_uri or f"sqlite:///{store / 'mlflow.db'}")
        logged: dict[str, str] = {}
        if run_id is not None:
            try:
                logged = self.client.get_run(run_id).data.params
                self.client.update_run(run_id, status="RUNNING")
            except MlflowException:  # not in this store (log.mlflow_uri changed): a new run
                run_id = None
        if run_id is None:
            name = cfg.log.mlflow_experiment
            experiment = self.client.get_experiment_by_name(name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                where = None if cfg.log.mlflow_uri else (store / "artifacts").as_uri()
                experiment_id = self.client.create_experiment(name, artifact_location=where)
            tags = {"vltrain.out_dir": str(out_dir.resolve()), "vltrain.stage": cfg.stage}
            run = self.client.create_run(experiment_id, run_name=run_name(cfg), tags=tags)
            run_id = run.info.run_id
        self.run_id = run_id
        self._log_params(flat_config(cfg), logged)

    def _log_params(self, flat: dict[str, Any], logged: dict[str, str]) -> None:
        """Params once per key (MLflow's are immutable); on resume, a key whose value changed
        (train.allow_changes) is recorded as a tag ``changed.<key>``."""
        from mlflow.entities import Param, RunTag
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        values = {k: str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in flat.items()}
        params = [Param(k, v) for k, v in values.items() if k not in logged]
        tags = [RunTag(f"changed.{k}", v) for k, v in values.items() if logged.get(k, v) != v]
        for i in range(0, max(len(params), len(tags)), MAX_PARAMS_TAGS_PER_BATCH):
            end = i + MAX_PARAMS_TAGS_PER_BATCH
            self.client.log_batch(self.run_id, params=params[i:end], tags=tags[i:end])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(metric_name(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self, status: str) -> None:
        for name in ARTIFACTS:
            if (self.out_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.out_dir / name))
        self.client.set_terminated(self.run_id, status=status)


def metric_name(name: str) -> str:
    """An MLflow metric name (letters, digits and ``_-./ `` only): ``eval_R@1`` ->
    ``eval_R_at_1``."""
    return re.sub(r"[^\w\-./ ]", "_", name.replace("@", "_at_"))
