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
    """What a case may use: the shapes data, its own temp folder, the shared trained run, and
    small models built once per session on first use (`assets`)."""

    data: Path
    tmp: Path
    run: Path
    assets: Path

    def hf_clip(self) -> Path:
        """A tiny HF CLIP folder (text positions: 32)."""
        return _asset(self.assets / "hf_clip", _make_hf_clip)

    def lm(self) -> Path:
        """A tiny HF causal LM with a chat template (max_position_embeddings 512)."""
        from tests.stages.drafter_fixtures import tiny_lm

        return _asset(self.assets / "lm", tiny_lm)

    def lm_without_chat_template(self) -> Path:
        return _asset(self.assets / "lm_plain", _make_plain_lm(self.lm()))

    def swapped_run(self) -> Path:
        """A copy of the run whose checkpoints hold weights of another size (embed_dim 64)."""
        run = self.run_copy()
        from safetensors.torch import load_file, save_file

        for weights in (run / "checkpoints").glob("*/model.safetensors"):
            tensors = load_file(weights)
            for key in ("encoder.text_proj.weight", "encoder.vision_proj.weight"):
                tensors[key] = tensors[key][:64].contiguous()
            save_file(tensors, weights)
        return run

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.tmp / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path

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


def _asset(path: Path, make: Callable[[Path], object]) -> Path:
    if not path.exists():
        make(path)
    return path


def _make_hf_clip(path: Path) -> None:
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel

    from tests.models.test_hf_embedders import _save, _tokenizer

    tok = _tokenizer(eos_template=True)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    text.update(num_attention_heads=2, max_position_embeddings=32, eos_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    vision.update(num_attention_heads=2, image_size=16, patch_size=8)
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=24)
    torch.manual_seed(0)
    ip = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    _save(CLIPModel(cfg), tok, ip, path)


def _make_plain_lm(src: Path) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        shutil.copytree(src, path)
        config = json.loads((path / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        for f in path.glob("chat_template*"):
            f.unlink()

    return make


LATIN1 = '{"prompt": "caf\xe9", "image": "x.png", "text": "caf\xe9"}\n'.encode("latin-1")

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
case("allow_changes_unknown_key", "did you mean optim.lr?")(
    lambda c: c.train("train.allow_changes=[optim.lrr]")
)
case("allow_changes_misspelt_key", "did you mean train.max_steps?")(
    lambda c: c.train("train.allow_changes=[train.max_step]")
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


@case("eval_csv_header_only", "holds no records (a header and no rows)")
def _eval_csv_header_only(c: Ctx) -> list[str]:
    (c.tmp / "val.csv").write_text("image,caption\n")
    return c.train(f"data.eval={c.tmp / 'val.csv'}")


@case("train_coco_without_images", "holds no records (an empty 'images' list)")
def _train_coco_empty(c: Ctx) -> list[str]:
    (c.tmp / "coco.json").write_text('{"images": [], "annotations": []}')
    return c.train(f"data.train={c.tmp / 'coco.json'}")


@case("eval_folder_captions_header_only", "holds no records (a header and no rows)")
def _eval_folder_header_only(c: Ctx) -> list[str]:
    (c.tmp / "shots").mkdir()
    (c.tmp / "shots" / "captions.csv").write_text("image,caption\n\n")
    return c.train(f"data.eval={c.tmp / 'shots'}")


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
case("generate_temperature_without_sampling", "--strategy sample")(
    lambda c: _generate(c, "--temperature", "0.7")
)
case("generate_top_p_zero", "--top-p")(
    lambda c: _generate(c, "--strategy", "sample", "--top-p", "0")
)
case("generate_spec_without_draft", "--spec chain")(lambda c: _generate(c, "--spec", "chain"))


def _lm_generate(c: Ctx, *more: str, model: Path | None = None) -> list[str]:
    prompts = c.tmp / "prompts.jsonl"
    prompts.write_text('{"prompt": "a red circle"}\n')
    return ["generate", "--model", str(model or c.lm()), "--prompts", str(prompts), *more]


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


# ---- model options checked before the run folder is written (issue 56, item 7) -----------


def _hf(c: Ctx, kind: str = "hf_clip", **extra: object) -> list[str]:
    over = {"model.kind": kind, "model.path": c.hf_clip(), **extra}
    return ["train", CLIP, *c.overrides(**over)]


case("hf_siglip_pointed_at_a_clip_folder", "model.kind=hf_clip")(lambda c: _hf(c, "hf_siglip"))
case("hf_lora_targets_match_nothing", "model.lora_targets")(
    lambda c: _hf(c, **{"model.lora_r": 4, "model.lora_targets": "[nope_proj]"})
)
case("hf_text_longer_than_its_positions", "max_position_embeddings=32")(
    lambda c: _hf(c, **{"data.max_text_len": 100})
)
case("connector_option_unknown", "connector_options")(
    lambda c: c.train(
        "model.connector_options={bogus: 1}", config=str(REPO / "configs" / "caption_pretrain.yaml")
    )
)
# a value the tower refuses (not only an unknown field): refused at the config check, not
# as a traceback once the tokenizer had trained
case("vision_option_bad_choice", "model.vision_options: stem_norm must be one of ['batch',")(
    lambda c: c.train("model.vision_options={stem_norm: layer}")
)
case("text_option_bad_value", "model.text_options, model.text_layers, model.text_width): pool")(
    lambda c: c.train("model.text_options={pool: avg}")
)
case("vision_width_not_divisible_by_heads", "width 130 must be divisible by heads")(
    lambda c: c.train("model.vision_width=130")
)
case("caption_vision_option_bad_choice", "model.vision_options: pool must be one of")(
    lambda c: c.train(
        "model.vision_options={pool: mean}", config=str(REPO / "configs" / "caption_pretrain.yaml")
    )
)


def test_tower_option_values_fail_at_the_config_check() -> None:
    """A value a tower refuses fails the stage's config check (`load_run_config`), which runs
    before any tokenizer trains: the caption stage removes a refused new run's folder, so the
    cases above cannot see that its tokenizer had trained before the error."""
    from vltrain.config import ConfigError
    from vltrain.stages import load_run_config

    caption = str(REPO / "configs" / "caption_pretrain.yaml")
    bad = {
        caption: ("model.vision_options={pool: mean}", r"^model\.vision_options: pool must be"),
        CLIP: ("model.text_options={pool: avg}", r"model\.text_options, .*: pool must be"),
    }
    for config, (override, message) in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_run_config(config, [override])
    load_run_config(caption, ["model.vision_options={pool: max}"])  # negative control


@case("bad_data_in_a_folder_holding_the_users_files", "bad.jsonl:2")
def _folder_with_notes(c: Ctx) -> list[str]:
    (c.tmp / "mine").mkdir()
    (c.tmp / "mine" / "notes.txt").write_text("keep me")  # must survive, unchanged
    c.write("bad.jsonl", '{"image": "a.png", "text": "x"}\n{"image": \n')
    return c.train(f"data.train={c.tmp / 'bad.jsonl'}", f"run.out_dir={c.tmp / 'mine'}")


# ---- checkpoints of another architecture or size -------------------------------------------

case("init_from_a_run_of_another_embed_dim", "model.embed_dim")(
    lambda c: c.train(f"model.init_from={c.run}", "model.embed_dim=64")
)
case("init_from_a_run_of_another_vision_preset", "encoder.vision")(
    lambda c: c.train(f"model.init_from={c.run}", "model.vision=small")
)
case("init_from_a_run_of_another_image_size", "pos_embed")(
    lambda c: c.train(f"model.init_from={c.run}", "data.image_size=32")
)
case("init_from_a_data_file", "model.init_from")(
    lambda c: c.train(f"model.init_from={c.data_copy()}")
)
case("init_from_a_missing_run", "model.init_from")(
    lambda c: c.train(f"model.init_from={c.tmp / 'no_run'}")
)
case("mine_weights_of_another_size", "encoder.text_proj.weight: [64, 128]")(
    lambda c: _mine(c, run=c.swapped_run())
)
case("export_weights_of_another_size", "config.yaml")(
    lambda c: ["export", str(c.swapped_run()), "--out", str(c.tmp / "exported")]
)


@case("eval_weights_of_another_size", "encoder.vision_proj.weight")
def _eval_swapped(c: Ctx) -> list[str]:
    argv = _eval_files(c)
    argv[1] = str(c.swapped_run())
    return argv


@case("resume_weights_of_another_size", "encoder.text_proj.weight")
def _resume_swapped(c: Ctx) -> list[str]:
    run = c.swapped_run()
    over = [f"run.out_dir={run}", "train.max_steps=4", "train.allow_changes=[train.max_steps]"]
    return ["train", str(run / "config.yaml"), "train.resume=true", *over]


# ---- sizes that cannot fit, infinities, devices, encodings ---------------------------------

case("embed_dim_absurd", "model.embed_dim=1000000000")(
    lambda c: c.train("model.embed_dim=1000000000")
)
case("image_size_absurd", "data.image_size=65536")(lambda c: c.train("data.image_size=65536"))
case("vision_width_absurd", "model.vision_width=1000000")(
    lambda c: c.train("model.vision_width=1000000")
)
case("max_text_len_absurd", "data.max_text_len=100000000")(
    lambda c: c.train("data.max_text_len=100000000")
)
case("tokenizer_vocab_absurd", "data.tokenizer_vocab=1000000000")(
    lambda c: c.train("data.tokenizer_vocab=1000000000")
)
case("grad_clip_inf", "optim.grad_clip")(lambda c: c.train("optim.grad_clip=inf"))
case("temperature_inf", "objective.temperature")(lambda c: c.train("objective.temperature=inf"))
case("accum_steps_inf", "optim.accum_steps")(lambda c: c.train("optim.accum_steps=inf"))
case("seed_inf", "run.seed")(lambda c: c.train("run.seed=inf"))
case("lr_negative", "optim.lr")(lambda c: c.train("optim.lr=-1"))
case("device_cuda_index", "run.device")(lambda c: c.train("run.device=cuda:7"))
case("device_tpu", "run.device")(lambda c: c.train("run.device=tpu"))
case("config_not_utf8", "not UTF-8")(
    lambda c: ["train", str(c.write("c.yaml", "stage: contrastive\n# caf\xe9\n".encode("latin-1")))]
)

# ---- eval -----------------------------------------------------------------------------------


def _eval_with(c: Ctx, **files: str | bytes) -> list[str]:
    argv = _eval_files(c)
    for option, text in files.items():
        argv[argv.index(f"--{option}") + 1] = str(c.write(f"custom_{option}", text))
    return argv


case("eval_empty_query_set", "holds no queries")(lambda c: _eval_with(c, queries=""))
case("eval_query_ids_not_in_qrels", "nothing to evaluate")(
    lambda c: _eval_with(c, queries='{"_id": "qX", "text": "a red circle"}\n')
)
case("eval_qrels_not_utf8", "not UTF-8")(lambda c: _eval_with(c, qrels=b"q1\td1\t1\xe9\n"))
case("eval_qrels_two_columns", "expected 'query-id corpus-id score'")(
    lambda c: _eval_with(c, qrels="q1 d1\n")
)
case("eval_qrels_score_not_a_number", "is not a number")(
    lambda c: _eval_with(c, qrels="query-id\tcorpus-id\tscore\nq1\td1\thigh\n")
)
case("eval_query_row_without_id", "needs '_id'")(
    lambda c: _eval_with(c, queries='{"text": "a red circle"}\n')
)
case("eval_dims_not_numbers", "--dims")(lambda c: _eval_files(c) + ["--dims", "abc"])
case("eval_dims_wider_than_the_embedding", "--dims")(lambda c: _eval_files(c) + ["--dims", "4096"])
case("eval_hf_folder_not_a_run", "config.yaml")(
    lambda c: ["eval", str(c.hf_clip()), *_eval_files(c)[2:]]
)


@case("eval_device_cuda_without_cuda", "cuda")
def _eval_cuda(c: Ctx) -> list[str]:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    return _eval_files(c) + ["--device", "cuda"]


@case("eval_missing_checkpoint", "no_run")
def _eval_missing(c: Ctx) -> list[str]:
    argv = _eval_files(c)
    argv[1] = str(c.tmp / "no_run")
    return argv


# ---- mine -----------------------------------------------------------------------------------


@case("mine_data_not_utf8_and_no_images", "too few to mine")
def _mine_latin1(c: Ctx) -> list[str]:
    data = c.write("latin1.jsonl", LATIN1)
    return [
        "mine",
        "--checkpoint",
        str(c.run),
        "--data",
        str(data),
        "--out",
        str(c.tmp / "o.jsonl"),
    ]


case("mine_batch_size_zero", "--batch-size")(lambda c: _mine(c, "--batch-size", "0"))
case("mine_an_hf_folder", "config.yaml")(lambda c: _mine(c, run=c.hf_clip()))

# ---- data curate ----------------------------------------------------------------------------


def _curate(c: Ctx, *more: str) -> list[str]:
    return ["data", "curate", str(c.data_copy()), "--out", str(c.tmp / "cur.jsonl"), *more]


for _name, _opts, _fragment in (
    ("num_perm_zero", ("--num-perm", "0"), "--num-perm"),
    ("num_perm_absurd", ("--num-perm", "1000000000"), "--num-perm"),
    ("shingle_n_zero", ("--shingle-n", "0"), "--shingle-n"),
    ("caption_threshold_above_one", ("--caption-threshold", "1.5"), "--caption-threshold"),
    ("caption_threshold_negative", ("--caption-threshold", "-1"), "--caption-threshold"),
    ("leak_jaccard_above_one", ("--leak-jaccard", "2"), "--leak-jaccard"),
    ("leak_jaccard_nan", ("--leak-jaccard", "nan"), "--leak-jaccard"),
    ("bloom_fp_rate_zero", ("--bloom-fp-rate", "0"), "--bloom-fp-rate"),
    ("bloom_fp_rate_above_one", ("--bloom-fp-rate", "1.5"), "--bloom-fp-rate"),
    ("bloom_fp_rate_inf", ("--bloom-fp-rate", "inf"), "--bloom-fp-rate"),
    ("semantic_eps_negative", ("--semantic-eps", "-1"), "--semantic-eps"),
    ("min_words_above_max_words", ("--min-words", "5", "--max-words", "2"), "--min-words"),
    ("min_side_negative", ("--min-side", "-1"), "--min-side"),
    ("batch_size_zero", ("--batch-size", "0"), "--batch-size"),
    ("workers_zero", ("--workers", "0"), "--workers"),
    ("phash_radius_64", ("--phash-radius", "64"), "--phash-radius"),
    ("clip_threshold_without_checkpoint", ("--clip-threshold", "0.3"), "--checkpoint"),
    ("against_a_missing_file", ("--against", "/nonexistent/eval.jsonl"), "eval.jsonl"),
    ("checkpoint_missing", ("--checkpoint", "/nonexistent/run"), "/nonexistent/run"),
):
    case(f"curate_{_name}", _fragment)(lambda c, _opts=_opts: _curate(c, *_opts))

case("curate_input_missing", "missing.jsonl")(
    lambda c: ["data", "curate", str(c.tmp / "missing.jsonl"), "--out", str(c.tmp / "o.jsonl")]
)


@case("curate_out_is_the_input", "input file")
def _curate_in_place(c: Ctx) -> list[str]:
    data = c.data_copy()
    return ["data", "curate", str(data), "--out", str(data)]


# ---- scaling fit and sweep ------------------------------------------------------------------

GOOD_RUNS = "params,tokens,loss\n" + "".join(
    f"{n:g},{1e12 / n:g},{2 + 1e3 / n:.4f}\n" for n in (1e3, 2e3, 4e3, 8e3, 1.6e4, 3.2e4)
)


def _fit(c: Ctx, text: str | bytes = GOOD_RUNS, *more: str) -> list[str]:
    return ["scaling", "fit", str(c.write("runs.csv", text)), *more]


for _name, _text, _fragment in (
    (
        "missing_cell",
        "params,tokens,loss\n1e6,1e9,3.0\n2e6,,2.9\n",
        "runs.csv:3: column 'tokens' is missing",
    ),
    ("non_numeric_cell", "params,tokens,loss\n1e6,1e9,3.0\n2e6,abc,2.9\n", "'abc', not a number"),
    ("short_row", "params,tokens,loss\n1e6,1e9\n", "column 'loss' is missing"),
    ("infinite_cell", "params,tokens,loss\n1e6,1e9,inf\n2e6,1e9,2.9\n", "rows [2]"),
    ("not_utf8", "params,tokens,loss\n1,2,3\xe9\n".encode("latin-1"), "not UTF-8"),
    ("missing_columns", "n,d,loss\n1,2,3\n", "needs columns"),
    ("empty_file", "", "holds no runs"),
    ("too_few_runs", "params,tokens,loss\n1e6,1e9,3.0\n", "at least 5 runs"),
):
    case(f"fit_{_name}", _fragment)(lambda c, _text=_text: _fit(c, _text))

for _name, _opts, _fragment in (
    ("bootstrap_negative", ("--bootstrap", "-1"), "--bootstrap"),
    ("predict_inf", ("--predict", "inf"), "--predict"),
    ("predict_negative", ("--predict", "-5"), "--predict"),
    ("huber_delta_inf", ("--huber-delta", "inf"), "--huber-delta"),
    ("huber_delta_text", ("--huber-delta", "big"), "--huber-delta"),
    ("exclude_worst_all", ("--exclude-worst", "100"), "--exclude-worst"),
    ("exclude_by_unknown", ("--exclude-by", "luck"), "--exclude-by"),
):
    case(f"fit_{_name}", _fragment)(lambda c, _opts=_opts: _fit(c, GOOD_RUNS, *_opts))

case("fit_missing_csv", "nope.csv")(lambda c: ["scaling", "fit", str(c.tmp / "nope.csv")])


def _sweep(c: Ctx, *more: str, budgets: str = "1e12", sizes: str = "50k") -> list[str]:
    return [
        "scaling",
        "sweep",
        "--budgets",
        budgets,
        "--sizes",
        sizes,
        "--out",
        str(c.tmp / "sw"),
    ] + [
        CLIP,
        *c.overrides(),
        *more,
    ]


case("sweep_budgets_not_numbers", "--budgets")(lambda c: _sweep(c, budgets="abc"))
case("sweep_budgets_inf", "--budgets")(lambda c: _sweep(c, budgets="inf"))
case("sweep_budgets_zero", "--budgets")(lambda c: _sweep(c, budgets="0"))
case("sweep_sizes_unknown", "size 'big'")(lambda c: _sweep(c, sizes="big"))
case("sweep_seeds_not_integers", "--seeds")(lambda c: _sweep(c, "--seeds", "a,b"))
case("sweep_jobs_zero", "--jobs")(lambda c: _sweep(c, "--jobs", "0"))
case("sweep_unknown_override", "optim.lrr")(lambda c: _sweep(c, "optim.lrr=1"))
case("sweep_missing_config", "config file not found")(
    lambda c: (
        ["scaling", "sweep", "--budgets", "1e12", "--sizes", "50k"]
        + ["--out", str(c.tmp / "sw"), str(c.tmp / "nope.yaml")]
    )
)

# ---- data regenerate and generate --model --------------------------------------------------


def _regen(c: Ctx, *more: str, model: Path | None = None, data: Path | None = None) -> list[str]:
    data = data or c.write("prompts.jsonl", '{"prompt": "say hello"}\n')
    argv = ["data", "regenerate", "--data", str(data), "--out", str(c.tmp / "answers.jsonl")]
    return argv + ["--model", str(model or c.lm()), *more]


case("regenerate_model_without_chat_template", "no chat template")(
    lambda c: _regen(c, model=c.lm_without_chat_template())
)
case("regenerate_batch_size_zero", "--batch-size")(lambda c: _regen(c, "--batch-size", "0"))
case("regenerate_past_the_positions", "max_position_embeddings")(
    lambda c: _regen(c, "--max-new-tokens", "100000")
)
case("regenerate_temperature_inf", "--temperature")(lambda c: _regen(c, "--temperature", "inf"))
case("regenerate_temperature_negative", "--temperature")(
    lambda c: _regen(c, "--strategy", "sample", "--temperature", "-1")
)
case("regenerate_rank_outside_the_world", "--rank 3")(
    lambda c: _regen(c, "--rank", "3", "--world-size", "2")
)
case("regenerate_prompts_not_utf8", "not UTF-8")(
    lambda c: _regen(c, data=c.write("latin1.jsonl", LATIN1))
)
case("regenerate_records_without_prompt", "'prompt' string")(
    lambda c: _regen(c, data=c.write("texts.jsonl", '{"text": "x"}\n'))
)
case("regenerate_prompts_not_json", "not valid JSON")(
    lambda c: _regen(c, data=c.write("broken.jsonl", '{"prompt": \n'))
)
case("regenerate_neither_model_nor_checkpoint", "--model or --checkpoint")(lambda c: _regen(c)[:-2])
case("regenerate_a_contrastive_checkpoint", "contrastive")(
    lambda c: _regen(c)[:-2] + ["--checkpoint", str(c.run)]
)


@case("regenerate_out_is_the_data", "input file")
def _regen_in_place(c: Ctx) -> list[str]:
    argv = _regen(c)
    argv[argv.index("--out") + 1] = argv[argv.index("--data") + 1]
    return argv


@case("regenerate_device_cuda_without_cuda", "cuda")
def _regen_cuda(c: Ctx) -> list[str]:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    return _regen(c, "--device", "cuda")


case("generate_lm_without_chat_template", "no chat template")(
    lambda c: _lm_generate(c, model=c.lm_without_chat_template())
)
case("generate_lm_missing", "no_lm")(lambda c: _lm_generate(c, model=c.tmp / "no_lm"))


@case("generate_lm_prompts_not_utf8", "not UTF-8")
def _gen_latin1(c: Ctx) -> list[str]:
    argv = _lm_generate(c)
    c.write("prompts.jsonl", LATIN1)
    return argv


# ---- data shard and synth -------------------------------------------------------------------

case("shard_size_zero", "--shard-size")(
    lambda c: ["data", "shard", str(c.data_copy()), "--out", str(c.tmp / "sh"), "--shard-size", "0"]
)
case("shard_missing_records", "missing.jsonl")(
    lambda c: ["data", "shard", str(c.tmp / "missing.jsonl"), "--out", str(c.tmp / "sh")]
)
case("shard_records_without_image_or_text", "no 'image' or 'text'")(
    lambda c: [
        "data",
        "shard",
        str(c.write("p.jsonl", '{"prompt": "x"}\n')),
        "--out",
        str(c.tmp / "sh"),
    ]
)


@case("shard_out_is_an_existing_file", "exists")
def _shard_onto_file(c: Ctx) -> list[str]:
    data = c.data_copy()
    return ["data", "shard", str(data), "--out", str(data)]


def _synth(c: Ctx, *more: str) -> list[str]:
    return ["data", "synth", "--out", str(c.tmp / "synth"), *more]


case("synth_image_size_absurd", "--image-size")(lambda c: _synth(c, "--image-size", "100000"))
case("synth_n_train_absurd", "--n-train")(lambda c: _synth(c, "--n-train", "1000000000000"))
case("synth_n_val_absurd", "--n-val")(lambda c: _synth(c, "--n-val", "1000000000000"))
case("synth_dup_rate_two", "--dup-rate")(lambda c: _synth(c, "--dup-rate", "2"))
case("synth_leak_rate_nan", "--leak-rate")(lambda c: _synth(c, "--leak-rate", "nan"))
case("synth_workers_zero", "--workers")(lambda c: _synth(c, "--workers", "0"))
case("synth_pages_negatives_negative", "--negatives")(
    lambda c: _synth(c, "--kind", "pages", "--negatives", "-1")
)

# ---- doctor, report, export, pipeline, tune -------------------------------------------------

case("doctor_missing_run", "no_run")(lambda c: ["doctor", str(c.tmp / "no_run")])
case("doctor_a_data_file", "not a run directory")(lambda c: ["doctor", str(c.data_copy())])
case("doctor_an_empty_folder", "not a run directory")(lambda c: ["doctor", str(c.tmp)])
case("report_missing_run", "no_run")(lambda c: ["report", str(c.tmp / "no_run")])
case("report_an_empty_folder", "nor holds runs")(lambda c: ["report", str(c.tmp)])
case("report_out_is_a_folder", "is a directory")(lambda c: ["report", str(c.run), "-o", str(c.tmp)])
case("export_not_a_run", "no checkpoint found")(
    lambda c: ["export", str(c.tmp), "--out", str(c.tmp / "exported")]
)
case("export_speculators_of_a_clip_run", "not a drafter checkpoint")(
    lambda c: ["export", str(c.run), "--out", str(c.tmp / "ex"), "--format", "speculators"]
)
case("export_dflash_of_a_clip_run", "not a drafter checkpoint")(
    lambda c: ["export", str(c.run), "--out", str(c.tmp / "ex"), "--format", "dflash"]
)
case("export_sentence_transformers_of_a_dual_encoder", "model.kind: vlm")(
    lambda c: [
        "export",
        str(c.run),
        "--out",
        str(c.tmp / "ex"),
        "--format",
        "sentence-transformers",
    ]
)
case("pipeline_without_stages", "non-empty 'stages'")(
    lambda c: ["pipeline", str(c.write("p.yaml", "root: runs\nstages: []\n"))]
)
case("pipeline_not_a_mapping", "p.yaml")(lambda c: ["pipeline", str(c.write("p.yaml", "- a\n"))])
case("pipeline_unknown_key", "unknown pipeline keys")(
    lambda c: ["pipeline", str(c.write("p.yaml", "root: r\nstagez: []\n"))]
)
case("pipeline_stage_config_missing", "nope.yaml")(
    lambda c: [
        "pipeline",
        str(c.write("p.yaml", "root: r\nstages:\n  - name: a\n    config: nope.yaml\n")),
    ]
)
case("pipeline_not_utf8", "not UTF-8")(
    lambda c: ["pipeline", str(c.write("p.yaml", "root: r\n# caf\xe9\n".encode("latin-1")))]
)
case("pipeline_unknown_override", "optim.lrr")(
    lambda c: ["pipeline", str(REPO / "configs" / "pipeline.yaml"), "optim.lrr=1"]
)
case("tune_missing_config", "config file not found")(lambda c: ["tune", str(c.tmp / "no.yaml")])
case("tune_trials_negative", "--trials")(lambda c: ["tune", "--trials", "-1", CLIP])
case("tune_unknown_override", "optim.lrr")(lambda c: ["tune", CLIP, "optim.lrr=1"])


# ---- the runner ---------------------------------------------------------------------------


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


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the small models the cases share are built, once, on first use."""
    return tmp_path_factory.mktemp("mistake_assets")


def test_the_corpus_is_large_enough() -> None:
    assert len(CASES) >= 150
    commands = {build_name.split("_")[0] for build_name in CASES}
    assert {"eval", "mine", "generate", "export", "tune", "pipeline", "curate"} <= commands
    assert {"synth", "shard", "regenerate", "sweep", "fit", "doctor", "report"} <= commands


@pytest.mark.parametrize("name", sorted(CASES))
def test_user_mistake_is_a_clear_error(
    name: str,
    shapes_dir: Path,
    trained_run: Path,
    assets: Path,
    tmp_path: Path,
    capsys,
    monkeypatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # a case that writes into "." (run.out_dir=) stays in here
    build, fragment = CASES[name]
    ctx = Ctx(shapes_dir, tmp_path, trained_run, assets)
    argv = [str(a) for a in build(ctx)]
    before = json.dumps(sorted(p.name for p in (trained_run / "checkpoints").iterdir()))
    files_before = _files(trained_run), _files(tmp_path)
    code, err = run_cli(argv, capsys)
    assert "Traceback" not in err, f"raw traceback for {name}:\n{err[-3000:]}"
    assert code == 2, f"{name}: exit code {code}, stderr:\n{err[-2000:]}"
    assert len(ERROR_LINE.findall(err)) == 1, f"{name}: not one 'vltrain: error:' line:\n{err}"
    message = err[ERROR_LINE.search(err).start() :].rstrip("\n")  # type: ignore[union-attr]
    assert "\n" not in message, f"{name}: the error is not one line: {message!r}"
    assert fragment.lower() in err.lower(), f"{name}: the error does not name {fragment!r}:\n{err}"
    assert not (tmp_path / "PICKLE_CODE_RAN").exists(), "a refused pickle ran code"
    trained = [p.parent.name for p in tmp_path.rglob("metrics.jsonl") if "run_copy" not in p.parts]
    assert not trained, f"{name} trained before failing (metrics in {trained})"
    after = json.dumps(sorted(p.name for p in (trained_run / "checkpoints").iterdir()))
    assert before == after, f"{name} changed the shared run's checkpoints"
    assert _files(trained_run) == files_before[0], f"{name} changed a file of the shared run"
    changed = set(_files(tmp_path).items()) ^ set(files_before[1].items())
    assert not changed, f"{name} wrote or changed {sorted(changed)[:5]}"


def test_a_refused_new_run_leaves_its_folder_to_the_corrected_command(
    shapes_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A data error found after config.yaml and the tokenizer were written used to leave them
    behind, and the corrected command was then refused until train.overwrite=true."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image": "a.png", "text": "x"}\n{"image": \n')
    over = {"train.max_steps": 1, "optim.warmup_steps": 0}
    assert main(["train", CLIP, *tiny_overrides(shapes_dir, out, **over), f"data.train={bad}"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["train", CLIP, *tiny_overrides(shapes_dir, out, **over)]) == 0
    assert (out / "config.yaml").is_file() and (out / "notes.txt").read_text() == "mine"


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
