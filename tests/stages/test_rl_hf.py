"""The rl stage on HF VLMs (model kinds hf_vlm and llava; vltrain/stages/rl_hf.py): RL from the
CLI on a tiny Qwen2-VL (from model.path, LoRA) and a tiny LLaVA (from a caption run), the LoRA
reference is the base model without a copy, teacher-forced logits are the decoder loop's, exact
resume, and two processes equal one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, torchrun_vltrain
from tests.stages.test_caption_hf import PRESET as CAPTION_PRESET
from tests.stages.test_caption_hf import (  # noqa: F401  (data, models: fixtures)
    _vltrain_greedy,
    _weights,
    data,
    models,
    overrides,
    plain_transformers_greedy,
)
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.engine import loop
from vltrain.runs import train

pytestmark = pytest.mark.usefixtures("one_thread")
PRESET = {
    "hf_vlm": REPO / "configs" / "rl_hf_vlm.yaml",
    "llava": REPO / "configs" / "rl_llava.yaml",
}
RL_OPTS = {
    "rl.k": 3,
    "rl.max_new_tokens": 5,
    "caption.num_beams": 2,
    "caption.max_new_tokens": 4,
    "train.max_steps": 2,
    "train.save_every": 2,
    "train.eval_every": 2,
    "optim.lr": 1e-2,
}


@pytest.fixture(scope="module")
def llava_caption_run(models: dict, data: Path, tmp_path_factory) -> Path:  # noqa: F811
    """A 2-step llava caption finetune: the model.init_from of the llava rl runs."""
    out = tmp_path_factory.mktemp("llava_cap") / "run"
    opts = {"model.freeze": "[]", "caption.mode": "finetune", "data.eval": ""}
    train(load_config(CAPTION_PRESET["llava"], overrides("llava", models, data, out, **opts)))
    return out


def rl_overrides(
    kind: str,
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    out: Path,
    init: Path | None = None,
    **extra: object,
) -> list[str]:
    opts: dict[str, object] = {**RL_OPTS}
    if kind == "hf_vlm":  # straight from model.path, LoRA on (the preset's)
        opts |= {"model.lora_r": 4, "model.lora_alpha": 64}
    else:
        opts |= {"model.init_from": init, "caption.mode": "finetune"}
    opts |= extra
    args = overrides(kind, models, data, out, **opts)
    if kind == "hf_vlm":
        args = [a for a in args if not a.startswith("model.lora_r=0")]
    return args


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


RUNS = {  # kind, overrides: every baseline on one of the kinds
    "hf_vlm-rloo": ("hf_vlm", {}),
    "llava-ema": ("llava", {}),
    "hf_vlm-greedy-length": ("hf_vlm", {"rl.baseline": "greedy", "rl.length_penalty": 0.1}),
    "llava-grpo": ("llava", {"rl.baseline": "grpo", "rl.entropy_coeff": 0.01}),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_rl_trains_from_the_cli_and_logs_the_reward(
    run: str,
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    kind, extra = RUNS[run]
    init = request.getfixturevalue("llava_caption_run") if kind == "llava" else None
    out = tmp_path / "rl"
    args = rl_overrides(kind, models, data, out, init, **extra)
    assert main(["train", str(PRESET[kind]), *args]) == 0
    steps = [r for r in _rows(out) if "train_reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= r["train_reward_mean"] and r["train_kl"] >= 0.0 and r["train_entropy"] > 0.0
        assert 0.0 <= r["train_rep4_rate"] <= 1.0 and r["train_caption_words"] >= 0.0
        assert 1.0 <= r["train_length_mean"] <= 5.0
        if run.endswith(("rloo", "grpo")):  # group baselines: advantages sum to zero per group
            assert abs(r["train_adv_mean"]) < 1e-5
        assert ("train_baseline" in r) == run.endswith("ema")
        assert ("train_length_penalty" in r) == run.endswith("length")
    summary = json.loads((out / "summary.json").read_text())
    assert {"eval_CIDEr-D", "eval_BLEU-4"} <= set(summary["val"])
    assert steps[-1]["train_kl"] > 0.0  # the policy moved off its reference


def test_rl_run_exports_for_plain_transformers(
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """An hf_vlm rl run (tiny LLaVA, LoRA) exports with --format hf like a caption run: plain
    transformers reloads it and its greedy captions are vltrain's, token for token."""
    from PIL import Image
    from transformers import AutoTokenizer

    from vltrain.data.readers import read_jsonl

    extra = {"model.path": models["hf_llava"], "data.max_visual_tokens": 0}
    extra |= {"caption.instruction": "describe the image.", "train.eval_every": 0}
    run, exported = tmp_path / "rl", tmp_path / "export"
    assert (
        main(["train", str(PRESET["hf_vlm"]), *rl_overrides("hf_vlm", models, data, run, **extra)])
        == 0
    )
    assert main(["export", str(run), "--format", "hf", "--out", str(exported)]) == 0
    assert not (exported / "adapter_config.json").exists()  # LoRA merged
    images = [Image.open(data / r["image"]).convert("RGB") for r in read_jsonl(data / "val.jsonl")]
    ours, _ = _vltrain_greedy(run, images[:8])
    user = [{"type": "image"}, {"type": "text", "text": "describe the image."}]
    prompt = AutoTokenizer.from_pretrained(exported).apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    assert ours == plain_transformers_greedy(str(exported), images[:8], prompt, 6)
    assert sum(len(r) for r in ours) > 8  # captions, not just end tokens


# ---- the reference and the teacher-forced logits ------------------------------------------


def _stage(cfg, out: Path):
    from vltrain.engine.runtime import RunContext
    from vltrain.stages import check_config

    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, out, ctx)
    stage.prepare()
    return stage


def _batch(stage, n: int = 4):
    """n training samples; the second one's instruction longer (the others are left-padded)."""
    ds = stage.core.train_dataset(train=False)
    samples = [ds[i] for i in range(n)]
    samples[1]["messages"][0]["content"] += " use a few short words, please."
    return stage.core.collate(samples)


@pytest.mark.parametrize("family", ["qwen2vl", "hf_llava"])
def test_lora_reference_is_the_base_model_and_teacher_forcing_is_the_decoder_loop(
    family: str,
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Qwen2-VL (M-RoPE) and LLaVA (mask-based positions), prompts of different lengths (left
    padding), each with a trained-looking LoRA adapter: the adapter-disabled logits are those
    of the base model loaded afresh, no frozen copy is built, and the teacher-forced policy
    logits are the ones the decoder loop sampled from."""
    from vltrain.inference.decoding import generate
    from vltrain.models.hf_vlm import HFVLM, load_hf_vlm
    from vltrain.objectives.reference import reference_logits
    from vltrain.stages import rl, rl_hf

    def no_copy(model):
        raise AssertionError("a LoRA policy needs no frozen copy")

    monkeypatch.setattr(rl_hf, "frozen_reference", no_copy)
    monkeypatch.setattr(rl, "frozen_reference", no_copy)
    over = rl_overrides("hf_vlm", models, data, tmp_path / "rl", **{"model.path": models[family]})
    if family == "hf_llava":  # a fixed-size family: no visual-token budget
        over = [o for o in over if not o.startswith("data.max_visual_tokens")]
    cfg = load_config(PRESET["hf_vlm"], over)
    stage = _stage(cfg, tmp_path / "rl")
    policy = stage.build_model()
    assert stage.reference is None
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    batch = _batch(stage)
    s = stage.hf.sample(policy, batch, torch.Generator().manual_seed(0))
    assert len(set(s["pmask"].sum(1).tolist())) > 1  # left padding is exercised
    fn = stage.hf.logits_fn(policy, batch, s, 3)
    ref = reference_logits(fn, policy, None)
    base = HFVLM(load_hf_vlm(models[family]), "hf_vlm").eval()
    with torch.no_grad():
        want, mine = fn(base), fn(policy)
    mask = torch.arange(s["seq"].shape[1])[None] < s["len"][:, None]  # (N, L) sampled tokens
    assert float((ref - want)[mask].abs().max()) < 1e-5
    assert float((mine - want)[mask].abs().max()) > 1e-2  # control: the adapter matters
    assert policy.training is True and any(p.requires_grad for p in policy.parameters())
    # teacher forcing gives the distributions the decoder loop sampled from, row for row
    seen: list[torch.Tensor] = []

    class Recording(rl_hf.CaptionTarget):
        def prefill(self, *args, **inputs):
            out = super().prefill(*args, **inputs)
            seen.append(out[0])
            return out

        def step(self, tokens, cache):
            out = super().step(tokens, cache)
            seen.append(out[0])
            return out

    target = Recording(policy.base_model(), stage.hf.banned, eos_token_id=stage.hf.eos_ids)
    inputs = stage.hf._inputs(policy, batch)
    gen = torch.Generator().manual_seed(1)
    out = generate(target, dict(inputs), "sample", max_new_tokens=5, generator=gen)
    loop_logits = torch.stack(seen[: out.sequences.shape[1]], 1)  # (B, L, V)
    g = {"ids": inputs["input_ids"], "pmask": inputs["attention_mask"]}
    g |= {"seq": out.sequences, "len": out.lengths}
    with torch.no_grad():
        forced = stage.hf.logits_fn(policy, batch, g, 1)(policy)  # (B, L, V)
    gmask = torch.arange(g["seq"].shape[1])[None] < g["len"][:, None]
    assert float((forced - loop_logits)[gmask].abs().max()) < 1e-4


# ---- resume and DDP -----------------------------------------------------------------------


class Interrupt(Exception):
    pass


def test_hf_vlm_rl_resumes_exactly(
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stopped after step 2 (saved) and resumed: rollouts (seeded by the rollout count), the
    EMA baseline, LoRA weights and optimizer state continue bit for bit."""
    opts = {"train.max_steps": 4, "train.save_every": 2, "train.eval_every": 0, "data.eval": ""}
    opts["rl.baseline"] = "ema"
    full, part = tmp_path / "full", tmp_path / "part"
    train(load_config(PRESET["hf_vlm"], rl_overrides("hf_vlm", models, data, full, **opts)))
    real = loop.Trainer._maybe_eval_and_save

    def stop_after_2(self, model, logger):
        real(self, model, logger)
        if self.state.step == 2:
            raise Interrupt

    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", stop_after_2)
    with pytest.raises(Interrupt):
        train(load_config(PRESET["hf_vlm"], rl_overrides("hf_vlm", models, data, part, **opts)))
    monkeypatch.setattr(loop.Trainer, "_maybe_eval_and_save", real)
    resumed = rl_overrides("hf_vlm", models, data, part, **opts, **{"train.resume": True})
    train(load_config(PRESET["hf_vlm"], resumed))
    keys = ("loss", "train_reward_mean", "train_kl", "train_baseline", "train_length_mean")
    a = {r["step"]: [r[k] for k in keys] for r in _rows(full) if "loss" in r}
    b = {r["step"]: [r[k] for k in keys] for r in _rows(part) if "loss" in r}
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert a == b
    wa, wb, w2 = _weights(full, 4), _weights(part, 4), _weights(full, 2)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], w2[k]) for k in wa)  # control: steps 3-4 trained


@pytest.mark.slow
def test_two_processes_equal_one(
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """hf_vlm (Qwen2-VL, LoRA): 2 processes x 4 images = 1 process x 8 images. Each rank samples
    with its own noise, so the rollouts are made noise-free (top_p keeps the top token only) and
    the loss a mean over sequences: what remains is the sharding, the gradient sync, the
    all-reduced baseline and metrics, and the sharded evaluation."""
    opts = {"rl.top_p": 1e-6, "rl.normalize": "sequence", "rl.baseline": "ema"}
    opts |= {"train.max_steps": 3, "train.save_every": 3, "train.eval_every": 3}
    one = rl_overrides("hf_vlm", models, data, tmp_path / "one", **opts, **{"data.batch_size": 8})
    one_summary = train(load_config(PRESET["hf_vlm"], one))
    two = rl_overrides("hf_vlm", models, data, tmp_path / "two", **opts)
    torchrun_vltrain(["train", str(PRESET["hf_vlm"]), *two], tmp_path)
    two_summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    keys = ("loss", "train_reward_mean", "train_kl", "train_baseline", "train_entropy")
    a = {r["step"]: [r[k] for k in keys] for r in _rows(tmp_path / "one") if "loss" in r}
    b = {r["step"]: [r[k] for k in keys] for r in _rows(tmp_path / "two") if "loss" in r}
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=2e-5)
    for k, v in one_summary["val"].items():
        assert abs(v - two_summary["val"][k]) < 1e-4, k
    w1, w2 = _weights(tmp_path / "one", 3), _weights(tmp_path / "two", 3)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 3e-5
    assert a[1] != a[3]  # control: training moved the policy (loss, KL, baseline)


@pytest.mark.parametrize(
    ("kind", "extra", "message"),
    [
        ("llava", {"model.init_from": ""}, "needs 'model.init_from'"),
        ("hf_vlm", {"data.image_size": 48}, "data.image_size"),
        ("hf_vlm", {"rl.baseline": "grpo", "rl.k": 1}, "needs 'rl.k' >= 2"),
        ("hf_vlm", {"model.lora_targets": "[nothing]"}, "match no Linear"),
    ],
)
def test_rl_config_mistakes_are_one_line_errors(
    kind: str,
    extra: dict,
    message: str,
    models: dict,  # noqa: F811
    data: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    from vltrain.config.core import ConfigError
    from vltrain.stages import check_config

    init = tmp_path / "no_run" if kind == "llava" else None
    cfg = load_config(
        PRESET[kind], rl_overrides(kind, models, data, tmp_path / "rl", init, **extra)
    )
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)
    assert not (tmp_path / "rl").exists()
