"""gpu_check's embed_pages_qwen3vl2b row: the reference workload's training step (text query ->
page screenshot, 5 page hard negatives per query, GradCache, LoRA r16 as the
qwen3vl_embed_pages preset) on a randomly initialised Qwen3-VL-Embedding-2B-sized model, next
to the uncached step at the largest batch that fits.

vltrain's own path: `VLMEmbedder` (the architecture built from a config on the device, random
weights: nothing downloaded), `HFCollate` (chat prompts, the preset's instructions, pages
resized under the visual-token cap), `grad_cache` over query, page and negative chunks,
`InfoNCELoss(temperature=0.02, symmetric=False)` with the negatives as extra columns. On CUDA:
bf16 weights, 875x1024 pages capped at 1,280 visual tokens, batch 64; on the CPU a tiny model,
small pages and batch 4 run the same code (the numbers are then not GPU numbers).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

NEGATIVES = 5
MAX_VISUAL_TOKENS = 1280
TEMPERATURE = 0.02
LOSS_TOL_FP32 = 1e-5  # cached vs uncached loss at one batch, fp32 (the CPU's tiny model)
INSTRUCTION_QUERY = "Retrieve the page screenshot that answers the query. Query: "
INSTRUCTION_DOC = "Represent this page screenshot for retrieval."
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
SPECIALS += ["<|image_pad|>", "<|video_pad|>", "<unk>"]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = (
    "retrieve the page screenshot that answers query represent this for retrieval which table "
    "lists revenue of quarter figure shows growth rate chart compares results section describes "
    "method user assistant"
).split()

# Qwen3-VL-2B's published sizes (the embedding model shares the architecture); tiny on the CPU
SIZES: dict[str, dict[str, Any]] = {
    "cuda": {
        "text": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28)
        | dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936)
        | dict(rope_parameters={"rope_type": "default", "rope_theta": 5e6})
        | dict(max_position_embeddings=262144),
        "vision": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16)
        | dict(out_hidden_size=2048, patch_size=16, num_position_embeddings=2304)
        | dict(deepstack_visual_indexes=[5, 11, 17]),
        "mrope": [24, 20, 20],
        "page": (875, 1024),  # width x height
        "batch": 64,
        "chunk": 8,
        "dtype": torch.bfloat16,
    },
    "cpu": {
        "text": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, head_dim=16)
        | dict(num_attention_heads=2, num_key_value_heads=1, vocab_size=256)
        | dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "vision": dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2)
        | dict(out_hidden_size=32, patch_size=4, num_position_embeddings=64)
        | dict(deepstack_visual_indexes=[0]),
        "mrope": [2, 3, 3],
        "page": (35, 41),
        "batch": 4,
        "chunk": 2,
        "dtype": torch.float32,
    },
}


def model_dir(out: Path, size: dict[str, Any]) -> Path:
    """config.json, a word-level tokenizer with Qwen's chat markup and a Qwen2-VL image
    processor capped at MAX_VISUAL_TOKENS: what VLMEmbedder and HFCollate read (no weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    vocab = {w: i for i, w in enumerate([*SPECIALS, *dict.fromkeys(WORDS)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[1:7],
        chat_template=CHAT,
    )
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    text = size["text"] | dict(bos_token_id=None, eos_token_id=0, pad_token_id=0)
    text["rope_parameters"] = text["rope_parameters"] | dict(
        mrope_section=size["mrope"], mrope_interleaved=True
    )
    vision = size["vision"] | dict(spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=True,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    patch = vision["patch_size"]
    ip = Qwen2VLImageProcessorPil(
        patch_size=patch,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=4 * (2 * patch) ** 2,
        max_pixels=MAX_VISUAL_TOKENS * (2 * patch) ** 2,
    )
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    ip.save_pretrained(out)
    return out


def _pages(n: int, size: tuple[int, int], seed: int) -> list[Any]:
    """`n` white pages with dark text-like bars at random places."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    pages = []
    for _ in range(n):
        a = np.full((h, w, 3), 255, dtype=np.uint8)
        for _ in range(12):
            y, x = int(rng.integers(0, h - 2)), int(rng.integers(0, w // 2))
            a[y : y + max(2, h // 60), x : x + int(rng.integers(w // 8, w // 2))] = rng.integers(
                0, 120, 3
            )
        pages.append(Image.fromarray(a))
    return pages


def _embedder(path: Path, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vltrain.models.hf_embedders import VLMEmbedder

    class RandomVLM(VLMEmbedder):
        """The architecture of `path` with random weights, built on the device."""

        def _load(self, path: str, **kw: Any) -> torch.nn.Module:
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
            with torch.device(device):
                return AutoModelForImageTextToText.from_config(cfg, dtype=kw["dtype"])

    torch.manual_seed(0)
    emb = RandomVLM(
        path,
        instruction_query=INSTRUCTION_QUERY,
        instruction_doc=INSTRUCTION_DOC,
        lora={"r": 16, "alpha": 32},
        dtype=dtype,
    )
    return emb.to(device).train()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(step: Callable[[], float], device: str, repeats: int) -> tuple[float, float]:
    """(loss, median seconds of `repeats` steps after one warm-up)."""
    step()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return loss, statistics.median(times)


def _peak(device: str) -> float | None:
    """Peak GiB allocated since the last reset (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    return torch.cuda.max_memory_allocated() / 2**30


def _reset(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run(work: Path, device: str, repeats: int = 2) -> dict[str, Any]:
    """Both steps; a dict of what the row reports."""
    from vltrain.data.batches import split_rows
    from vltrain.data.hf_collate import HFCollate, move_to
    from vltrain.objectives.contrastive import InfoNCELoss
    from vltrain.objectives.grad_cache import grad_cache

    size = SIZES["cuda" if device.startswith("cuda") else "cpu"]
    if not device.startswith("cuda"):
        torch.set_num_threads(1)  # tiny ops: threads only contend (20 ms per op under load)
    path = model_dir(work / "qwen3vl_embed_2b_random", size)
    emb = _embedder(path, device, size["dtype"])
    b, chunk = size["batch"], size["chunk"]
    collate = HFCollate(path, "vlm", 128, MAX_VISUAL_TOKENS, INSTRUCTION_QUERY, INSTRUCTION_DOC)
    queries = [" ".join(np.random.default_rng(i).choice(WORDS, 12)) for i in range(b)]
    q_in = move_to(collate.text_batch(queries, role="query"), device)
    d_in, counts = collate.image_batch(_pages(b, size["page"], 0), role="doc")
    # query i's negatives are rows i*K .. i*K+K-1
    n_in, _ = collate.image_batch(_pages(b * NEGATIVES, size["page"], 1), role="doc")
    d_in, n_in = move_to(d_in, device), move_to(n_in, device)
    loss_fn = InfoNCELoss(
        temperature=TEMPERATURE, learn_temperature=False, symmetric=False, gather=False
    )
    encoders = [lambda ids, mask: emb.encode_text(ids, mask), emb.encode_image, emb.encode_image]

    def cached() -> float:
        emb.zero_grad(set_to_none=True)
        sides = [split_rows(x, chunk) for x in (q_in, d_in, n_in)]
        loss, _ = grad_cache(encoders, sides, lambda e: loss_fn(e[0], e[1], e[2]))
        return float(loss)

    def uncached(rows: int) -> Callable[[], float]:
        q, d = split_rows(q_in, rows)[0], split_rows(d_in, rows)[0]
        n = split_rows(n_in, rows * NEGATIVES)[0]

        def step() -> float:
            emb.zero_grad(set_to_none=True)
            loss, _ = loss_fn(emb.encode_text(*q), emb.encode_image(d), emb.encode_image(n))
            loss.backward()
            return float(loss.detach())

        return step

    _reset(device)
    loss_cached, t_cached = _timed(cached, device, repeats)
    mem_cached = _peak(device)
    trainable = [p for p in emb.parameters() if p.requires_grad]
    no_grad = sum(p.grad is None for p in trainable)
    emb.zero_grad(set_to_none=True)
    fits, loss_uncached, t_uncached, mem_uncached = 0, float("nan"), float("nan"), None
    for rows in [r for r in (64, 32, 16, 8, 4, 2, 1) if r <= b]:
        _reset(device)
        try:
            loss_uncached, t_uncached = _timed(uncached(rows), device, repeats)
        except torch.cuda.OutOfMemoryError:
            emb.zero_grad(set_to_none=True)
            continue
        fits, mem_uncached = rows, _peak(device)
        break
    return {
        "params_b": sum(p.numel() for p in emb.parameters()) / 1e9,
        "trainable_m": sum(p.numel() for p in trainable) / 1e6,
        "no_grad": no_grad,
        "batch": b,
        "chunk": chunk,
        "page": size["page"],
        "visual_tokens": int(counts.max()),
        "fp32": size["dtype"] == torch.float32,
        "loss_cached": loss_cached,
        "s_cached": t_cached,
        "gib_cached": mem_cached,
        "uncached_batch": fits,
        "loss_uncached": loss_uncached,
        "s_uncached": t_uncached,
        "gib_uncached": mem_uncached,
    }


def row(r: dict[str, Any]) -> tuple[str, str]:
    """gpu_check's (status, result) for `run`'s dict."""

    def gib(x: float | None) -> str:
        return "n/a on the CPU" if x is None else f"{x:.1f} GiB"

    ok = r["no_grad"] == 0 and r["uncached_batch"] > 0
    same = ""
    if r["uncached_batch"] == r["batch"]:  # the same batch: GradCache changes no loss
        diff = abs(r["loss_uncached"] - r["loss_cached"])
        ok = ok and (diff <= LOSS_TOL_FP32 or not r["fp32"])
        same = f", loss {r['loss_uncached']:.4f}, GradCache's differs by {diff:.1e}"
    status = "ok" if ok else "FAILED"
    w, h = r["page"]
    missing = f", {r['no_grad']} trainable tensors without a grad" if r["no_grad"] else ""
    return status, (
        f"{r['params_b']:.3g} B params, LoRA r16 ({r['trainable_m']:.1f} M trainable); "
        f"{r['batch']} queries + {r['batch']} pages + {NEGATIVES * r['batch']} page negatives, "
        f"{w}x{h} pages = {r['visual_tokens']} visual tokens (cap {MAX_VISUAL_TOKENS}); "
        f"GradCache chunk {r['chunk']}: {r['s_cached']:.2f} s/step, peak {gib(r['gib_cached'])}"
        f"{missing}; "
        f"uncached: largest batch that fits {r['uncached_batch']} "
        f"(x{1 + NEGATIVES} pages): {r['s_uncached']:.2f} s/step, peak "
        f"{gib(r['gib_uncached'])}{same}"
    )
