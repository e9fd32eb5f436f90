"""`vltrain tune`: pruning, failing trials, kill -9 and resume, best.yaml, and config checks.

The trials are the tiny CLIP run of tests/conftest.py for 4 steps with an eval every 2, so a
whole study takes seconds. Enqueued parameter sets make every trial's fate deterministic:

    trial 0: lr 1e-3  -> completes (first trial: the median pruner never prunes it)
    trial 1: lr 1e30  -> weights blow up, non-finite loss -> the engine aborts -> FAIL
    trial 2: lr 1e-6  -> barely learns: worse than trial 0 at step 2 -> pruned there, and
                         proof that the search went on after the failure
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from tests.conftest import REPO, tiny_overrides
from vltrain.cli import main
from vltrain.config import ConfigError, load_config
from vltrain.runs.tune.command import parse_rest
from vltrain.runs.tune.search import run_search
from vltrain.runs.tune.space import corner_params, parse_space
from vltrain.runs.tune.storage import TuneError, redact, resolve_storage, worker_alive

TUNE = {
    "metric": "eval_loss",
    "direction": "minimize",
    "max_steps": 4,
    "eval_every": 2,
    "n_startup_trials": 1,
    "space": {"optim.lr": {"type": "categorical", "choices": [1.0e-3, 2.0e-3, 1.0e-6, 1.0e30]}},
    "enqueue": [{"optim.lr": v} for v in (1.0e-3, 1.0e30, 1.0e-6)],
}


def _write_config(path: Path, data: Path, out: Path, **tune: object) -> Path:
    """A tune config: the tiny run of conftest.py plus a `tune` section."""
    tree: dict = {}
    extra = {"train.max_consecutive_skips": 1, "run.threads": 1}  # 1 thread: fast on a busy CPU
    for item in tiny_overrides(data, out, **extra):
        key, value = item.split("=", 1)
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    tree["tune"] = {**TUNE, **tune}
    path.write_text(yaml.safe_dump(tree))
    return path


def _trials(study_dir: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{study_dir / 'study.db'}")
    return study.get_trials()


@pytest.fixture(scope="module")
def study(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One 3-trial study shared by the tests below (completed, failed, pruned trials)."""
    root = tmp_path_factory.mktemp("tune")
    cfg = _write_config(root / "tune.yaml", shapes_dir, root / "runs")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        summary = run_search(str(cfg), trials=2, study="s")
    study_dir = root / "runs" / "s"
    return {
        "cfg": cfg,
        "dir": study_dir,
        "summary": summary,
        "stdout": buf.getvalue(),
        "trials": _trials(study_dir, "s"),
    }


def test_unpromising_trial_is_pruned_and_its_run_dir_says_why(study: dict) -> None:
    t0, t2 = study["trials"][0], study["trials"][2]
    # negative control: the first trial ran its full budget unpruned
    assert t0.state.name == "COMPLETE" and sorted(t0.intermediate_values) == [2, 4]
    assert t2.state.name == "PRUNED"
    assert sorted(t2.intermediate_values) == [2]  # reported once, stopped at the first eval
    assert t2.intermediate_values[2] > t0.intermediate_values[2]  # why the median pruned it
    status = json.loads((study["dir"] / "trial_0002" / "trial.json").read_text())
    assert status["state"] == "pruned" and "median" in status["reason"]
    steps = [
        json.loads(line)["step"]
        for line in (study["dir"] / "trial_0002" / "metrics.jsonl").read_text().splitlines()
    ]
    assert max(steps) == 2  # training really stopped (the budget was 4 steps)
    assert "PRUNED" in study["stdout"]


def test_failing_trial_is_recorded_and_the_study_goes_on(study: dict) -> None:
    t1 = study["trials"][1]
    assert t1.state.name == "FAIL" and t1.params["optim.lr"] == 1.0e30
    assert "TrainingAborted" in t1.user_attrs["fail_reason"]
    run_dir = study["dir"] / "trial_0001"
    assert json.loads((run_dir / "trial.json").read_text())["state"] == "failed"
    assert "TrainingAborted" in (run_dir / "error.txt").read_text()
    # the search went on after the failure until 2 trials had finished
    assert [t.state.name for t in study["trials"]] == ["COMPLETE", "FAIL", "PRUNED"]
    assert study["summary"]["states"] == {"COMPLETE": 1, "PRUNED": 1, "FAIL": 1, "RUNNING": 0}


def test_results_table_and_plots_are_written(study: dict) -> None:
    d = study["dir"]
    table = (d / "trials.md").read_text()
    assert table.count("\n") == 2 + 3  # header, rule, one row per trial
    assert "PRUNED" in table and "FAIL" in table and "optim.lr" in table
    for name in ("optimization_history", "intermediate_values"):
        assert (d / f"{name}.html").stat().st_size > 0
        assert (d / f"{name}.png").stat().st_size > 0
    # one completed trial: importances are meaningless, so skipped with a note (not an error)
    assert not (d / "param_importances.png").exists()
    assert study["summary"]["plot_notes"] == [
        "param_importances: needs at least 2 completed trials"
    ]
    assert json.loads((d / "summary.json").read_text())["best"]["number"] == 0


def test_best_yaml_is_the_base_config_with_best_params_and_trains(
    study: dict, tmp_path: Path
) -> None:
    best = study["summary"]["best"]
    path = study["dir"] / "best.yaml"
    cfg = load_config(path)
    base = load_config(study["cfg"])
    assert cfg.optim.lr == best["params"]["optim.lr"]
    assert cfg.train.max_steps == base.train.max_steps  # the full budget, not the trial's 4
    assert cfg.data.max_train_samples == base.data.max_train_samples
    assert cfg.data.train == base.data.train and cfg.tune.space == {}
    out = tmp_path / "stage1"
    rc = main(["train", str(path), f"run.out_dir={out}", "train.max_steps=2"])
    assert rc == 0 and json.loads((out / "summary.json").read_text())["steps"] == 2


def _schema_ready(db: Path) -> bool:
    """True once the tune process has created the study schema. Reading it earlier through
    optuna would make this test race the tune process to create the tables."""
    import sqlite3

    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
        try:
            rows = con.execute("SELECT version_num FROM alembic_version").fetchall()
            con.execute("SELECT count(*) FROM trials").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return bool(rows)


def _wait_for_running_trial(
    db: Path, name: str, proc: subprocess.Popen, timeout: float = 240.0
) -> None:
    """Until the study holds a completed trial and a second one running."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"tune exited early:\n{proc.stderr.read().decode()[-3000:]}"
        if db.is_file() and _schema_ready(db):
            try:
                trials = _trials(db.parent, name)
            except Exception:
                trials = []
            running = [t for t in trials if t.state.name == "RUNNING"]
            done = [t for t in trials if t.state.name == "COMPLETE"]
            if done and running and "worker" in running[0].user_attrs:
                return
        time.sleep(0.2)
    pytest.fail("no trial was running within the timeout")


@pytest.mark.slow
def test_killed_search_resumes_keeping_completed_trials(shapes_dir: Path, tmp_path: Path) -> None:
    cfg = _write_config(
        tmp_path / "tune.yaml",
        shapes_dir,
        tmp_path / "runs",
        pruner="none",
        max_steps=2,
        enqueue=[],
        space={"optim.lr": {"type": "categorical", "choices": [1.0e-3, 2.0e-3]}},
    )
    study_dir = tmp_path / "runs" / "k"
    cmd = [sys.executable, "-m", "vltrain", "tune", str(cfg), "--trials", "2", "--study", "k"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        _wait_for_running_trial(study_dir / "study.db", "k", proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    before = _trials(study_dir, "k")
    assert [t.state.name for t in before] == ["COMPLETE", "RUNNING"]
    assert not worker_alive(before[1].user_attrs["worker"])

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run_search(str(cfg), trials=2, study="k")
    after = _trials(study_dir, "k")
    assert after[0].state.name == "COMPLETE" and after[0].value == before[0].value
    assert after[1].state.name == "FAIL" and "died" in after[1].user_attrs["fail_reason"]
    assert "died" in json.loads((study_dir / "trial_0001" / "trial.json").read_text())["reason"]
    assert [t.state.name for t in after[2:]] == ["COMPLETE"]  # 2 finished, as asked
    assert "marked failed (their worker died): trials [1]" in buf.getvalue()


def test_invalid_space_fails_before_any_trial_runs(shapes_dir: Path, tmp_path: Path) -> None:
    space = {"optim.warmup_steps": {"type": "int", "low": 0, "high": 50}}
    cfg = _write_config(tmp_path / "t.yaml", shapes_dir, tmp_path / "runs", space=space, enqueue=[])
    with pytest.raises(ConfigError, match=r"invalid.*optim.warmup_steps.*50.*max_steps"):
        run_search(str(cfg), study="bad")
    assert not (tmp_path / "runs" / "bad").exists()  # no trial, no storage
    # negative control: the same space within the 4-step budget passes the check
    ok = parse_space({"optim.warmup_steps": {"type": "int", "low": 0, "high": 4}})
    assert corner_params(ok) == [{"optim.warmup_steps": 0}, {"optim.warmup_steps": 4}]


@pytest.mark.parametrize(
    "space, message",
    [
        ({"optim.lrr": {"type": "float", "low": 1, "high": 2}}, "did you mean optim.lr?"),
        ({"optim.lr": {"type": "float", "lo": 1, "high": 2}}, "did you mean low?"),
        ({"optim.lr": {"type": "flaot", "low": 1, "high": 2}}, "type must be one of"),
        ({"optim.lr": {"type": "float", "low": 0, "high": 1, "log": True}}, "log scale"),
        ({"train.max_steps": {"type": "int", "low": 1, "high": 2}}, "tune.max_steps"),
        ({"optim": {"type": "categorical", "choices": [1]}}, "unknown config key 'optim'"),
        ({"data.batch_size": {"type": "categorical", "choices": []}}, "non-empty"),
    ],
)
def test_space_errors_name_the_key_and_the_fix(space: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace(".", r"\.")):
        parse_space(space)


def test_space_accepts_nested_keys_from_overrides() -> None:
    cfg = load_config(
        None,
        [
            "tune.space.optim.lr.type=float",
            "tune.space.optim.lr.low=1e-5",
            "tune.space.optim.lr.high=1e-3",
            "tune.space.optim.lr.log=true",
        ],
    )
    (spec,) = parse_space(cfg.tune.space)
    assert (spec.key, spec.low, spec.high, spec.log) == ("optim.lr", 1e-5, 1e-3, True)


def test_storage_passwords_never_printed(
    shapes_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    secret = "s3cr3t-Pw"
    url = f"postgresql://alice:{secret}@127.0.0.1:1/optuna"
    assert redact(url) == "postgresql://alice:***@127.0.0.1:1/optuna"
    assert secret not in redact(f"mysql+pymysql://u:{secret}@h/db?ssl_key=x")
    assert redact("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"  # negative control
    cfg = _write_config(tmp_path / "t.yaml", shapes_dir, tmp_path / "runs", enqueue=[])
    rc = main(["tune", str(cfg), "--storage", url, "--study", "p"])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot open study storage postgresql://alice:***@" in err
    assert secret not in err
    # a trial's dumped config carries the redacted URL only
    from vltrain.runs.tune.search import Search

    search = Search(str(cfg), storage=url, study="p")
    search._prepare()
    trial_cfg = search.plan.config({"optim.lr": 1e-3}, tmp_path / "trial")
    assert secret not in yaml.safe_dump(trial_cfg.tune.__dict__)
    assert resolve_storage(url, tmp_path).display == redact(url)


def test_options_may_follow_the_overrides() -> None:
    import argparse

    args = argparse.Namespace(
        trials=None,
        storage=None,
        study="a",
        rest=["optim.lr=1e-3", "--trials", "5", "data.batch_size=8"],
    )
    opts = parse_rest(args)
    assert opts == {
        "trials": 5,
        "storage": None,
        "study": "a",
        "overrides": ["optim.lr=1e-3", "data.batch_size=8"],
    }


def test_metric_must_be_logged_eval_metric(shapes_dir: Path, tmp_path: Path) -> None:
    cfg = _write_config(
        tmp_path / "t.yaml", shapes_dir, tmp_path / "runs", metric="R@1_mean", enqueue=[]
    )
    with pytest.raises(ConfigError, match="did you mean eval_R@1_mean"):
        run_search(str(cfg))
    cfg = _write_config(tmp_path / "t.yaml", shapes_dir, tmp_path / "runs", direction="")
    with pytest.raises(ConfigError, match="set tune.direction"):
        run_search(str(cfg))
    with pytest.raises(TuneError, match="not understood"):
        resolve_storage("mongodb-ish", tmp_path)


def test_dead_worker_trials_fail_on_a_journal_storage(tmp_path: Path) -> None:
    import socket

    from vltrain.runs.tune.storage import fail_dead_trials, open_storage, worker_identity

    spec = resolve_storage("journal", tmp_path)
    assert spec.kind == "journal" and spec.target.endswith("journal.log")
    storage = open_storage(spec, heartbeat_interval=0)
    study = optuna.create_study(storage=storage, study_name="j")
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    host = socket.gethostname()
    workers = [
        {"host": host, "pid": int(gone.stdout), "start": "1"},  # exited: fail it
        worker_identity(),  # this very process: alive, keep running
        {"host": "another-machine", "pid": int(gone.stdout), "start": ""},  # heartbeats decide
    ]
    for w in workers:
        study.ask().set_user_attr("worker", w)
    assert fail_dead_trials(study, storage) == [0]
    assert [t.state.name for t in study.get_trials()] == ["FAIL", "RUNNING", "RUNNING"]
    assert "died" in study.get_trials()[0].user_attrs["fail_reason"]


def test_a_trial_takes_the_tune_budget_not_the_base_epochs(
    shapes_dir: Path, tmp_path: Path
) -> None:
    """A base config with train.epochs: each trial trains tune's budget (its max_steps), not
    the base's epochs (which the budget hook would otherwise derive again)."""
    from vltrain.runs.tune.search import Search
    from vltrain.scaling.budget import resolve_budget

    path = _write_config(tmp_path / "t.yaml", shapes_dir, tmp_path / "runs")
    tree = yaml.safe_load(path.read_text())
    del tree["train"]["max_steps"]
    tree["train"].update(epochs=4, save_every_epoch=True)
    tree["optim"]["warmup_epochs"] = 0.25
    path.write_text(yaml.safe_dump(tree))
    search = Search(str(path), study="e")
    search._prepare()
    trial_cfg = search.plan.config({"optim.lr": 1e-3}, tmp_path / "trial")
    assert trial_cfg.train.epochs == 0 and not trial_cfg.train.save_every_epoch
    assert resolve_budget(trial_cfg).train.max_steps == trial_cfg.train.max_steps


def _open(cfg: Path, name: str, world_size: int) -> optuna.Study:
    """Create or resume study `name` as a search on `world_size` processes opens it."""
    import dataclasses

    from vltrain.runs.tune.search import Search

    search = Search(str(cfg), study=name)
    search._prepare()
    search.ctx = dataclasses.replace(search.ctx, world_size=world_size)
    search._open_study()
    return search.study


def test_a_resume_on_another_process_count_is_refused(shapes_dir: Path, tmp_path: Path) -> None:
    """Another process count is another global batch: a 1-process study resumed under
    torchrun with 2 was accepted and every new trial was pruned at its first evaluation
    (eval_loss near chance against the 1-process median)."""
    cfg = _write_config(tmp_path / "t.yaml", shapes_dir, tmp_path / "runs", enqueue=[])
    assert _open(cfg, "w", 1).user_attrs["vltrain"]["world_size"] == 1
    refused = r"study 'w' ran its trials on 1 process and this run has 2 processes: .*global batch"
    with pytest.raises(TuneError, match=refused + r".*resume on 1 process .*new --study$"):
        _open(cfg, "w", 2)
    _open(cfg, "w", 1)  # negative control: the same process count resumes
    # under torchrun every rank stops with the refusal: none waits on rank 0 or dies of it
    # (torchrun may end rank 1 before it prints its line once rank 0 has exited: >= 1 line)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "vltrain", "tune", str(cfg), "--study", "w"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in res.stderr.splitlines() if "vltrain: error:" in line]
    assert res.returncode != 0 and 1 <= len(errors) <= 2, res.stderr[-3000:]
    assert all(re.match("vltrain: error: " + refused, line) for line in errors)
    assert "[rank1]" not in res.stderr and "[rank0]" not in res.stderr  # no rank's traceback
    assert not (tmp_path / "runs" / "w" / "trial_0000").exists()


def test_a_study_without_a_process_count_still_resumes(shapes_dir: Path, tmp_path: Path) -> None:
    """Studies created before the process count was recorded resume on any (unchecked)."""
    cfg = _write_config(tmp_path / "t.yaml", shapes_dir, tmp_path / "runs", enqueue=[])
    study = _open(cfg, "old", 1)
    record = study.user_attrs["vltrain"]
    del record["world_size"]
    study.set_user_attr("vltrain", record)
    assert "world_size" not in _open(cfg, "old", 2).user_attrs["vltrain"]
    # negative control: a changed space is still refused for such a study
    space = {"optim.lr": {"type": "categorical", "choices": [1.0e-3, 5.0e-3]}}
    cfg = _write_config(tmp_path / "t.yaml", shapes_dir, tmp_path / "runs", enqueue=[], space=space)
    with pytest.raises(TuneError, match="different space"):
        _open(cfg, "old", 1)


def test_an_option_error_prints_the_usage_with_the_config(capsys: pytest.CaptureFixture) -> None:
    """`--trials 0` after the config is parsed by a second parser, whose own usage line lacked
    the `config` positional."""
    for argv in (["tune", "c.yaml", "--trials", "0"], ["tune", "--trials", "0", "c.yaml"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "--trials: must be an integer >= 1" in err
        usage = err.splitlines()[0]
        assert usage.startswith("usage: vltrain tune [-h]") and usage.endswith(
            " config [overrides ...]"
        )
