"""HF backbones of the contrastive stage under DDP: 2 processes equal 1 with the same global batch.

Each case trains a tiny random HF model (built from a config, saved to a local dir) for a few
fp32 steps (no dropout), once in this process with the global batch and once under
``python -m torch.distributed.run --standalone --nproc_per_node=2`` (gloo) with half of it per
rank, then compares the per-step losses and the final checkpoint:

- hf_clip: GradCache + hard negatives, 2 accumulation micro-steps (``no_sync``), sharded eval;
- hf_siglip: the sigmoid loss through the DDP-wrapped forward, hard negatives;
- vlm, tiny Qwen2-VL (``mm_token_type_ids``, token budget): LoRA + GradCache + hard negatives,
  Matryoshka eval;
- vlm, tiny LLaVA reading vision layer -2 (LLaVA-1.5's default), plain DDP forward: the
  regression test for trainable-but-unused vision parameters (DDP refuses those).

The 2-process runs go through a launcher that logs every ``save_pretrained`` call, so each case
also checks that the HF-loadable export is written once per checkpoint, by rank 0, and that it
loads back with the trained weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import hardlink_tree, tiny_overrides
from tests.models.test_hf_embedders import (  # noqa: F401  (fixtures)
    _samples,
    clip_dir,
    qwen2vl_dir,
    siglip_dir,
    tiny_llava,
)
from vltrain.config import load_config
from vltrain.data.hf_collate import HFCollate
from vltrain.models.hf_embedders import VLMEmbedder
from vltrain.objectives.contrastive import InfoNCELoss
from vltrain.runs import train
from vltrain.tools.loading import load_trained

PRESETS = Path(__file__).resolve().parents[2] / "vltrain" / "configs"
STEPS = 3
LOSS_TOL = 2e-5  # per-step loss, 1 vs 2 processes (measured <= 2e-6)
PARAM_TOL = 3e-5  # final parameters, 1 vs 2 processes (measured <= 3e-6)
MOVED = 1e-4  # training (or a control) must move some parameter by more than this

# Runs `vltrain` like `python -m vltrain`, logging each HF export (rank, folder) to a JSONL file.
LAUNCHER = """
import json, os, sys
from vltrain.models.hf_embedders import _HFEmbedder

_save = _HFEmbedder.save_pretrained


def _logged(self, out_dir, merge_lora=True):
    with open(os.environ["VLTRAIN_TEST_SAVE_LOG"], "a") as f:
        f.write(json.dumps({"rank": int(os.environ["RANK"]), "dir": str(out_dir)}) + "\\n")
    return _save(self, out_dir, merge_lora)


_HFEmbedder.save_pretrained = _logged
from vltrain.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Tiny LLaVA whose projector reads vision layer -2 (of 2): like LLaVA-1.5."""
    return tiny_llava(tmp_path_factory.mktemp("llava2"), vision_layers=2, feature_layer=-2)


@pytest.fixture(scope="module")
def small_eval(
    shapes_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    clip_dir: str,  # noqa: F811 (fixture)
) -> Path:
    """8 val records whose texts and hard negatives all differ within their first 14 tokens.

    The toy tokenizer cuts many shapes captions to the same ids; such texts tie exactly, and
    their order (hence R@k, ranks, hard-negative accuracy) would hinge on float noise that
    depends on how each rank's eval batch is padded. 8 records also keep VLM eval short.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(clip_dir, local_files_only=True)
    seen: set[tuple[int, ...]] = set()

    def fresh(text: str) -> bool:
        key = tuple(tok(text, add_special_tokens=False)["input_ids"][:14])
        if key in seen:
            return False
        seen.add(key)
        return True

    records = []
    for line in (shapes_dir / "val.jsonl").read_text().splitlines():
        r = json.loads(line)
        r["text"] = [t for t in r["text"] if fresh(t)]
        r.pop("caption_negatives", None)  # one list per caption: no longer aligned
        r["negatives"] = [t for t in r["negatives"] if fresh(t)]
        if r["text"] and len(records) < 8:
            records.append(r)
    out = tmp_path_factory.mktemp("small_eval")
    hardlink_tree(shapes_dir / "images", out / "images")
    (out / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert len(records) == 8 and sum(len(r["negatives"]) for r in records) >= 8
    return out / "val.jsonl"


# ---- running ----------------------------------------------------------------------------------


def _overrides(data: Path, out: Path, extra: dict[str, object]) -> list[str]:
    base = {
        "data.eval": "",
        "train.max_steps": STEPS,
        "train.save_every": STEPS,
        "optim.warmup_steps": 0,
        "optim.lr": 1e-3,
        "run.precision": "fp32",
        "run.threads": 1,
    }
    over = tiny_overrides(data, out, **{**base, **extra})
    return [o for o in over if not o.startswith("data.tokenizer_vocab=")]  # HF: own tokenizer


def _one_process(preset: str, data: Path, out: Path, extra: dict[str, object]) -> dict:
    """Train in this process; the final checkpoint's tensors."""
    threads = torch.get_num_threads()
    try:
        train(load_config(PRESETS / preset, _overrides(data, out, extra)))
    finally:
        torch.set_num_threads(threads)
    return load_file(out / "checkpoints" / f"step_{STEPS}" / "model.safetensors")


def _two_processes(preset: str, data: Path, out: Path, extra: dict[str, object]) -> dict:
    """Train under torch.distributed.run with 2 gloo ranks; the final checkpoint's tensors."""
    out.parent.mkdir(parents=True, exist_ok=True)
    launcher = out.parent / f"{out.name}_launch.py"
    launcher.write_text(LAUNCHER)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port and a local rendezvous (--master_port=0 hangs here)
        "--nproc_per_node=2",
        str(launcher),
        "train",
        str(PRESETS / preset),
        *_overrides(data, out, extra),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "VLTRAIN_TEST_SAVE_LOG": str(out.parent / f"{out.name}_saves.jsonl"),
    }
    res = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return load_file(out / "checkpoints" / f"step_{STEPS}" / "model.safetensors")


# ---- checks -----------------------------------------------------------------------------------


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_same_run(one: Path, two: Path, a: dict, b: dict) -> None:
    """Same per-step losses and final parameters; evaluation metrics too when there are any."""
    loss_one = [r["loss"] for r in _rows(one) if "loss" in r]
    loss_two = [r["loss"] for r in _rows(two) if "loss" in r]
    assert len(loss_one) == len(loss_two) == STEPS
    assert loss_one == pytest.approx(loss_two, rel=0, abs=LOSS_TOL)
    assert _max_diff(a, b) < PARAM_TOL
    eval_one = [r for r in _rows(one) if any(k.startswith("eval_") for k in r)]
    eval_two = [r for r in _rows(two) if any(k.startswith("eval_") for k in r)]
    assert len(eval_one) == len(eval_two)
    for r1, r2 in zip(eval_one, eval_two, strict=True):
        assert r1.keys() == r2.keys()
        for k in r1:
            assert r1[k] == pytest.approx(r2[k], rel=0, abs=1e-4), k


def _hf_export(out: Path) -> Path:
    """The final checkpoint's HF export, after checking it was written once, by rank 0."""
    log = out.parent / f"{out.name}_saves.jsonl"
    saves = [json.loads(x) for x in log.read_text().splitlines()]
    assert len(saves) == 1 and saves[0]["rank"] == 0, saves
    assert Path(saves[0]["dir"]).name == "hf_model"
    ckpts = out / "checkpoints"
    assert not [p.name for p in ckpts.iterdir() if p.name.startswith(".")]  # no temp leftovers
    hf = ckpts / f"step_{STEPS}" / "hf_model"
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()
    return hf


LOSS_OWNED = ("logit_scale", "logit_bias")


def _assert_export_holds(ckpt: dict, hf_model: torch.nn.Module, prefix: str) -> None:
    """Every exported weight is the checkpoint's `prefix`-named tensor, bit for bit; the
    temperature (and SigLIP bias) are the trained loss's, which owns them during training."""
    exported = hf_model.state_dict()
    shared = [k for k in exported if prefix + k in ckpt]
    params = {n for n, _ in hf_model.named_parameters()}
    assert params <= set(shared), sorted(params - set(shared))[:5]
    for k in shared:
        want = ckpt.get(f"loss.{k}", ckpt[prefix + k]) if k in LOSS_OWNED else ckpt[prefix + k]
        assert torch.equal(exported[k], want.reshape(exported[k].shape)), k


# ---- cases ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_hf_clip_grad_cache_hard_negatives_two_processes_equal_one(
    shapes_dir: Path,
    tmp_path: Path,
    small_eval: Path,
    clip_dir: str,  # noqa: F811 (fixture)
) -> None:
    from transformers import CLIPModel

    opts = {
        "model.path": clip_dir,
        "data.max_text_len": 16,  # 14 tokens + BOS/EOS: small_eval's texts stay distinct
        "data.eval": small_eval,
        "objective.hard_negatives": 2,
        "optim.accum_steps": 2,
    }
    cached = {"objective.grad_cache_chunk": 3}
    # reference: one process, the global batch, no GradCache
    one = _one_process("hf_clip.yaml", shapes_dir, tmp_path / "one", {**opts, "data.batch_size": 8})
    two = _two_processes(
        "hf_clip.yaml", shapes_dir, tmp_path / "two", {**opts, **cached, "data.batch_size": 4}
    )
    _assert_same_run(tmp_path / "one", tmp_path / "two", one, two)
    # controls: training moved the weights; one rank alone (its half batch) goes elsewhere
    init = CLIPModel.from_pretrained(clip_dir, local_files_only=True).state_dict()
    moved = max(float((one["encoder.model." + k] - v).abs().max()) for k, v in init.items())
    assert moved > MOVED
    alone = _one_process(
        "hf_clip.yaml",
        shapes_dir,
        tmp_path / "alone",
        {**opts, **cached, "data.batch_size": 4, "data.eval": ""},
    )
    assert _max_diff(one, alone) > MOVED
    exported = CLIPModel.from_pretrained(_hf_export(tmp_path / "two"), local_files_only=True)
    _assert_export_holds(two, exported, "encoder.model.")


@pytest.mark.slow
def test_hf_siglip_sigmoid_loss_two_processes_equal_one(
    shapes_dir: Path,
    tmp_path: Path,
    siglip_dir: str,  # noqa: F811 (fixture)
) -> None:
    from transformers import SiglipModel

    opts = {
        "model.path": siglip_dir,
        "data.max_text_len": 16,
        "objective.hard_negatives": 2,
        "optim.accum_steps": 2,
    }
    one = _one_process(
        "hf_siglip.yaml", shapes_dir, tmp_path / "one", {**opts, "data.batch_size": 8}
    )
    two = _two_processes(
        "hf_siglip.yaml", shapes_dir, tmp_path / "two", {**opts, "data.batch_size": 4}
    )
    _assert_same_run(tmp_path / "one", tmp_path / "two", one, two)
    assert "loss.logit_bias" in one  # the sigmoid loss (with its learned bias) was trained
    init = SiglipModel.from_pretrained(siglip_dir, local_files_only=True).state_dict()
    moved = max(float((one["encoder.model." + k] - v).abs().max()) for k, v in init.items())
    assert moved > MOVED
    exported = SiglipModel.from_pretrained(_hf_export(tmp_path / "two"), local_files_only=True)
    _assert_export_holds(two, exported, "encoder.model.")


@pytest.mark.slow
def test_vlm_lora_grad_cache_two_processes_equal_one(
    shapes_dir: Path,
    tmp_path: Path,
    small_eval: Path,
    qwen2vl_dir: str,  # noqa: F811 (fixture)
) -> None:
    from transformers import AutoModelForImageTextToText

    opts = {
        "model.path": qwen2vl_dir,
        "model.lora_r": 4,
        "model.lora_alpha": 8,
        "model.matryoshka_dims": "[8]",
        "data.max_text_len": 24,
        "data.max_visual_tokens": 4,
        "data.num_workers": 0,
        "data.eval": small_eval,
        "objective.hard_negatives": 2,
    }
    # reference: one process, the global batch, no GradCache
    one = _one_process(
        "vlm_embed.yaml",
        shapes_dir,
        tmp_path / "one",
        {**opts, "data.batch_size": 8, "objective.grad_cache_chunk": 0},
    )
    two = _two_processes(
        "vlm_embed.yaml",
        shapes_dir,
        tmp_path / "two",
        {**opts, "data.batch_size": 4, "objective.grad_cache_chunk": 3},
    )
    _assert_same_run(tmp_path / "one", tmp_path / "two", one, two)
    assert "eval_d8_i2t_R@1" in _rows(tmp_path / "two")[-1]
    lora_b = [k for k in one if "lora_B" in k]
    assert lora_b and max(float(one[k].abs().max()) for k in lora_b) > MOVED  # B starts at 0
    # the export is a plain transformers model with the adapters merged in
    hf = _hf_export(tmp_path / "two")
    assert not (hf / "adapter_config.json").exists()
    plain = AutoModelForImageTextToText.from_pretrained(hf, local_files_only=True)
    assert type(plain).__name__ == "Qwen2VLForConditionalGeneration"
    _, _, trained = load_trained(tmp_path / "two")
    batch = HFCollate(hf, "vlm", max_visual_tokens=4)(_samples(3))
    with torch.no_grad():
        ref = trained.encoder.encode_image(batch["images"])
        back = VLMEmbedder(hf).eval().encode_image(batch["images"])
        base = VLMEmbedder(qwen2vl_dir).eval().encode_image(batch["images"])
    torch.testing.assert_close(back, ref, atol=1e-5, rtol=1e-5)
    assert float((base - ref).abs().max()) > MOVED  # control: the merge carried the adapters


# ---- LLaVA: trainable parameters the embedding never uses ------------------------------------


def _unused_trainable(emb: VLMEmbedder) -> list[str]:
    batch = HFCollate(emb.path, "vlm")(_samples(2))
    img, txt = emb(batch["images"], batch["input_ids"], batch["attention_mask"])
    InfoNCELoss(gather=False)(img, txt)[0].backward()
    return [n for n, p in emb.named_parameters() if p.requires_grad and p.grad is None]


def test_llava_freezes_vision_parameters_it_never_uses(llava_dir: str) -> None:
    """LLaVA reads vision layer -2: the last vision layer and post_layernorm get no gradient, so
    they must not be trainable (DDP without find_unused_parameters fails on them)."""
    full = VLMEmbedder(llava_dir)
    assert not _unused_trainable(full)
    frozen = {n for n, p in full.named_parameters() if not p.requires_grad}
    assert any(".vision_tower.encoder.layers.1." in n for n in frozen)
    assert any(".vision_tower.post_layernorm." in n for n in frozen)
    assert not any(".vision_tower.encoder.layers.0." in n for n in frozen)  # still trains
    # LoRA also targets the vision tower's q/k/v projections: the dead layer's are frozen
    lora = VLMEmbedder(llava_dir, lora={"r": 4})
    assert not _unused_trainable(lora)
    names = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert any(".vision_tower.encoder.layers.0." in n for n in names)
    assert not any(".vision_tower.encoder.layers.1." in n for n in names)


@pytest.mark.slow
def test_llava_full_finetune_two_processes_equal_one(
    shapes_dir: Path, tmp_path: Path, llava_dir: str
) -> None:
    """Plain DDP forward (no GradCache): fails with unused parameters unless they are frozen."""
    from transformers import LlavaForConditionalGeneration

    opts = {
        "model.path": llava_dir,
        "model.lora_r": 0,
        "model.matryoshka_dims": "[]",
        "data.max_text_len": 24,
        "data.max_visual_tokens": 0,
        "data.num_workers": 0,
        "objective.grad_cache_chunk": 0,
        "objective.hard_negatives": 1,
    }
    one = _one_process(
        "vlm_embed.yaml", shapes_dir, tmp_path / "one", {**opts, "data.batch_size": 4}
    )
    two = _two_processes(
        "vlm_embed.yaml", shapes_dir, tmp_path / "two", {**opts, "data.batch_size": 2}
    )
    _assert_same_run(tmp_path / "one", tmp_path / "two", one, two)
    init = LlavaForConditionalGeneration.from_pretrained(llava_dir, local_files_only=True)
    init_sd = init.state_dict()
    moved = {k for k, v in init_sd.items() if not torch.equal(two["encoder.model." + k], v)}
    assert any(".vision_tower.encoder.layers.0." in k for k in moved)
    assert not any(".vision_tower.encoder.layers.1." in k for k in moved)  # frozen: unused
    exported = LlavaForConditionalGeneration.from_pretrained(
        _hf_export(tmp_path / "two"), local_files_only=True
    )
    _assert_export_holds(two, exported, "encoder.model.")
