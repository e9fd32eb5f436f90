"""The caption stage end to end: presets, freezing, lr_scale, init_from, resume, CLI, torchrun."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, hardlink_tree, torchrun_vltrain
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.data.caption_data import CaptionCollate
from vltrain.data.chat import IGNORE_INDEX
from vltrain.data.readers import read_jsonl
from vltrain.data.tokenizer import TextTokenizer
from vltrain.engine import loop
from vltrain.engine.optim import param_groups
from vltrain.engine.runtime import seed_everything
from vltrain.models.backbones import build_captioner
from vltrain.runs import Trainer, train
from vltrain.stages import get_stage

PRESETS = {m: REPO / "configs" / f"caption_{m}.yaml" for m in ("pretrain", "finetune", "sft")}


@pytest.fixture(scope="module")
def cap_data(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """shapes train (128) + an 8-image val split + chat versions of both, sharing the images."""
    out = tmp_path_factory.mktemp("capdata")
    hardlink_tree(shapes_dir / "images", out / "images")
    shutil.copy(shapes_dir / "train.jsonl", out / "train.jsonl")
    val = read_jsonl(shapes_dir / "val.jsonl")[:8]
    (out / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))
    for split, recs in (("train", read_jsonl(shapes_dir / "train.jsonl")), ("val", val)):
        chats = [
            {
                "image": r["image"],
                "messages": [
                    {"role": "user", "content": "what do you see?"},
                    {"role": "assistant", "content": r["text"][0]},
                    {"role": "user", "content": "is it red?"},
                    {"role": "assistant", "content": "yes" if "red" in r["text"][0] else "no"},
                ],
            }
            for r in recs
        ]
        (out / f"chat_{split}.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return out


def caption_overrides(data: Path, out: Path, mode: str = "pretrain", **extra: object) -> list[str]:
    """Overrides for a few-second CPU run of a caption preset on `cap_data`."""
    chat = "chat_" if mode == "sft" else ""
    base = {
        "run.out_dir": out,
        "data.train": data / f"{chat}train.jsonl",
        "data.eval": data / f"{chat}val.jsonl",
        "data.batch_size": 16,
        "data.num_workers": 0,
        "data.tokenizer_vocab": 400,
        "data.length_buckets": 0,
        "data.max_text_len": 80,  # room for two chat turns with a caption-only tokenizer
        "model.init_from": "",
        "caption.max_new_tokens": 6,
        "caption.num_beams": 2,
        "train.max_steps": 3,
        "train.eval_every": 0,
        "train.save_every": 0,
        "train.log_every": 1,
        "optim.warmup_steps": 1,
        "optim.lr": 2e-3,
        "log.progress": False,
        "log.tensorboard": False,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _cfg(mode: str, data: Path, out: Path, **extra: object):
    return load_config(PRESETS[mode], caption_overrides(data, out, mode, **extra))


def _weights(run: Path, ckpt: str = "best") -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / ckpt / "model.safetensors")


def _same(a: dict, b: dict, prefix: str) -> bool:
    keys = [k for k in a if k.startswith(prefix)]
    assert keys, prefix
    return all(torch.equal(a[k], b[k]) for k in keys)


def _initial_weights(cfg) -> dict[str, torch.Tensor]:
    """The weights a run of `cfg` started from: the loop seeds, then builds (no RNG between)."""
    seed_everything(cfg.run.seed)
    tok = TextTokenizer.load(Path(cfg.run.out_dir) / "tokenizer")
    return {k: v.clone() for k, v in build_captioner(cfg, tok).state_dict().items()}


@pytest.fixture(scope="module")
def pretrain_run(cap_data: Path, tmp_path_factory: pytest.TempPathFactory):
    """The pretrain preset (vision and decoder frozen), evaluated once at the end."""
    cfg = _cfg("pretrain", cap_data, tmp_path_factory.mktemp("pre") / "run")
    return cfg, train(cfg)


def test_pretrain_preset_trains_only_the_connector(pretrain_run) -> None:
    cfg, summary = pretrain_run
    run = Path(cfg.run.out_dir)
    val = summary["val"]
    for k in ("eval_loss", "eval_token_acc", "eval_BLEU-4", "eval_CIDEr-D"):
        assert k in val and val[k] == val[k]  # present and not NaN
    assert val["eval_n_images"] == 8 and summary["best_metric"] == "eval_CIDEr-D"
    assert (run / "checkpoints" / "best" / "tokenizer" / "tokenizer.json").is_file()
    init, final = _initial_weights(cfg), _weights(run)
    assert _same(init, final, "vision.") and _same(init, final, "decoder.")
    assert not _same(init, final, "connector.")  # negative control: the trained part moved


@pytest.mark.slow
def test_finetune_preset_init_from_and_lr_scale(pretrain_run, cap_data: Path, tmp_path: Path):
    pre_cfg, pre_summary = pretrain_run
    cfg = _cfg("finetune", cap_data, tmp_path / "ft", **{"model.init_from": pre_cfg.run.out_dir})
    assert cfg.optim.lr_scale == {"vision": 0.1} and cfg.model.freeze == []
    trainer = Trainer(cfg, stage=get_stage(cfg.stage))
    trainer.stage.prepare()
    model = trainer.stage.build_model()
    # step-0 eval of the initialised model reproduces the source run's final eval
    before = trainer.evaluate(model, "val")
    assert before["loss"] == pytest.approx(pre_summary["val"]["eval_loss"], abs=1e-6)
    assert before["CIDEr-D"] == pytest.approx(pre_summary["val"]["eval_CIDEr-D"], abs=1e-9)
    scales = {n: g["lr_scale"] for g in param_groups(model, cfg.optim) for n in g["names"]}
    assert {s for n, s in scales.items() if n.startswith("vision.")} == {0.1}
    assert {s for n, s in scales.items() if not n.startswith("vision.")} == {1.0}
    summary = trainer.run()  # the same trainer: its folder already holds the tokenizer
    assert summary["steps"] == 3
    src, final = _weights(Path(pre_cfg.run.out_dir)), _weights(tmp_path / "ft")
    for part in ("vision.", "connector.", "decoder."):
        assert not _same(src, final, part)  # nothing frozen in finetune
    tok_src = Path(pre_cfg.run.out_dir) / "tokenizer" / "tokenizer.json"
    assert (tmp_path / "ft" / "tokenizer" / "tokenizer.json").read_text() == tok_src.read_text()


def test_init_from_negative_control_random_init_differs(pretrain_run, cap_data, tmp_path):
    pre_cfg, pre_summary = pretrain_run
    cfg = _cfg("finetune", cap_data, tmp_path / "scratch")
    trainer = Trainer(cfg, stage=get_stage(cfg.stage))
    trainer.stage.prepare()
    fresh = trainer.evaluate(trainer.stage.build_model(), "val")
    assert abs(fresh["loss"] - pre_summary["val"]["eval_loss"]) > 1e-3


def test_sft_preset_masks_the_prompt_and_freezes_vision(pretrain_run, cap_data, tmp_path):
    pre_cfg, _ = pretrain_run
    cfg = _cfg("sft", cap_data, tmp_path / "sft", **{"model.init_from": pre_cfg.run.out_dir})
    trainer = Trainer(cfg, stage=get_stage(cfg.stage))
    trainer.stage.prepare()
    stage, tok = trainer.stage, trainer.stage.tokenizer
    ds = stage.core.train_dataset()
    batch = CaptionCollate(tok.pad_id)([ds[(0, 0, i)] for i in range(4)])
    for row in range(4):
        rec = ds.records[row]["messages"]
        want = [*tok.encode(rec[1]["content"]), tok.eos_id, *tok.encode(rec[3]["content"])]
        labels = batch["labels"][row]
        got = labels[labels != IGNORE_INDEX].tolist()
        assert got == [*want, tok.eos_id]
        kept = labels != IGNORE_INDEX
        assert torch.equal(batch["input_ids"][row][kept], labels[kept])
        assert int(kept.sum()) < int(batch["attention_mask"][row].sum()) - 8  # prompt masked
    summary = trainer.run()  # the same trainer: its folder already holds the tokenizer
    assert "eval_CIDEr-D" in summary["val"]
    src, final = _weights(Path(pre_cfg.run.out_dir)), _weights(tmp_path / "sft")
    assert _same(src, final, "vision.") and not _same(src, final, "decoder.")


def test_generate_cli_on_a_checkpoint(pretrain_run, cap_data: Path, tmp_path: Path, capsys):
    cfg, summary = pretrain_run
    imgs = [str(cap_data / r["image"]) for r in read_jsonl(cap_data / "val.jsonl")[:2]]
    args = ["generate", "--checkpoint", cfg.run.out_dir, "--images", imgs[0], "missing.png"]
    assert main([*args, imgs[1], "--strategy", "beam", "--beams", "2"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["image"] for r in rows] == [imgs[0], "missing.png", imgs[1]]
    assert isinstance(rows[0]["caption"], str) and rows[1]["error"] == "missing"
    out = tmp_path / "caps.jsonl"
    step = Path(cfg.run.out_dir) / "checkpoints" / "step_3"
    assert (
        main(["generate", "--checkpoint", str(step), "--images", imgs[0], "--out", str(out)]) == 0
    )
    assert len(out.read_text().splitlines()) == 1
    assert main(["generate", "--checkpoint", str(tmp_path), "--images", imgs[0]]) == 2
    # scoring a caption file from the CLI reproduces the stage's own evaluation
    val = str(cap_data / "val.jsonl")
    assert main(["generate", "--checkpoint", cfg.run.out_dir, "--eval-data", val,
                 "--max-new-tokens", "6"]) == 0  # fmt: skip
    scores = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert scores["CIDEr-D"] == pytest.approx(summary["val"]["eval_CIDEr-D"], abs=1e-9)
    assert scores["BLEU-4"] == pytest.approx(summary["val"]["eval_BLEU-4"], abs=1e-9)


class Interrupt(Exception):
    pass


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_exact_mid_epoch_resume_with_length_buckets(cap_data, tmp_path, monkeypatch) -> None:
    # 64 samples / batch 16 = 4 batches per epoch: step 2 is mid-epoch, resume crosses epochs
    opts = {
        "data.length_buckets": 3,
        "data.max_train_samples": 64,
        "data.num_workers": 0,  # worker prefetch vs position: tests/engine/test_resume.py
        "data.eval": "",
        "model.dropout": 0.1,
        "train.max_steps": 6,
        "train.save_every": 2,
    }
    full, part = tmp_path / "full", tmp_path / "part"
    train(_cfg("finetune", cap_data, full, **opts))
    real = loop.Trainer._maybe_eval_and_save

    def stop_after_3(self, model, logger):
        real(self, model, logger)
        if self.state.step == 3:  # after the step-2 checkpoint
            raise Interrupt

    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", stop_after_3)
    with pytest.raises(Interrupt):
        train(_cfg("finetune", cap_data, part, **opts))
    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", real)
    train(_cfg("finetune", cap_data, part, **opts, **{"train.resume": True}))
    a, b = _losses(full), _losses(part)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [a[s] for s in a] == [b[s] for s in a]
    wa, wb = _weights(full, "step_6"), _weights(part, "step_6")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_torchrun_two_processes_equal_one(cap_data: Path, tmp_path: Path) -> None:
    opts = {"data.length_buckets": 2, "model.freeze": "[]", "train.max_steps": 3}
    one = _cfg("finetune", cap_data, tmp_path / "one", **opts)
    one_summary = train(one)
    args = caption_overrides(
        cap_data, tmp_path / "two", "finetune", **opts, **{"data.batch_size": 8}
    )
    torchrun_vltrain(["train", str(PRESETS["finetune"]), *args], tmp_path)
    two_summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one_summary["val"].keys() == two_summary["val"].keys()
    for k, v in one_summary["val"].items():
        assert abs(v - two_summary["val"][k]) < 1e-4, k
    w1, w2 = _weights(tmp_path / "one", "step_3"), _weights(tmp_path / "two", "step_3")
    init = _initial_weights(one)
    assert max(float((w1[k] - init[k]).abs().max()) for k in w1) > 1e-3  # training moved them
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
