"""A corpus of user mistakes, each run through the real CLI (`vltrain.cli.main`, in process).

Every case must end with exit code 2, a `vltrain: error:` line (argparse's own
`vltrain <command>: error:` for option errors) that names what was wrong, and no traceback; and
it must fail before compute. Cases that need a trained run share one tiny CLIP run (module
scope) and work on a copy of it when they damage it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, tiny_overrides
from vltrain.cli import main

CLIP = str(REPO / "configs" / "clip.yaml")
ERROR_LINE = re.compile(r"^vltrain(?: [a-z-]+)*: error: \S", re.MULTILINE)
CASE_SECONDS = 120  # a case that runs longer is training instead of failing at load


@dataclass
class Ctx:
    """What a case may use: the shapes data, its own temp folder, the shared trained run."""

    data: Path
    tmp: Path
    run: Path

    def overrides(self, out: Path | None = None, **extra: object) -> list[str]:
        """Tiny-run overrides (1 step) writing to `out` (default: a fresh folder)."""
        extra = {"train.max_steps": 1, "optim.warmup_steps": 0, **extra}
        return tiny_overrides(self.data, out or self.tmp / "run", **extra)

    def train(self, *more: str, config: str = CLIP, **extra: object) -> list[str]:
        return ["train", config, *self.overrides(**extra), *more]

    def yaml(self, text: str) -> str:
        p = self.tmp / "config.yaml"
        p.write_text(text)
        return str(p)

    def run_copy(self) -> Path:
        dst = self.tmp / "run_copy"
        shutil.copytree(self.run, dst)
        return dst

    def data_copy(self) -> Path:
        """val.jsonl copied into the temp folder (cases that must not touch the shared data)."""
        dst = self.tmp / "val.jsonl"
        shutil.copy(self.data / "val.jsonl", dst)
        return dst


# name -> (argv builder, text the error must contain)
CASES: dict[str, tuple[Callable[[Ctx], list[str]], str]] = {}


def case(name: str, fragment: str) -> Callable:
    def register(fn: Callable[[Ctx], list[str]]) -> Callable[[Ctx], list[str]]:
        CASES[name] = (fn, fragment)
        return fn

    return register


# ---- the config: keys, types, choices, files ---------------------------------------------

case("unknown_key_did_you_mean", "did you mean optim.lr")(lambda c: c.train("optim.lrr=1e-3"))
case("unknown_section", "optimm")(lambda c: c.train("optimm.lr=1e-3"))
case("wrong_type_int", "data.batch_size")(lambda c: c.train("data.batch_size=abc"))
case("wrong_type_bool", "log.progress")(lambda c: c.train("log.progress=maybe"))
case("bad_choice_precision", "run.precision")(lambda c: c.train("run.precision=fp12"))
case("bad_stage_did_you_mean", "contrastive")(lambda c: c.train("stage=contrastve"))
case("bad_loss_did_you_mean", "infonce")(lambda c: c.train("objective.loss=infonse"))
case("bad_best_metric", "train.best_metric")(lambda c: c.train("train.best_metric=acc"))
case("accum_steps_past_the_data", "optim.accum_steps=100000")(
    lambda c: c.train("optim.accum_steps=100000")
)
case("best_metric_a_group_the_data_lacks", "eval_R@1_men")(
    lambda c: c.train("train.best_metric=eval_R@1_men")
)
case("best_metric_a_rank_not_computed", "eval_R@3")(lambda c: c.train("train.best_metric=eval_R@3"))
case("override_without_equals", "optim.lr")(lambda c: c.train("optim.lr"))
case("missing_config_file", "config file not found")(lambda c: ["train", str(c.tmp / "nope.yaml")])
case("malformed_yaml", "config.yaml")(lambda c: ["train", c.yaml("optim: {lr: [1, 2\n")])
case("yaml_not_a_mapping", "config.yaml")(lambda c: ["train", c.yaml("- a\n- b\n")])
case("duplicate_yaml_section", "optim")(
    lambda c: [
        "train",
        c.yaml("stage: contrastive\noptim:\n  lr: 1.0e-3\noptim:\n  weight_decay: 0.1\n"),
        *c.overrides(),
    ]
)
case("duplicate_yaml_key", "lr")(
    lambda c: [
        "train",
        c.yaml("stage: contrastive\noptim:\n  lr: 1.0\n  lr: 2.0\n"),
        *c.overrides(),
    ]
)
case("lr_inf", "optim.lr")(lambda c: c.train("optim.lr=inf"))
case("lr_nan", "optim.lr")(lambda c: c.train("optim.lr=nan"))
case("weight_decay_inf", "optim.weight_decay")(lambda c: c.train("optim.weight_decay=inf"))
case("max_bad_fraction_above_one", "data.max_bad_fraction")(
    lambda c: c.train("data.max_bad_fraction=2")
)
case("warmup_longer_than_run", "optim.warmup_steps")(
    lambda c: c.train("optim.warmup_steps=50", "train.max_steps=2")
)

# ---- data files and shapes --------------------------------------------------------------

case("missing_train_file", "missing_train.jsonl")(
    lambda c: c.train(f"data.train={c.tmp / 'missing_train.jsonl'}")
)
case("missing_eval_file", "missing_val.jsonl")(
    lambda c: c.train(f"data.eval={c.tmp / 'missing_val.jsonl'}")
)
case("missing_test_file", "missing_test.jsonl")(
    lambda c: c.train(f"data.test={c.tmp / 'missing_test.jsonl'}")
)


@case("empty_jsonl", "empty.jsonl")
def _empty_jsonl(c: Ctx) -> list[str]:
    (c.tmp / "empty.jsonl").write_text("")
    return c.train(f"data.train={c.tmp / 'empty.jsonl'}")


@case("invalid_json_line", "bad.jsonl:2")
def _invalid_json_line(c: Ctx) -> list[str]:
    (c.tmp / "bad.jsonl").write_text('{"image": "a.png", "text": "x"}\n{"image": \n')
    return c.train(f"data.train={c.tmp / 'bad.jsonl'}")


@case("unsupported_data_suffix", "unsupported data file suffix")
def _unsupported_suffix(c: Ctx) -> list[str]:
    (c.tmp / "x.txt").write_text("a")
    return c.train(f"data.train={c.tmp / 'x.txt'}")


case("batch_larger_than_data", "data.batch_size")(lambda c: c.train("data.batch_size=4096"))
case("image_size_not_multiple_of_patch", "data.image_size")(lambda c: c.train("data.image_size=60"))


@case("device_cuda_without_cuda", "cuda")
def _cuda(c: Ctx) -> list[str]:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so run.device=cuda is not a mistake here")
    return c.train("run.device=cuda")


# ---- keys the built-in dual encoder would ignore ------------------------------------------

case("ignored_freeze", "model.freeze")(lambda c: c.train("model.freeze=[vision]"))
case("ignored_lora_r", "model.lora_r")(lambda c: c.train("model.lora_r=4"))
case("ignored_connector", "model.connector")(lambda c: c.train("model.connector=gated_xattn"))
case("ignored_caption_mode", "caption.mode")(lambda c: c.train("caption.mode=sft"))
case("ignored_rl_k", "rl.k")(lambda c: c.train("rl.k=8"))
case("ignored_length_buckets", "data.length_buckets")(lambda c: c.train("data.length_buckets=4"))
case("ignored_model_path", "model.path")(lambda c: c.train(f"model.path={c.tmp}"))
case("ignored_vision_init_from", "model.vision_init_from")(
    lambda c: c.train(f"model.vision_init_from={c.run}")
)
case("ignored_pooling", "model.pooling")(lambda c: c.train("model.pooling=mean"))
case("ignored_siglip_init_scale", "objective.siglip_init_scale")(
    lambda c: c.train("objective.siglip_init_scale=5.0")
)

# ---- the run folder -----------------------------------------------------------------------


@case("resume_on_empty_folder", "empty_run")
def _resume_empty(c: Ctx) -> list[str]:
    (c.tmp / "empty_run").mkdir()
    return ["train", CLIP, *c.overrides(c.tmp / "empty_run"), "train.resume=true"]


case("resume_on_misspelled_folder", "rnu")(
    lambda c: ["train", CLIP, *c.overrides(c.tmp / "rnu"), "train.resume=true"]
)
case("start_over_in_used_folder", "train.overwrite")(
    lambda c: ["train", CLIP, *c.overrides(c.run_copy())]
)
case("out_dir_empty", "run.out_dir")(lambda c: c.train("run.out_dir="))


@case("out_dir_is_a_file", "not_a_folder")
def _out_dir_file(c: Ctx) -> list[str]:
    (c.tmp / "not_a_folder").write_text("x")
    return c.train(f"run.out_dir={c.tmp / 'not_a_folder'}")


@case("out_dir_under_a_file", "not_a_folder")
def _out_dir_under_file(c: Ctx) -> list[str]:
    (c.tmp / "not_a_folder").write_text("x")
    return c.train(f"run.out_dir={c.tmp / 'not_a_folder' / 'run'}")


@case("out_dir_not_writable", "locked")
def _out_dir_locked(c: Ctx) -> list[str]:
    if os.geteuid() == 0:  # root ignores permission bits; sysfs refuses a mkdir even to root
        return c.train("run.out_dir=/sys/locked/run")
    (c.tmp / "locked").mkdir(mode=0o500)
    return c.train(f"run.out_dir={c.tmp / 'locked' / 'run'}")


@case("pickle_bomb_trainer_state", "trainer_state.pt")
def _pickle_bomb(c: Ctx) -> list[str]:
    run = c.run_copy()

    class Bomb:
        def __reduce__(self):  # runs os.makedirs(marker) if anyone unpickles it
            return (os.makedirs, (str(c.tmp / "PICKLE_CODE_RAN"),))

    for ckpt in (run / "checkpoints").iterdir():
        torch.save({"loop": Bomb()}, ckpt / "trainer_state.pt")
    return ["train", CLIP, *c.overrides(run, **{"train.max_steps": 4}), "train.resume=true"]


# ---- generate -----------------------------------------------------------------------------


def _generate(c: Ctx, *more: str) -> list[str]:
    image = next((c.data / "images").glob("val_*.png"))
    return ["generate", "--checkpoint", str(c.run), "--images", str(image), *more]


case("generate_batch_size_zero", "--batch-size")(lambda c: _generate(c, "--batch-size", "0"))
case("generate_beams_zero", "--beams")(lambda c: _generate(c, "--strategy", "beam", "--beams", "0"))
case("generate_max_new_tokens_negative", "--max-new-tokens")(
    lambda c: _generate(c, "--max-new-tokens", "-5")
)
case("generate_on_a_contrastive_run", "contrastive")(lambda c: _generate(c))
case("generate_without_inputs", "--images")(lambda c: ["generate", "--checkpoint", str(c.run)])
case("generate_missing_checkpoint", "no_such_run")(
    lambda c: ["generate", "--checkpoint", str(c.tmp / "no_such_run"), "--images", "x.png"]
)
case("generate_out_is_a_folder", "is a directory")(lambda c: _generate(c, "--out", str(c.tmp)))
case("generate_spec_without_draft", "--spec chain")(lambda c: _generate(c, "--spec", "chain"))


def _lm_generate(c: Ctx, *more: str) -> list[str]:
    from tests.stages.drafter_fixtures import tiny_lm  # max_position_embeddings 512

    prompts = c.tmp / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red circle"}\n')
    return ["generate", "--model", str(tiny_lm(c.tmp / "lm")), "--prompts", str(prompts), *more]


case("generate_lm_past_its_positions", "max_position_embeddings")(
    lambda c: _lm_generate(c, "--max-new-tokens", "100000000")
)
case("generate_lm_out_is_the_prompts", "input file")(
    lambda c: _lm_generate(c, "--out", str(c.tmp / "prompts.jsonl"))
)

# ---- mine ---------------------------------------------------------------------------------


def _mine(c: Ctx, *more: str, run: Path | None = None) -> list[str]:
    data = c.data_copy()
    out = c.tmp / "mined.jsonl"
    return [
        "mine",
        "--checkpoint",
        str(run or c.run),
        "--data",
        str(data),
        "--out",
        str(out),
        *more,
    ]


case("mine_k_zero", "--k")(lambda c: _mine(c, "--k", "0"))
case("mine_range_inverted", "--range-min")(
    lambda c: _mine(c, "--range-min", "50", "--range-max", "10")
)
case("mine_batch_size_not_a_number", "--batch-size")(lambda c: _mine(c, "--batch-size", "many"))
case("mine_margin_nan", "--margin")(lambda c: _mine(c, "--margin", "nan"))


@case("mine_out_is_data", "input file")
def _mine_in_place(c: Ctx) -> list[str]:
    data = c.data_copy()
    return ["mine", "--checkpoint", str(c.run), "--data", str(data), "--out", str(data)]


@case("mine_out_is_data_via_dotdot", "input file")
def _mine_in_place_dotdot(c: Ctx) -> list[str]:
    data = c.data_copy()
    (c.tmp / "sub").mkdir()
    alias = c.tmp / "sub" / ".." / data.name
    return ["mine", "--checkpoint", str(c.run), "--data", str(data), "--out", str(alias)]


case("mine_out_in_another_folder", "same folder")(
    lambda c: _mine(c)[:-1] + [str(c.tmp / "sub" / "mined.jsonl")]
)
case("mine_missing_data", "missing.jsonl")(
    lambda c: [
        "mine",
        "--checkpoint",
        str(c.run),
        "--data",
        str(c.tmp / "missing.jsonl"),
        "--out",
        str(c.tmp / "out.jsonl"),
    ]
)


@case("mine_run_without_checkpoints", "checkpoint")
def _mine_no_ckpt(c: Ctx) -> list[str]:
    (c.tmp / "fresh").mkdir()
    return _mine(c, run=c.tmp / "fresh")


@case("mine_truncated_safetensors", "model.safetensors")
def _mine_truncated(c: Ctx) -> list[str]:
    run = c.run_copy()
    for weights in (run / "checkpoints").glob("*/model.safetensors"):
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    return _mine(c, run=run)


# ---- data synth, config-docs, quickstart, tune, pipeline ----------------------------------


@case("synth_into_non_empty_folder", "not empty")
def _synth_used(c: Ctx) -> list[str]:
    (c.tmp / "shapes").mkdir()
    (c.tmp / "shapes" / "train.jsonl").write_text("{}\n")
    return ["data", "synth", "--out", str(c.tmp / "shapes"), "--n-train", "2"]


case("synth_n_train_zero", "--n-train")(
    lambda c: ["data", "synth", "--out", str(c.tmp / "s"), "--n-train", "0"]
)
case("synth_image_size_too_small", "--image-size")(
    lambda c: ["data", "synth", "--out", str(c.tmp / "s"), "--image-size", "16"]
)
case("synth_empty_out", "--out")(lambda c: ["data", "synth", "--out", ""])
case("config_docs_out_is_a_folder", "is a directory")(
    lambda c: ["config-docs", "--out", str(c.tmp)]
)
case("config_docs_empty_out", "--out")(lambda c: ["config-docs", "--out", ""])
case("quickstart_steps_zero", "--steps")(lambda c: ["quickstart", "--steps", "0"])
case("quickstart_negative_batch", "--batch-size")(lambda c: ["quickstart", "--batch-size", "-1"])
case("tune_trials_zero", "--trials")(lambda c: ["tune", "--trials", "0", CLIP])
# ---- outputs that would overwrite inputs or a run's own files ------------------------------

case("report_over_run_config", "inside the run folder")(
    lambda c: ["report", str(c.run), "-o", str(c.run / "config.yaml")]
)
case("report_over_run_metrics", "inside the run folder")(
    lambda c: ["report", str(c.run), "-o", str(c.run / "metrics.jsonl")]
)
case("export_into_the_run", "inside the run folder")(
    lambda c: ["export", str(c.run), "--out", str(c.run)]
)
case("export_inside_a_run", "inside the run folder")(
    lambda c: ["export", str(c.run), "--out", str(c.run / "exported")]
)


def _eval_files(c: Ctx) -> list[str]:
    queries, corpus, qrels = (c.tmp / n for n in ("q.jsonl", "c.jsonl", "qrels.tsv"))
    queries.write_text('{"_id": "q1", "text": "a red circle"}\n')
    corpus.write_text('{"_id": "d1", "text": "a red circle"}\n')
    qrels.write_text("q1\td1\t1\n")
    return ["eval", str(c.run), "--queries", str(queries), "--corpus", str(corpus)] + [
        "--qrels",
        str(qrels),
    ]


case("eval_out_is_the_qrels", "input file")(
    lambda c: _eval_files(c) + ["--out", str(c.tmp / "qrels.tsv")]
)
case("eval_ranks_is_the_queries", "input file")(
    lambda c: _eval_files(c) + ["--ranks", str(c.tmp / "q.jsonl")]
)
case("eval_out_is_the_ranks", "--ranks")(
    lambda c: _eval_files(c) + ["--out", str(c.tmp / "m.json"), "--ranks", str(c.tmp / "m.json")]
)


@case("scaling_fit_json_is_the_csv", "input file")
def _fit_json_csv(c: Ctx) -> list[str]:
    csv = c.tmp / "runs.csv"
    csv.write_text("n_params,tokens,flops,loss\n")
    return ["scaling", "fit", str(csv), "--json", str(csv)]


@case("resume_while_another_process_trains", "in use")
def _resume_locked(c: Ctx) -> list[str]:
    run = c.run_copy()
    holder = {"host": socket.gethostname(), "pid": os.getppid()}  # alive, not this process
    (run / "train.lock").write_text(json.dumps(holder))
    return ["train", str(run / "config.yaml"), "train.resume=true", f"run.out_dir={run}"]


@case("allow_changes_that_break_the_checkpoint", "model.embed_dim")
def _allow_embed_dim(c: Ctx) -> list[str]:
    run = c.run_copy()  # config.yaml and everything else must stay as it was
    over = [f"run.out_dir={run}", "train.max_steps=4", "model.embed_dim=64"]
    over += ["train.allow_changes=[model.embed_dim,train.max_steps]"]
    return ["train", str(run / "config.yaml"), "train.resume=true", *over]


case("mine_out_inside_a_run", "inside the run folder")(
    lambda c: _mine(c)[:-1] + [str(c.run / "mined.jsonl")]
)
case("generate_out_inside_a_run", "inside the run folder")(
    lambda c: _generate(c, "--out", str(c.run / "captions.jsonl"))
)
case("curate_leak_n_zero", "--leak-n")(
    lambda c: (
        ["data", "curate", str(c.data_copy()), "--out", str(c.tmp / "cur.jsonl")]
        + ["--leak-n", "0"]
    )
)


case("pipeline_missing_file", "no_pipeline.yaml")(
    lambda c: ["pipeline", str(c.tmp / "no_pipeline.yaml")]
)
case("unknown_command", "invalid choice")(lambda c: ["trian", CLIP])
case("epochs_and_max_steps", "train.max_steps")(lambda c: c.train("train.epochs=2"))
case("save_every_epoch_without_epochs", "train.epochs")(
    lambda c: c.train("train.save_every_epoch=true")
)
case("fp16_hf_kind_on_cpu", "run.precision=fp16")(
    lambda c: c.train("run.precision=fp16", "run.device=cpu", "model.kind=hf_clip")
)


# ---- the runner ---------------------------------------------------------------------------


#: known defects (issue 56, item 7): these data errors surface after config.yaml and the
#: tokenizer were written into the new run folder; every other case writes nothing
WRITES_BEFORE_REFUSING = {"batch_larger_than_data", "invalid_json_line", "unsupported_data_suffix"}


class CaseTimeout(BaseException):
    """Not an OSError/Exception: the CLI must not be able to turn it into an error message."""


@pytest.fixture(scope="module")
def trained_run(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 2-step CLIP run with checkpoints, tokenizer and config.yaml."""
    out = tmp_path_factory.mktemp("mistakes") / "run"
    args = tiny_overrides(shapes_dir, out, **{"train.max_steps": 2, "optim.warmup_steps": 0})
    assert main(["train", CLIP, *args]) == 0
    assert (out / "checkpoints" / "best" / "model.safetensors").is_file()
    return out


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and stderr of `vltrain ARGV`; an exception escaping main() is a traceback."""

    def expire(*_: object) -> None:
        raise CaseTimeout(f"still running after {CASE_SECONDS} s: not a failure at load")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(CASE_SECONDS)
    tb = ""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors, --help, --version
        code = e.code if isinstance(e.code, int) else 2
    except (Exception, CaseTimeout):
        code, tb = -1, traceback.format_exc()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    captured = capsys.readouterr()
    return code, captured.err + tb


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_mistake_is_a_clear_error(
    name: str, shapes_dir: Path, trained_run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a case that writes into "." (run.out_dir=) stays in here
    build, fragment = CASES[name]
    ctx = Ctx(shapes_dir, tmp_path, trained_run)
    argv = [str(a) for a in build(ctx)]
    before = json.dumps(sorted(p.name for p in (trained_run / "checkpoints").iterdir()))
    files_before = _files(trained_run), _files(tmp_path)
    code, err = run_cli(argv, capsys)
    assert "Traceback" not in err, f"raw traceback for {name}:\n{err[-3000:]}"
    assert code == 2, f"{name}: exit code {code}, stderr:\n{err[-2000:]}"
    assert ERROR_LINE.search(err), f"{name}: no 'vltrain: error:' line in:\n{err[-2000:]}"
    assert fragment.lower() in err.lower(), f"{name}: the error does not name {fragment!r}:\n{err}"
    assert not (tmp_path / "PICKLE_CODE_RAN").exists(), "a refused pickle ran code"
    trained = [p.parent.name for p in tmp_path.rglob("metrics.jsonl") if "run_copy" not in p.parts]
    assert not trained, f"{name} trained before failing (metrics in {trained})"
    after = json.dumps(sorted(p.name for p in (trained_run / "checkpoints").iterdir()))
    assert before == after, f"{name} changed the shared run's checkpoints"
    assert _files(trained_run) == files_before[0], f"{name} changed a file of the shared run"
    changed = set(_files(tmp_path).items()) ^ set(files_before[1].items())
    if name not in WRITES_BEFORE_REFUSING:
        assert not changed, f"{name} wrote or changed {sorted(changed)[:5]}"


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime_ns) of every file under `root`: what "nothing written" compares."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_the_runner_reports_a_traceback_and_a_success(capsys, tmp_path: Path) -> None:
    """Negative controls: a command that succeeds and one that crashes are both caught."""
    code, err = run_cli(["config-docs", "--out", str(tmp_path / "ok.md")], capsys)
    assert code == 0 and not ERROR_LINE.search(err)
    import vltrain.cli.config_docs as config_docs

    original = config_docs.run
    config_docs.run = lambda args: 1 // 0  # add_parser binds the module's `run` per call
    try:
        code, err = run_cli(["config-docs"], capsys)
    finally:
        config_docs.run = original
    assert "Traceback" in err and "ZeroDivisionError" in err
