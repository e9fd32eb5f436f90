"""HF backbones through the contrastive stage: train, evaluate, export an HF-loadable dir."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import tiny_overrides
from tests.models.test_hf_embedders import clip_dir, qwen2vl_dir  # noqa: F401  (fixtures)
from vltrain.config import load_config
from vltrain.runs import train


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_hf_clip_trains_from_a_local_dir_and_exports_save_pretrained(
    shapes_dir: Path,
    tmp_path: Path,
    clip_dir: str,  # noqa: F811 (fixture)
) -> None:
    from transformers import CLIPModel

    run = tmp_path / "run"
    cfg = load_config(
        None,
        tiny_overrides(
            shapes_dir,
            run,
            **{
                "model.kind": "hf_clip",
                "model.path": clip_dir,
                "train.max_steps": 3,
                "data.batch_size": 8,
                "optim.lr": 1e-3,
                "optim.warmup_steps": 0,
            },
        ),
    )
    summary = train(cfg)
    assert 0.0 <= summary["val"]["eval_i2t_R@1"] <= 1.0
    ckpt = run / "checkpoints" / "step_3"
    assert not (run / "tokenizer").exists()  # HF backbones bring their own tokenizer
    exported = CLIPModel.from_pretrained(ckpt / "hf_model", local_files_only=True)
    from safetensors.torch import load_file

    ours = load_file(ckpt / "model.safetensors")
    key = next(k for k in ours if k.endswith("text_projection.weight"))
    assert torch.equal(ours[key], exported.text_projection.weight)
    original = CLIPModel.from_pretrained(clip_dir, local_files_only=True)
    assert not torch.equal(original.text_projection.weight, exported.text_projection.weight)
    # The loss owns the temperature during training; the export carries its trained value.
    assert float(ours["loss.logit_scale"]) != original.logit_scale.item()
    assert exported.logit_scale.item() == float(ours["loss.logit_scale"])


def test_vlm_embedder_with_lora_token_budget_and_matryoshka(
    shapes_dir: Path,
    tmp_path: Path,
    qwen2vl_dir: str,  # noqa: F811 (fixture)
) -> None:
    run = tmp_path / "run"
    cfg = load_config(
        None,
        tiny_overrides(
            shapes_dir,
            run,
            **{
                "model.kind": "vlm",
                "model.path": qwen2vl_dir,
                "model.lora_r": 4,
                "model.matryoshka_dims": "[8]",
                "data.max_visual_tokens": 4,
                "train.max_steps": 2,
                "data.batch_size": 4,
                "optim.warmup_steps": 0,
                "data.max_text_len": 24,
            },
        ),
    )
    summary = train(cfg)
    rows = _rows(run)
    train_rows = [r for r in rows if "loss" in r]
    assert all(r["train_visual_tokens_max"] <= 4 for r in train_rows)
    assert "eval_d8_i2t_R@1" in summary["val"]
    assert (run / "checkpoints" / "step_2" / "hf_model" / "config.json").is_file()


def test_vlm_grad_cache_equals_the_uncached_step(
    shapes_dir: Path,
    tmp_path: Path,
    qwen2vl_dir: str,  # noqa: F811 (fixture)
) -> None:
    """Qwen-VL inputs (flattened patches) are chunked per image; GradCache = full batch."""
    from safetensors.torch import load_file

    def run(name: str, chunk: int) -> dict:
        out = tmp_path / name
        train(
            load_config(
                None,
                tiny_overrides(
                    shapes_dir,
                    out,
                    **{
                        "model.kind": "vlm",
                        "model.path": qwen2vl_dir,
                        "train.max_steps": 2,
                        "data.batch_size": 4,
                        "optim.warmup_steps": 0,
                        "optim.lr": 1e-3,
                        "data.max_text_len": 24,
                        "data.max_visual_tokens": 4,
                        "objective.hard_negatives": 2,
                        "objective.grad_cache_chunk": chunk,
                        "train.save_every": 2,
                        "data.eval": "",
                    },
                ),
            )
        )
        return load_file(out / "checkpoints" / "step_2" / "model.safetensors")

    full, cached = run("full", 0), run("cached", 2)
    assert full.keys() == cached.keys()
    diff = max(float((full[k] - cached[k]).abs().max()) for k in full)
    assert diff < 1e-5
