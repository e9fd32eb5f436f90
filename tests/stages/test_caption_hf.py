"""The caption stage on HF VLMs: model kinds hf_vlm (Qwen2-VL, Qwen3-VL, LLaVA, Idefics3) and
llava (assembled from a CLIP tower + a causal LM + a projector), trained from the CLI on tiny
random models saved locally; freezing, lr_scale on parts, LoRA, exact visual-token counts, the
export plain transformers reloads (greedy captions token for token), DDP and resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, hardlink_tree, torchrun_vltrain
from tests.models import vlm_fixtures
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.config.core import ConfigError
from vltrain.data.readers import read_jsonl
from vltrain.engine import loop
from vltrain.runs import train

pytestmark = pytest.mark.usefixtures("one_thread")
PRESET = {"hf_vlm": REPO / "configs" / "caption_hf_vlm.yaml"}
PRESET["llava"] = REPO / "configs" / "caption_llava.yaml"
FAMILIES = ("qwen2vl", "qwen3vl", "hf_llava", "idefics3")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vlms")
    out = {}
    for name in (*FAMILIES, "clip_vision", "causal_lm_dir"):
        (root / name).mkdir()
        out[name] = getattr(vlm_fixtures, f"tiny_{name}")(root / name)
    return out


@pytest.fixture(scope="module")
def data(shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 training records, a 16-image val split and a two-turn chat version of it."""
    out = tmp_path_factory.mktemp("vlmdata")
    hardlink_tree(shapes_dir / "images", out / "images")
    train_recs = read_jsonl(shapes_dir / "train.jsonl")[:16]
    val = read_jsonl(shapes_dir / "val.jsonl")[:16]
    (out / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_recs))
    (out / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in val))
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
        for r in train_recs
    ]
    (out / "chat_train.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    return out


def overrides(kind: str, models: dict, data: Path, out: Path, **extra: object) -> list[str]:
    base: dict[str, object] = {
        "run.out_dir": out,
        "run.precision": "fp32",
        "data.train": data / "train.jsonl",
        "data.eval": data / "val.jsonl",
        "data.batch_size": 4,
        "data.num_workers": 0,
        "train.max_steps": 2,
        "train.eval_every": 0,
        "train.save_every": 2,
        "train.log_every": 1,
        "optim.warmup_steps": 0,
        "optim.lr": 1e-3,
        "caption.max_new_tokens": 5,
        "log.progress": False,
        "log.tensorboard": False,
    }
    if kind == "hf_vlm":
        base |= {"model.path": models["qwen2vl"], "model.lora_r": 0, "data.max_visual_tokens": 4}
    else:
        base |= {"model.path": models["causal_lm_dir"], "data.image_size": 32}
        base["model.vision_path"] = models["clip_vision"]
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _weights(run: Path, step: int = 2) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / f"step_{step}" / "model.safetensors")


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


# ---- training ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_vlm_trains_from_the_cli_with_the_vision_tower_frozen(
    family: str, models: dict, data: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForImageTextToText

    extra = {"model.path": models[family], "model.freeze": "[vision]", "train.eval_every": 2}
    extra["data.max_visual_tokens"] = 4 if family.startswith("qwen") else 0
    over = overrides("hf_vlm", models, data, tmp_path / "run", **extra)
    assert main(["train", str(PRESET["hf_vlm"]), *over]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    assert any("eval_CIDEr-D" in r for r in rows)
    after = _weights(tmp_path / "run")
    init = AutoModelForImageTextToText.from_pretrained(models[family]).state_dict()
    vision = [k for k in init if ("visual." in k or "vision_" in k) and "merger" not in k]
    assert vision and all(torch.equal(after["model." + k], init[k]) for k in vision)
    moved = [k for k in init if not torch.equal(after["model." + k], init[k])]
    assert any("language_model" in k or "text_model" in k for k in moved)


def test_visual_token_budget_is_exact(models: dict, data: Path, tmp_path: Path) -> None:
    from vltrain.engine.runtime import RunContext
    from vltrain.stages import get_stage

    cfg = load_config(PRESET["hf_vlm"], overrides("hf_vlm", models, data, tmp_path / "r"))
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = get_stage("caption")(cfg, tmp_path / "r", ctx)
    stage.prepare()
    batch = next(iter(stage.build_loader())).data
    assert int(batch["visual_tokens"].max()) <= 4
    n_pad = (batch["input_ids"] == stage.core.collate._load()["image_token_id"]).sum(1)
    assert n_pad.tolist() == batch["visual_tokens"].tolist()


def _llava_stage(models: dict, data: Path, out: Path, **extra: object):
    from vltrain.engine.runtime import RunContext
    from vltrain.stages import check_config

    cfg = load_config(PRESET["llava"], overrides("llava", models, data, out, **extra))
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, out, ctx)
    stage.prepare()
    return cfg, stage


@pytest.mark.parametrize(("strategy", "tokens"), [("default", 16), ("full", 17)])
def test_llava_assembly_copies_the_parts_and_counts_visual_tokens(
    models: dict, data: Path, tmp_path: Path, strategy: str, tokens: int
) -> None:
    from transformers import AutoModelForCausalLM, CLIPVisionModel

    opts = f"{{feature_layer: -2, select_strategy: {strategy}}}"
    _, stage = _llava_stage(models, data, tmp_path / "r", **{"model.connector_options": opts})
    model = stage.build_model()
    base = model.base_model()
    assert type(base).__name__ == "LlavaForConditionalGeneration"
    tower = CLIPVisionModel.from_pretrained(models["clip_vision"]).state_dict()
    got = base.model.vision_tower.state_dict()
    assert all(torch.equal(got[k], v) for k, v in tower.items())
    lm = AutoModelForCausalLM.from_pretrained(models["causal_lm_dir"]).state_dict()
    got = base.model.language_model.state_dict()
    n = lm["model.embed_tokens.weight"].shape[0]
    assert got["embed_tokens.weight"].shape[0] == len(stage.tokenizer)  # <image> included
    assert torch.equal(got["embed_tokens.weight"][:n], lm["model.embed_tokens.weight"])
    assert torch.equal(
        got["layers.1.mlp.down_proj.weight"], lm["model.layers.1.mlp.down_proj.weight"]
    )
    batch = next(iter(stage.build_loader())).data
    assert batch["visual_tokens"].tolist() == [tokens] * 4
    out = model(batch["images"], batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert torch.isfinite(out["loss"]) and int(out["n_tokens"]) > 0
    # pretrain (the preset): only the projector trains
    trainable = {n.split(".")[2] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"multi_modal_projector"}


def test_llava_finetune_scales_the_vision_lr(models: dict, data: Path, tmp_path: Path) -> None:
    from vltrain.engine.optim import param_groups

    cfg, stage = _llava_stage(
        models,
        data,
        tmp_path / "r",
        **{"model.freeze": "[]", "caption.mode": "finetune", "optim.lr_scale.vision": 0.1},
    )
    groups = param_groups(stage.build_model(), cfg.optim)
    scaled = {n for g in groups if g["lr_scale"] == 0.1 for n in g["names"]}
    full = {n for g in groups if g["lr_scale"] == 1.0 for n in g["names"]}
    assert scaled and all(".vision_tower." in n for n in scaled)
    assert any(".language_model." in n for n in full) and not any("vision" in n for n in full)


# ---- export: plain transformers reproduces the greedy captions ---------------------------


def plain_transformers_greedy(folder: str, images: list, prompt: str, new: int) -> list[list[int]]:
    """Greedy new token ids of an exported folder, with transformers only (no vltrain)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    proc = AutoProcessor.from_pretrained(folder)
    enc = proc(
        text=[prompt] * len(images), images=images, return_tensors="pt", add_special_tokens=False
    )
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=new, num_beams=1)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {proc.tokenizer.pad_token_id}
    rows = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def _vltrain_greedy(run: Path, images: list) -> tuple[list[list[int]], list]:
    from vltrain.inference.vlm_captioning import decode_vlm_ids
    from vltrain.tools.loading import load_trained

    cfg, stage, model = load_trained(run)
    collate = stage.core.collate
    user = cfg.caption.instruction if cfg.caption.mode == "sft" else cfg.caption.prompt
    chat = [{"role": "user", "content": user}, {"role": "assistant", "content": "x"}]
    samples = [
        {"image": im, "messages": chat, "index": i, "refs": ["x"]} for i, im in enumerate(images)
    ]
    batch = collate(samples)
    pad = stage.tokenizer.pad_token_id
    return decode_vlm_ids(
        model, batch["images"], batch["prompt_ids"], "greedy", pad_id=pad, max_new_tokens=6
    ), model


@pytest.mark.parametrize("kind", ["llava", "hf_vlm"])
def test_export_reloads_in_plain_transformers_with_identical_greedy_captions(
    kind: str, models: dict, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """... and `vltrain generate --checkpoint RUN` (LoRA run) prints those captions too."""
    from PIL import Image

    extra: dict[str, object] = {"caption.mode": "sft", "model.lora_r": 4, "model.lora_alpha": 64}
    extra["caption.instruction"] = "describe the image."
    if kind == "llava":
        extra["model.freeze"] = "[vision]"
    else:
        extra |= {"model.path": models["hf_llava"], "data.max_visual_tokens": 0}
    run = tmp_path / "run"
    assert main(["train", str(PRESET[kind]), *overrides(kind, models, data, run, **extra)]) == 0
    exported = tmp_path / "export"
    assert main(["export", str(run), "--format", "hf", "--out", str(exported)]) == 0
    assert not (exported / "adapter_config.json").exists()  # LoRA merged
    assert str(tmp_path) not in (exported / "config.json").read_text()  # no absolute paths
    recs = read_jsonl(data / "val.jsonl")
    images = [Image.open(data / r["image"]).convert("RGB") for r in recs]
    assert len(images) == 16
    ours, model = _vltrain_greedy(run, images)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported)
    user = [{"type": "image"}, {"type": "text", "text": "describe the image."}]
    if kind == "llava":
        user = "<image>\n" + "describe the image."
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    theirs = plain_transformers_greedy(str(exported), images, prompt, 6)
    assert ours == theirs
    assert sum(len(r) for r in ours) > 16  # captions, not just end tokens
    want = [c.strip() for c in tok.batch_decode(ours, skip_special_tokens=True)]
    paths = [str(data / r["image"]) for r in recs]
    gen = ["generate", "--checkpoint", str(run), "--images", *paths, "--max-new-tokens", "6"]
    for extra in ([], ["--batch-size", "5"], ["--strategy", "sample", "--top-k", "1"]):
        capsys.readouterr()
        assert main([*gen, *extra]) == 0
        rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        assert [r["image"] for r in rows] == paths and [r["caption"] for r in rows] == want
    from vltrain import load_run  # the Python API captions as the command does

    loaded = load_run(run)
    assert loaded.generate(paths, max_new_tokens=6, batch_size=5) == want
    assert loaded.generate(images[:3], max_new_tokens=6) == want[:3]  # PIL images too
    with pytest.raises(ValueError, match=r"images\[1\] cannot be used"):
        loaded.generate([paths[0], str(tmp_path / "missing.png")], max_new_tokens=6)
    capsys.readouterr()  # control: sampling at full temperature gives other captions
    assert main([*gen, "--strategy", "sample", "--temperature", "3"]) == 0
    assert [json.loads(x)["caption"] for x in capsys.readouterr().out.splitlines()] != want
    from vltrain.eval.caption_metrics import caption_scores

    assert main(["generate", "--checkpoint", str(run), "--eval-data", str(data / "val.jsonl"),
                 "--max-new-tokens", "6"]) == 0  # fmt: skip
    scores = json.loads(capsys.readouterr().out)
    refs = {i: r["text"] for i, r in enumerate(recs)}
    assert scores == {**caption_scores(dict(enumerate(want)), refs), "n_images": 16.0}
    refused = [(["--draft", str(run)], "--draft captions"), (["--config", "x"], "--config")]
    for bad, words in refused:
        assert main([*gen[:3], "--eval-data", str(data / "val.jsonl"), *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("vltrain: error:") and words in err, err
    # control: the export holds the LoRA-merged weights, not the base ones
    held = load_file(exported / "model.safetensors")
    key = next(k for k in held if "vision" not in k and k.endswith("0.self_attn.q_proj.weight"))
    layer = model.base_model().model.language_model.layers[0].self_attn.q_proj
    assert torch.equal(held[key], layer.get_base_layer().weight + layer.get_delta_weight("default"))
    assert not torch.equal(held[key], layer.get_base_layer().weight)


# ---- invariants: DDP 2 processes == 1 process, exact resume --------------------------------


class Interrupt(Exception):
    pass


DDP_OPTS = {
    "llava": {"model.freeze": "[]", "caption.mode": "finetune", "optim.lr_scale.vision": 0.1},
    "hf_vlm": {"caption.mode": "sft", "model.lora_r": 4, "model.lora_alpha": 64},
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llava", "hf_vlm"])
def test_two_processes_equal_one(kind: str, models: dict, data: Path, tmp_path: Path) -> None:
    """llava: full finetune, the tower at 0.1x; hf_vlm: Qwen2-VL (mm_token_type_ids, a 4-token
    budget) with LoRA, SFT. Captions of different lengths pad differently per rank."""
    opts = {**DDP_OPTS[kind], "train.max_steps": 3, "train.save_every": 3, "train.eval_every": 3}
    one = load_config(
        PRESET[kind],
        overrides(kind, models, data, tmp_path / "one", **opts, **{"data.batch_size": 8}),
    )
    one_summary = train(one)
    args = overrides(kind, models, data, tmp_path / "two", **opts)
    torchrun_vltrain(["train", str(PRESET[kind]), *args], tmp_path)
    two_summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    a, b = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert [a[s] for s in a] == pytest.approx([b[s] for s in a], abs=2e-5)
    for k, v in one_summary["val"].items():
        assert abs(v - two_summary["val"][k]) < 1e-4, k
    w1, w2 = _weights(tmp_path / "one", 3), _weights(tmp_path / "two", 3)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 3e-5
    # control: one rank's half batch alone trains elsewhere
    alone = load_config(
        PRESET[kind],
        overrides(kind, models, data, tmp_path / "alone", **{**opts, "data.eval": ""}),
    )
    train(alone)
    w3 = _weights(tmp_path / "alone", 3)
    assert max(float((w1[k] - w3[k]).abs().max()) for k in w1) > 1e-4


def test_llava_exact_mid_epoch_resume(
    models: dict, data: Path, tmp_path: Path, monkeypatch
) -> None:
    opts = {"model.freeze": "[]", "caption.mode": "finetune", "data.eval": ""}
    opts |= {"train.max_steps": 6, "train.save_every": 2}  # 16 records / batch 4: epoch = 4 steps
    full, part = tmp_path / "full", tmp_path / "part"
    train(load_config(PRESET["llava"], overrides("llava", models, data, full, **opts)))
    real = loop.Trainer._maybe_eval_and_save

    def stop_after_3(self, model, logger):
        real(self, model, logger)
        if self.state.step == 3:
            raise Interrupt

    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", stop_after_3)
    with pytest.raises(Interrupt):
        train(load_config(PRESET["llava"], overrides("llava", models, data, part, **opts)))
    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", real)
    resumed = overrides("llava", models, data, part, **opts, **{"train.resume": True})
    train(load_config(PRESET["llava"], resumed))
    a, b = _losses(full), _losses(part)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert [a[s] for s in a] == [b[s] for s in a]
    wa, wb = _weights(full, 6), _weights(part, 6)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_llava_tower_from_a_vltrain_hf_clip_run(
    models: dict, data: Path, shapes_dir: Path, tmp_path: Path
) -> None:
    """model.vision_path may name a contrastive run of hf_clip: its trained tower is copied."""
    from transformers import CLIPModel

    from tests.conftest import tiny_overrides
    from tests.models.test_hf_embedders import _tokenizer

    clip = tmp_path / "clip_src"
    from transformers import CLIPConfig, CLIPImageProcessorPil

    tok = _tokenizer(eos_template=True)
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    text |= dict(num_attention_heads=2, max_position_embeddings=32, eos_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    vision |= dict(image_size=32, patch_size=8)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ).save_pretrained(clip)
    tok.save_pretrained(clip)
    size = {"height": 32, "width": 32}
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size=size).save_pretrained(clip)
    run = tmp_path / "clip_run"
    extra = {"model.path": clip, "train.max_steps": 2, "train.save_every": 2, "data.eval": ""}
    extra |= {"data.batch_size": 4, "optim.lr": 1e-3, "optim.warmup_steps": 0}
    extra["data.max_text_len"] = 16
    over = tiny_overrides(shapes_dir, run, **extra)
    over = [o for o in over if not o.startswith("data.tokenizer_vocab")]
    assert main(["train", str(REPO / "configs" / "hf_clip.yaml"), *over]) == 0
    _, stage = _llava_stage(models, data, tmp_path / "r", **{"model.vision_path": run})
    tower = stage.build_model().base_model().model.vision_tower.state_dict()
    from transformers import CLIPVisionModel

    want = CLIPVisionModel.from_pretrained(run / "checkpoints" / "step_2" / "hf_model").state_dict()
    assert tower.keys() == want.keys()
    assert all(torch.equal(tower[k], v) for k, v in want.items())
    start = CLIPVisionModel.from_pretrained(clip).state_dict()
    assert any(not torch.equal(start[k], v) for k, v in want.items())  # the run trained it


@pytest.mark.parametrize("kind", ["llava", "hf_vlm"])
def test_multi_turn_chat_records_learn_every_assistant_turn(
    kind: str, models: dict, data: Path, tmp_path: Path
) -> None:
    from vltrain.engine.runtime import RunContext
    from vltrain.stages import check_config

    extra = {
        "caption.mode": "sft",
        "data.train": data / "chat_train.jsonl",
        "data.max_text_len": 200,
    }
    cfg = load_config(PRESET[kind], overrides(kind, models, data, tmp_path / "r", **extra))
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, tmp_path / "r", ctx)
    stage.prepare()
    batch = next(iter(stage.build_loader())).data
    tok = stage.tokenizer
    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        text = tok.decode([t for t in labels.tolist() if t != -100])
        assert ("yes" in text or "no" in text) and "is it red" not in text
        assert "what do you see" in tok.decode(ids.tolist())  # the prompt is there, unlabelled
    model = stage.build_model()
    out = model(batch["images"], batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert torch.isfinite(out["loss"]) and int(out["n_tokens"]) == int(
        (batch["labels"][:, 1:] != -100).sum()
    )


@pytest.mark.parametrize("kind", ["llava", "hf_vlm"])
def test_max_text_len_counts_text_after_the_image_and_a_cut_answer_is_said(
    kind: str, models: dict, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """data.max_text_len counts the text tokens after the image (the image and a template's
    text before it are never cut: a cut inside the image tokens crashed the forward); answers
    it cuts are said before the first step, with the length that keeps them whole."""
    from vltrain.engine.runtime import RunContext
    from vltrain.stages import check_config

    def first_batch(max_len: int):
        extra = {"caption.mode": "sft", "data.train": data / "chat_train.jsonl"}
        extra["data.max_text_len"] = max_len
        out = tmp_path / f"r{max_len}"
        cfg = load_config(PRESET[kind], overrides(kind, models, data, out, **extra))
        ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
        stage = check_config(cfg)(cfg, out, ctx)
        stage.prepare()
        batch = next(iter(stage.build_loader())).data
        return stage, batch, capsys.readouterr().err

    stage, whole, said = first_batch(200)
    assert "longer than data.max_text_len" not in said
    image_id = stage.core.collate._load()["image_token_id"]
    after = [
        len(row) - 1 - max(i for i, t in enumerate(row) if t == image_id)
        for row in (
            r[m.bool()].tolist()
            for r, m in zip(whole["input_ids"], whole["attention_mask"], strict=True)
        )
    ]
    short = min(after) - 6  # every sample loses its last six text tokens
    stage, batch, said = first_batch(short)
    assert f"16 of the first 16 training samples are longer than data.max_text_len={short}" in said
    longest = int(re.search(r"set data.max_text_len=(\d+)", said).group(1))
    assert longest >= max(after)
    for ids, mask, n_img, full in zip(
        batch["input_ids"],
        batch["attention_mask"],
        batch["visual_tokens"],
        whole["input_ids"],
        strict=True,
    ):
        row = ids[mask.bool()].tolist()
        assert row.count(image_id) == int(n_img)  # the image whole
        assert len(row) - 1 - max(i for i, t in enumerate(row) if t == image_id) == short
        assert row == full[: len(row)].tolist()  # the cut is at the end only
    _, _, said = first_batch(longest)
    assert "longer than data.max_text_len" not in said


def test_a_template_that_rewrites_history_is_refused_before_the_first_step(
    models: dict, data: Path, tmp_path: Path
) -> None:
    """Qwen3's and DeepSeek-R1's templates drop earlier turns' reasoning: multi-turn chats
    cannot be labelled under them. The first training chats are labelled before the first
    step, so the run stops there with a ConfigError, not mid-run with a traceback."""
    import shutil

    from transformers import AutoTokenizer

    from vltrain.engine.runtime import RunContext
    from vltrain.stages import check_config

    lm = tmp_path / "lm"
    shutil.copytree(models["causal_lm_dir"], lm)
    tok = AutoTokenizer.from_pretrained(lm)
    tok.chat_template = (  # every assistant turn but the last dropped
        "{% for m in messages %}{% if m['role'] == 'user' or loop.last %}<|im_start|>"
        "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok.save_pretrained(lm)
    extra = {"caption.mode": "sft", "data.train": data / "chat_train.jsonl", "model.path": lm}
    cfg = load_config(PRESET["llava"], overrides("llava", models, data, tmp_path / "r", **extra))
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, tmp_path / "r", ctx)
    stage.prepare()
    with pytest.raises(ConfigError, match="rewrites earlier turns"):
        stage.build_loader()


def test_llava_on_a_siglip_tower_keeps_every_patch(
    models: dict, data: Path, tmp_path: Path
) -> None:
    """SigLIP has no class token: the default select strategy is full, 16 tokens for 16 patches,
    and the processor saved with the run agrees with the model's features."""
    from transformers import LlavaProcessor, SiglipVisionModel

    (tmp_path / "siglip").mkdir()
    siglip = vlm_fixtures.tiny_siglip_vision(tmp_path / "siglip")
    _, stage = _llava_stage(models, data, tmp_path / "r", **{"model.vision_path": siglip})
    model = stage.build_model()
    base = model.base_model()
    assert base.config.vision_feature_select_strategy == "full"
    want = SiglipVisionModel.from_pretrained(siglip).state_dict()
    got = base.model.vision_tower.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    batch = next(iter(stage.build_loader())).data
    assert batch["visual_tokens"].tolist() == [16] * 4
    out = model(batch["images"], batch["input_ids"], batch["attention_mask"], batch["labels"])
    assert torch.isfinite(out["loss"])
    proc = LlavaProcessor.from_pretrained(tmp_path / "r" / "processor")
    assert proc.num_additional_image_tokens == 0 and proc.vision_feature_select_strategy == "full"


def test_llava_from_a_gguf_language_model(models: dict, data: Path, tmp_path: Path) -> None:
    """model.path may be a .gguf file: transformers dequantises it (needs the gguf package)."""
    pytest.importorskip("gguf")
    from transformers import Qwen2ForCausalLM

    lm = vlm_fixtures.tiny_gguf_lm(tmp_path)
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                str(PRESET["llava"]),
                *overrides("llava", models, data, run, **{"model.path": lm}),
            ]
        )
        == 0
    )
    ref = Qwen2ForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    after = _weights(run)
    layer = "layers.1.mlp.down_proj.weight"
    assert torch.equal(after["model.model.language_model." + layer], ref["model." + layer])
    assert "<image>" in (run / "processor" / "tokenizer.json").read_text()


# ---- the shipped llava pipeline: pretrain (projector) -> finetune (tower at 0.1x) -> sft -> rl


def test_llava_pipeline_preset_chains_the_stages_and_a_rerun_skips_them(
    models: dict, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from vltrain.runs.pipeline import run_pipeline

    over = [o for o in overrides("llava", models, data, tmp_path / "x") if "out_dir" not in o]
    over += ["train.eval_every=0", "data.eval="]
    short = {"stage_overrides": {"rl": ["rl.k=2", "rl.max_new_tokens=5"]}}  # rl's own keys
    preset = REPO / "configs" / "pipeline_llava.yaml"
    root = tmp_path / "root"
    names = ["pretrain", "finetune", "sft", "rl"]
    rows = run_pipeline(preset, over, root=root, report=False, **short)
    assert [(r["name"], r["action"]) for r in rows] == [(n, "train") for n in names]
    cfgs = {n: load_config(root / n / "config.yaml") for n in names}
    assert cfgs["finetune"].model.init_from == str(root / "pretrain")
    assert cfgs["sft"].model.init_from == str(root / "finetune")
    assert cfgs["rl"].model.init_from == str(root / "sft")
    assert cfgs["rl"].stage == "rl" and cfgs["rl"].model.kind == "llava"
    assert cfgs["finetune"].optim.lr_scale == {"vision": 0.1}
    assert [c.caption.mode for c in cfgs.values()] == ["pretrain", "finetune", "sft", "sft"]
    pre, ft, sft = (_weights(root / n) for n in ("pretrain", "finetune", "sft"))
    init = stage_start(models, data, tmp_path)
    moved = {k.split(".")[2] for k in pre if not torch.equal(pre[k], init[k])}
    assert moved == {"multi_modal_projector"}  # pretrain: the projector only
    tower = [k for k in ft if ".vision_tower." in k]
    assert any(not torch.equal(ft[k], pre[k]) for k in tower)  # finetune: the tower trains too
    assert all(torch.equal(sft[k], ft[k]) for k in tower)  # sft: the tower frozen again
    rl = _weights(root / "rl")  # rl: from the sft weights, the LM moves, the tower does not
    assert all(torch.equal(rl[k], sft[k]) for k in tower)
    assert any(not torch.equal(rl[k], sft[k]) for k in rl if ".language_model." in k)
    steps = [
        json.loads(x)
        for x in (root / "rl" / "metrics.jsonl").read_text().splitlines()
        if "train_reward_mean" in x
    ]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["train_reward_mean"] >= 0.0 and r["train_kl"] >= 0.0 for r in steps)
    assert steps[-1]["train_kl"] > 0.0  # the policy moved off its reference (the sft model)
    rerun = run_pipeline(preset, over, root=root, report=False, **short)
    assert [r["action"] for r in rerun] == ["skip"] * 4
    capsys.readouterr()
    image = str(data / read_jsonl(data / "val.jsonl")[0]["image"])
    assert main(["generate", "--checkpoint", str(root / "rl"), "--images", image]) == 0
    assert json.loads(capsys.readouterr().out)["caption"]


def stage_start(models: dict, data: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The llava model a pretrain stage starts from (the projector's init is seeded)."""
    cfg, stage = _llava_stage(models, data, tmp_path / "start")
    torch.manual_seed(cfg.run.seed)
    return {"model." + k: v for k, v in stage.build_model().model.state_dict().items()}


def test_llava_grows_the_vocabulary_for_the_image_token(
    models: dict, data: Path, tmp_path: Path
) -> None:
    """An LM whose tokenizer lacks <image> and whose embeddings (tied, as SmolLM2's) have one
    row per token gets one row more; its own rows arrive unchanged."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(tok_models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=alphabet
    )
    bpe.train_from_iterator(["a red circle above a blue square"] * 3, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")
    assert "<image>" not in tok.get_vocab()
    dims = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    lm_cfg = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, eos_token_id=0, **dims)
    torch.manual_seed(3)
    lm = tmp_path / "lm"
    LlamaForCausalLM(lm_cfg).save_pretrained(lm)
    tok.save_pretrained(lm)
    run = tmp_path / "run"
    over = overrides("llava", models, data, run, **{"model.path": lm})
    assert main(["train", str(PRESET["llava"]), *over]) == 0
    weights = _weights(run)  # tied: one of the two names is saved
    emb = next(
        v for k, v in weights.items() if k.endswith(("embed_tokens.weight", "lm_head.weight"))
    )
    ref = LlamaForCausalLM.from_pretrained(lm).model.embed_tokens.weight
    assert emb.shape[0] == len(tok) + 1
    assert torch.equal(emb[: len(tok)], ref)


# ---- the shipped hf_vlm pipeline: sft (chat, assistant turns) -> rl


def test_hf_vlm_pipeline_preset_runs_sft_then_rl(
    models: dict, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from vltrain.models.hf_vlm import load_hf_vlm
    from vltrain.runs.pipeline import run_pipeline

    over = [o for o in overrides("hf_vlm", models, data, tmp_path / "x") if "out_dir" not in o]
    over += ["train.eval_every=0", "data.eval="]
    short = {"stage_overrides": {"rl": ["rl.k=2", "rl.max_new_tokens=5"]}}
    preset = REPO / "configs" / "pipeline_hf_vlm.yaml"
    root = tmp_path / "root"
    rows = run_pipeline(preset, over, root=root, report=False, **short)
    assert [(r["name"], r["action"]) for r in rows] == [("sft", "train"), ("rl", "train")]
    sft_cfg, rl_cfg = (load_config(root / n / "config.yaml") for n in ("sft", "rl"))
    assert (sft_cfg.stage, sft_cfg.caption.mode, sft_cfg.model.lora_r) == ("caption", "sft", 0)
    assert (rl_cfg.stage, rl_cfg.model.kind, rl_cfg.rl.baseline) == ("rl", "hf_vlm", "rloo")
    assert rl_cfg.model.init_from == str(root / "sft")
    init = {"model." + k: v for k, v in load_hf_vlm(models["qwen2vl"]).state_dict().items()}
    sft, rl = _weights(root / "sft"), _weights(root / "rl")
    tower = [k for k in sft if ".visual." in k and ".merger." not in k]  # merger: connector
    lm = [k for k in sft if ".language_model." in k]
    assert tower and lm
    assert all(torch.equal(sft[k], init[k]) for k in tower)  # sft: vision frozen
    assert any(not torch.equal(sft[k], init[k]) for k in lm)  # the LM learns
    assert all(torch.equal(rl[k], sft[k]) for k in tower)  # rl starts from sft, tower frozen
    assert any(not torch.equal(rl[k], sft[k]) for k in lm)
    steps = [
        json.loads(x)
        for x in (root / "rl" / "metrics.jsonl").read_text().splitlines()
        if "train_reward_mean" in x
    ]
    assert [r["step"] for r in steps] == [1, 2]
    assert steps[-1]["train_kl"] > 0.0  # moved off its reference, the frozen sft model
    rerun = run_pipeline(preset, over, root=root, report=False, **short)
    assert [r["action"] for r in rerun] == ["skip", "skip"]
    capsys.readouterr()
    image = str(data / read_jsonl(data / "val.jsonl")[0]["image"])
    assert main(["generate", "--checkpoint", str(root / "rl"), "--images", image]) == 0
    assert json.loads(capsys.readouterr().out)["caption"]


def test_lora_rl_starts_from_the_lora_sft_run_merged(
    models: dict, data: Path, tmp_path: Path
) -> None:
    """model.init_from a LoRA run: its adapters are merged into the base, and the rl run's own
    adapters start from that model, so its reference (adapters off) is the sft model: KL 0 at
    the first step (the pre-sft base as reference would not give 0)."""
    from transformers import AutoModelForImageTextToText

    from vltrain.runs.pipeline import run_pipeline

    over = [o for o in overrides("hf_vlm", models, data, tmp_path / "x") if "out_dir" not in o]
    over += ["train.eval_every=0", "data.eval=", "model.lora_r=4", "model.lora_alpha=64"]
    rl_over = ["rl.k=2", "rl.max_new_tokens=5", "rl.kl_coeff=0.1", "rl.entropy_coeff=1.0"]
    short = {"stage_overrides": {"rl": rl_over}}
    root = tmp_path / "root"
    run_pipeline(REPO / "configs" / "pipeline_hf_vlm.yaml", over, root=root, report=False, **short)
    steps = [
        json.loads(x)
        for x in (root / "rl" / "metrics.jsonl").read_text().splitlines()
        if "train_kl" in x
    ]
    assert abs(steps[0]["train_kl"]) < 1e-6 and steps[-1]["train_kl"] > 1e-6
    # the rl run's frozen base weights are the sft run's merged weights
    assert main(["export", str(root / "sft"), "--format", "hf", "--out", str(tmp_path / "e")]) == 0
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "e").state_dict()
    sft_lm = {k: v for k, v in merged.items() if "language_model" in k and "q_proj.weight" in k}
    rl = _weights(root / "rl")
    base = {k: v for k, v in rl.items() if "q_proj.base_layer.weight" in k}
    assert len(base) == len(sft_lm) > 0
    init = AutoModelForImageTextToText.from_pretrained(models["qwen2vl"]).state_dict()
    for k, v in sft_lm.items():
        ends = k.replace("q_proj.weight", "q_proj.base_layer.weight")
        (rl_key,) = [b for b in base if b.endswith(ends)]
        assert torch.equal(base[rl_key], v)
        assert not torch.equal(v, init[k])  # sft's adapters moved it
