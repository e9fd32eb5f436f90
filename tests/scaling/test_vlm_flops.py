"""Analytic FLOPs of HF VLM backbones (vltrain.scaling.vlm_flops) against
torch.utils.flop_counter on tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL / LLaVA models built
from configs, saved and loaded back by path like a user's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.models.test_hf_embedders import (  # noqa: E402
    _qwen_ids,
    _samples,
    _save,
    _tokenizer,
    qwen2vl_dir,  # noqa: F401  (a fixture)
    tiny_llava,
)
from vltrain.data.hf_collate import HFCollate  # noqa: E402
from vltrain.models.hf_embedders import VLMEmbedder  # noqa: E402
from vltrain.scaling import flops, vlm_flops  # noqa: E402

LORA = {"r": 4, "alpha": 8, "dropout": 0.0}


def _measure(emb: VLMEmbedder, path: str) -> tuple[vlm_flops.ModelFlops, int, int, tuple | None]:
    """(analytic count at the batch's real lengths, measured forward, measured fwd + bwd, the
    patch grid) for one sample (no padding: every count is at the real length)."""
    grid_vlm = vlm_flops.hf_model(emb).config.model_type != "llava"
    batch = HFCollate(path, "vlm", max_visual_tokens=16 if grid_vlm else None)(_samples(1))
    imgs = batch["images"]
    grid = tuple(imgs["image_grid_thw"][0].tolist()) if "image_grid_thw" in imgs else None
    acct = vlm_flops.hf_vlm_flops(
        emb, int(imgs["attention_mask"].sum()), int(batch["attention_mask"].sum()), grid
    )

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        return emb(imgs, batch["input_ids"], batch["attention_mask"])

    def step() -> None:
        a, b = forward()
        (a * b).sum().backward()

    return acct, flops.measure_flops(forward)["total"], flops.measure_flops(step)["total"], grid


def _attention_forward(emb: VLMEmbedder, acct: vlm_flops.ModelFlops) -> float:
    """Attention-score FLOPs of the forward, from the lengths alone (an independent count)."""
    hf = vlm_flops.hf_model(emb)
    lm = hf.config.get_text_config()
    inner = lm.num_attention_heads * getattr(
        lm, "head_dim", lm.hidden_size // lm.num_attention_heads
    )
    image_seq = acct.components[2].tokens - acct.text_tokens
    total = lm.num_hidden_layers * 4 * inner * (image_seq**2 + acct.text_tokens**2)
    return float(total)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_qwen2vl_matches_flop_counter(qwen2vl_dir: str, lora: dict | None) -> None:  # noqa: F811
    emb = VLMEmbedder(qwen2vl_dir, lora=lora)
    acct, fwd, both, grid = _measure(emb, qwen2vl_dir)
    assert acct.forward == fwd  # every matmul, at the real patch count and lengths
    assert acct.per_sample == pytest.approx(both, rel=0.05)
    # what is left is exactly the flash kernel's recomputation of the scores in backward
    # (0.5 x attention forward, not counted by convention) -- vision attention included
    # only when the tower trains
    vc = vlm_flops.hf_model(emb).config.vision_config
    vision_attn = 4 * acct.components[0].tokens ** 2 * vc.embed_dim * vc.depth
    recompute = 0.5 * (_attention_forward(emb, acct) + (0 if lora else vision_attn))
    assert both - acct.per_sample == pytest.approx(recompute, rel=1e-6)
    if lora:  # LoRA: the vision tower and merger are frozen upstream -> forward-only
        assert acct.components[0].backward == acct.components[1].backward == 0
        # negative control: the component rule (2x for anything that trains) misses by >5%
        naive = acct.forward + sum(2 * c.forward for c in acct.components if c.trainable)
        assert abs(naive / both - 1) > 0.05
        assert acct.trainable_nonembed_params < acct.nonembed_params


def test_frozen_vision_tower_is_forward_only(qwen2vl_dir: str) -> None:  # noqa: F811
    emb = VLMEmbedder(qwen2vl_dir)
    vlm_flops.hf_model(emb).model.visual.blocks.requires_grad_(False)
    vlm_flops.hf_model(emb).model.visual.patch_embed.requires_grad_(False)
    acct, _, both, _ = _measure(emb, qwen2vl_dir)
    assert acct.components[0].backward == 0 and not acct.components[0].trainable
    assert acct.per_sample == pytest.approx(both, rel=0.05)
    # negative control: counting the frozen tower as trained misses the measurement
    assert abs((acct.per_sample + 2 * acct.components[0].forward) / both - 1) > 0.05


def test_llava_reads_its_feature_layer(tmp_path: Path) -> None:
    """LLaVA-1.5 style (projector reads vision layer -2): the last vision block runs forward
    only; the class token is in the tower, not in the LM."""
    path = tiny_llava(tmp_path / "llava", vision_layers=2, feature_layer=-2)
    emb = VLMEmbedder(path)
    acct, fwd, both, grid = _measure(emb, path)
    assert acct.forward == fwd
    assert acct.per_sample == pytest.approx(both, rel=0.05)
    vc = vlm_flops.hf_model(emb).config.vision_config
    assert acct.components[0].tokens == (vc.image_size // vc.patch_size) ** 2 + 1
    assert acct.image_tokens == (vc.image_size // vc.patch_size) ** 2


def _newer(family: str, tmp_path: Path) -> str:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = _tokenizer("<|vision_start|><|image_pad|><|vision_end|>")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    text = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        out_hidden_size=32,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    if family == "qwen2_5_vl":  # 2x2-unit windows in block 1, full attention in block 0
        cls = transformers.Qwen2_5_VLForConditionalGeneration
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config={**vision, "window_size": 16, "fullatt_block_indexes": [0]},
            **_qwen_ids(tok),
        )
    else:
        cls = transformers.Qwen3VLForConditionalGeneration
        text["rope_parameters"] = {**rope, "mrope_interleaved": True}
        cfg = transformers.Qwen3VLConfig(
            text_config={**text, "head_dim": 16},
            vision_config={
                **vision,
                "num_position_embeddings": 64,
                "deepstack_visual_indexes": [0],
            },
            **_qwen_ids(tok),
        )
    torch.manual_seed(0)
    ip = Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=4096
    )
    return _save(cls(cfg), tok, ip, tmp_path)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_newer_qwen_families_match_flop_counter(family: str, tmp_path: Path) -> None:
    path = _newer(family, tmp_path)
    emb = VLMEmbedder(path, lora=LORA)
    acct, fwd, both, grid = _measure(emb, path)
    assert acct.forward == fwd  # windows (2.5) and deepstack mergers (3) included
    if family == "qwen2_5_vl":  # the sample really is cut into several windows
        _, h, w = grid
        assert len(vlm_flops.window_lengths(h, w, 2, 2)) > 1
    assert acct.per_sample == pytest.approx(both, rel=0.05)


def test_window_lengths_negative_control() -> None:
    """Windows tile the merged grid (partial ones at the edge); full attention would be one
    sequence of every patch, ~2x the score FLOPs here."""
    lengths = vlm_flops.window_lengths(12, 20, 2, 2)  # 6 x 10 merged units, 2 x 2 windows
    assert sum(lengths) == 12 * 20 and max(lengths) == 16 and len(lengths) == 15
    assert sum(n * n for n in lengths) < (12 * 20) ** 2 / 10


def test_config_flops_for_vlm_runs_sets_the_budget(
    shapes_dir: Path,
    tmp_path: Path,
    qwen2vl_dir: str,  # noqa: F811 (fixture)
) -> None:
    """`budget.config_flops(cfg)` for `model.kind: vlm` (meta-device model, the run's collate
    on its training records) equals flop_counter on the real model over the same samples, and
    `train.max_flops` becomes `train.max_steps`."""
    from tests.conftest import tiny_overrides
    from vltrain.config import load_config
    from vltrain.data.records import ImageTextDataset
    from vltrain.scaling import budget

    extra = {
        "model.kind": "vlm",
        "model.path": qwen2vl_dir,
        "model.lora_r": 4,
        "data.max_visual_tokens": 4,
        "data.batch_size": 4,
        "optim.warmup_steps": 0,
        "data.max_text_len": 24,
    }
    cfg = load_config(None, tiny_overrides(shapes_dir, tmp_path / "run", **extra))
    acct = vlm_flops.vlm_config_flops(cfg, max_samples=4)
    assert acct.components[0].backward == 0  # LoRA on the LM only: the tower is forward-only
    emb = VLMEmbedder(
        qwen2vl_dir,
        lora={
            "r": 4,
            "alpha": cfg.model.lora_alpha,
            "dropout": 0.0,
            "target_modules": list(cfg.model.lora_targets),
        },
    )
    collate = HFCollate(qwen2vl_dir, "vlm", 24, 4)
    data = ImageTextDataset(cfg.data.train, cfg.data.image_size, cfg.run.seed, native=True)
    measured = []
    for i in range(0, len(data), len(data) // 4)[:4]:
        s = data[(0, 0, i)]
        imgs, _ = collate.image_batch([s["image"]])
        ids, mask = collate.text_batch([s["text"]])

        def step(imgs=imgs, ids=ids, mask=mask) -> None:
            a, b = emb(imgs, ids, mask)
            (a * b).sum().backward()

        measured.append(flops.measure_flops(step)["total"])
    assert acct.per_sample == pytest.approx(sum(measured) / len(measured), rel=0.05)
    full = budget.config_flops(cfg)  # the default sample of the records
    assert full.per_sample == pytest.approx(acct.per_sample, rel=0.2)
    cfg = load_config(
        None,
        tiny_overrides(
            shapes_dir, tmp_path / "run", **extra, **{"train.max_flops": 40.5 * 4 * full.per_sample}
        ),
    )
    assert budget.resolve_budget(cfg).train.max_steps == 40
