"""gpu_check's sft_rl_hf_vlm and sft_rl_llava rows: one SFT step and one RL step of the caption
stage's HF VLM kinds on a randomly initialised Qwen2-VL-2B-sized model, bf16 (nothing
downloaded).

- hf_vlm: ``Qwen2VLForConditionalGeneration`` with Qwen2-VL-2B's sizes (ViT 32 x 1280, merger,
  Qwen2-1.5B-sized language model: 28 x 1536, vocabulary 151,936), 448x448 images (256 visual
  tokens each);
- llava: ``LlavaForConditionalGeneration`` of a CLIP ViT-L/14-336 tower (576 visual tokens),
  the projector MLP and the same language model.

SFT step: `vltrain.models.hf_vlm.HFVLM`'s teacher-forced CE on 8 images x 64 caption tokens,
backward, AdamW step. RL step (REINFORCE as the rl stage's objective, with
`vltrain.objectives.reinforce` directly): K=4 samples per image for 2 images through the one
decoder loop over `HFVLMTarget` (32 new tokens, temperature 1), a toy reward (distinct tokens per
sampled token), group-normalised advantages (``grpo``), the teacher-forced log-probs of the
samples, the REINFORCE loss, backward, AdamW step. Reported: median seconds of each step (after
one warm-up step) and peak memory. On the CPU a tiny model of each kind runs the same code (the
numbers are then not GPU numbers).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

K = 4  # samples per image (RL)
QWEN_IDS = {"image_token_id": 151655, "vision_start_token_id": 151652}
QWEN_IDS |= {"vision_end_token_id": 151653, "video_token_id": 151656}
CPU_SHIFT = 151000  # the CPU's tiny models: a 1,000-token vocabulary, the same ids less this


def _ids(cuda: bool) -> dict[str, int]:
    return QWEN_IDS if cuda else {k: v - CPU_SHIFT for k, v in QWEN_IDS.items()}


def _sizes(cuda: bool) -> dict[str, Any]:
    """Step shapes and the language model's config (Qwen2-1.5B-sized on CUDA, tiny on the CPU)."""
    if cuda:
        text = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
        text |= dict(num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)
        text |= dict(rope_theta=1e6)
        return dict(text=text, mrope=[16, 24, 24], sft_batch=8, rl_images=2, new=32, caption=64)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    text |= dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    return dict(text=text, mrope=[2, 3, 3], sft_batch=2, rl_images=1, new=6, caption=8)


def build(kind: str, cuda: bool, device: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(bf16 model on ``device``, the shapes of its image inputs) for kind hf_vlm or llava."""
    s = _sizes(cuda)
    text = {**s["text"], "eos_token_id": 0, "pad_token_id": 0}
    if kind == "hf_vlm":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6}
        text["rope_parameters"]["mrope_section"] = s["mrope"]
        vision = dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16)
        if not cuda:
            vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2)
        vision |= dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        cfg = Qwen2VLConfig(text_config=text, vision_config=vision, **_ids(cuda))
        side = 448 if cuda else 56
        shape = {"grid": side // 14, "tokens": (side // 28) ** 2}
        with torch.device(device):
            model = Qwen2VLForConditionalGeneration(cfg)
    else:
        from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

        vision = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24)
        vision |= dict(num_attention_heads=16, image_size=336, patch_size=14)
        if not cuda:
            vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
            vision |= dict(num_attention_heads=2, image_size=56, patch_size=14)
        text["model_type"] = "qwen2"
        cfg = LlavaConfig(
            vision_config=CLIPVisionConfig(**vision),
            text_config=text,
            image_token_index=_ids(cuda)["image_token_id"],
        )
        side = vision["image_size"]
        shape = {"side": side, "tokens": (side // 14) ** 2}
        with torch.device(device):
            model = LlavaForConditionalGeneration(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 0, 0
    return model.to(torch.bfloat16), shape


def image_batch(kind: str, shape: dict, n: int, device: str) -> tuple[dict, list[int]]:
    """Random image inputs of ``n`` images and one prompt's ids (the image's placeholders)."""
    t, ids = shape["tokens"], _ids(device.startswith("cuda"))
    if kind == "hf_vlm":
        g = shape["grid"]
        pixels = torch.randn(n * g * g, 3 * 2 * 14 * 14, device=device, dtype=torch.bfloat16)
        grid = torch.tensor([[1, g, g]] * n, device=device)
        images = {"pixel_values": pixels, "image_grid_thw": grid}
        prompt = [ids["vision_start_token_id"], *[ids["image_token_id"]] * t]
        prompt += [ids["vision_end_token_id"], 11, 12, 13]
    else:
        side = shape["side"]
        images = {"pixel_values": torch.randn(n, 3, side, side, device=device).bfloat16()}
        prompt = [1, *[ids["image_token_id"]] * t, 11, 12, 13]
    return images, prompt


def _timed(step, sync, n: int = 3) -> float:
    times = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def run(kind: str, device: str) -> dict[str, Any]:
    """SFT and RL step seconds and peak GiB (None off CUDA) of ``kind`` (module doc)."""
    from vltrain.inference.decoding import generate
    from vltrain.inference.vlm_target import HFVLMTarget
    from vltrain.models.hf_vlm import HFVLM
    from vltrain.objectives import reinforce

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    s = _sizes(cuda)
    base, shape = build(kind, cuda, device)
    model = HFVLM(base, kind)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    vocab = base.config.get_text_config(decoder=True).vocab_size
    out: dict[str, Any] = {"kind": kind, "params_b": sum(p.numel() for p in model.parameters())}
    out["params_b"] /= 1e9
    out["visual_tokens"] = shape["tokens"]

    b = s["sft_batch"]
    images, prompt = image_batch(kind, shape, b, device)
    caption = torch.randint(20, 150000 if cuda else 600, (b, s["caption"]), device=device)
    ids = torch.cat([torch.tensor([prompt] * b, device=device), caption], 1)  # (B, T)
    labels = ids.clone()
    labels[:, : len(prompt)] = -100
    mask = torch.ones_like(ids)
    sft: dict[str, float] = {}

    def sft_step() -> None:
        loss = model(images, ids, mask, labels)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sft["loss"] = float(loss)

    _reset(cuda)
    out["sft_s"] = _timed(sft_step, sync)
    out["sft_gib"] = _peak(cuda)
    out["sft_loss"] = sft["loss"]

    n = s["rl_images"] * K  # every image K times: K samples each
    images, prompt = image_batch(kind, shape, n, device)
    p_ids = torch.tensor([prompt] * n, device=device)
    p_mask = torch.ones_like(p_ids)
    baseline = reinforce.build_baseline("grpo")
    rl: dict[str, Any] = {}

    def rl_step() -> None:
        model.eval()
        target = HFVLMTarget(base, eos_token_id=0)
        inputs = model.model_inputs(images, p_ids, p_mask)
        gen = generate(target, dict(inputs), "sample", max_new_tokens=s["new"])
        model.train()
        seqs, lengths = gen.sequences.to(device), gen.lengths.to(device)  # (N, L), (N,)
        seq_mask = reinforce.sequence_mask(lengths, seqs.shape[1])
        full = torch.cat([p_ids, seqs], 1)
        full_mask = torch.cat([p_mask, seq_mask.long()], 1)
        logits = base(**model.model_inputs(images, full, full_mask), use_cache=False).logits
        logits = logits[:, p_ids.shape[1] - 1 : -1]  # (N, L, V): row t drew token t
        terms = reinforce.policy_terms(logits, None, seqs, seq_mask)
        rows = zip(seqs.tolist(), lengths.tolist(), strict=True)
        distinct = torch.tensor([len(set(r[:k])) for r, k in rows])  # (N,)
        rewards = distinct.float().to(device) / lengths.clamp(min=1).float()  # (N,)
        adv = reinforce.advantages(rewards, K, baseline)
        loss, _ = reinforce.reinforce_loss(terms, adv, lengths=lengths)
        loss.backward()
        rl["no_grad"] = sum(1 for p in model.parameters() if p.requires_grad and p.grad is None)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rl["tokens"] = int(lengths.sum())

    _reset(cuda)
    out["rl_s"] = _timed(rl_step, sync)
    out["rl_gib"] = _peak(cuda)
    out |= {"rl_tokens": rl["tokens"], "rl_no_grad": rl["no_grad"], "rl_rows": n}
    out["vocab"] = vocab
    return out


def _reset(cuda: bool) -> None:
    if cuda:
        torch.cuda.reset_peak_memory_stats()


def _peak(cuda: bool) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if cuda else None


def row(r: dict[str, Any]) -> tuple[str, str]:
    """gpu_check's (status, result) for `run`'s dict: FAILED on a non-finite SFT loss or a
    trainable tensor the RL step left without a gradient."""

    def gib(x: float | None) -> str:
        return "n/a on the CPU" if x is None else f"{x:.1f} GiB"

    ok = r["rl_no_grad"] == 0 and bool(torch.isfinite(torch.tensor(r["sft_loss"])))
    missing = f", {r['rl_no_grad']} trainable tensors without a grad" if r["rl_no_grad"] else ""
    return ("ok" if ok else "FAILED"), (
        f"{r['kind']}: {r['params_b']:.3g} B params bf16, {r['visual_tokens']} visual tokens an "
        f"image; SFT step (AdamW): loss {r['sft_loss']:.2f}, {r['sft_s']:.2f} s/step, peak "
        f"{gib(r['sft_gib'])}; RL step ({r['rl_rows'] // K} images x K={K} samples, "
        f"{r['rl_tokens']} sampled tokens, REINFORCE grpo): {r['rl_s']:.2f} s/step, peak "
        f"{gib(r['rl_gib'])}{missing}"
    )
