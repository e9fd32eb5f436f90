"""vltrain's InfoNCE + GradCache vs sentence-transformers' CachedMultipleNegativesRankingLoss on
a tiny random Qwen3-VL-Embedding-style model: text queries, page-image positives.

One model directory for both: a tiny random Qwen3-VL trained 1 step with the
qwen3vl_embed_pages preset and exported with `vltrain export --format sentence-transformers`
(full weights, the preset's instructions as prompts). vltrain: `VLMEmbedder` on that
directory, its `HFCollate` prompts, `grad_cache` over query and page chunks and
`InfoNCELoss(temperature=0.02, symmetric=False)` (the preset's). sentence-transformers:
``SentenceTransformer(dir)`` with ``CachedMultipleNegativesRankingLoss(scale=1/0.02 = 50,
mini_batch_size=chunk)`` (query -> document only, as the preset), its own ``preprocess`` with the
query / document prompts. Checked: loss and every parameter gradient of the shared Qwen3-VL model
(by name) agree to <= 1e-5. Timed: one step = loss + backward into .grad (no optimizer step),
methods alternated A B A B, medians. Memory: peak RSS growth over two steps, each method in its
own subprocess (`bench_grad_cache.py`'s method: VmHWM after a reset), median of 3.

    PYTHONPATH=. python bench/bench_st_cached_loss.py [--batch 16] [--chunk 4] [--runs 5]

Runs in the bench venv (sentence-transformers >= 5.4; no torchvision).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grad_cache import _median_times, _reset_peak, _status_kib  # noqa: E402

from tests.tools.test_export_st import (  # noqa: E402
    pages_and_queries,
    qwen_processor_without_video,
    train_tiny_run,
)
from vltrain.cli import main as vltrain_main  # noqa: E402
from vltrain.config import load_config  # noqa: E402
from vltrain.data.batches import split_rows  # noqa: E402
from vltrain.data.hf_collate import HFCollate  # noqa: E402
from vltrain.models.hf_embedders import VLMEmbedder  # noqa: E402
from vltrain.objectives.contrastive import InfoNCELoss  # noqa: E402
from vltrain.objectives.grad_cache import grad_cache  # noqa: E402

TOL = 1e-5


def prepare(root: Path) -> Path:
    """A tiny Qwen3-VL run (1 step) exported for sentence-transformers; returns the export."""
    run = train_tiny_run(root, steps=1)
    out = root / "st"
    cmd = ["export", str(run), "--out", str(out), "--format", "sentence-transformers"]
    assert vltrain_main(cmd) == 0
    return out


def build(root: Path, batch: int, chunk: int) -> dict[str, Callable[[], Any]]:
    """Step functions for both methods (and the models, for the gradient check)."""
    from PIL import Image
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
    )

    out = root / "st"
    cfg = load_config(root / "run" / "config.yaml")
    m = cfg.model
    temperature = cfg.objective.temperature
    images, texts = pages_and_queries(root, batch)
    pils = [Image.open(p).convert("RGB") for p in images]

    emb = VLMEmbedder(out, instruction_query=m.instruction_query, instruction_doc=m.instruction_doc)
    emb.train()
    collate = HFCollate(
        out, "vlm", cfg.data.max_text_len, None, m.instruction_query, m.instruction_doc
    )
    q_chunks = split_rows(collate.text_batch(texts, role="query"), chunk)
    d_chunks = split_rows(collate.image_batch(pils, role="doc")[0], chunk)
    ours_loss = InfoNCELoss(
        temperature=temperature, learn_temperature=False, symmetric=False, gather=False
    )

    with qwen_processor_without_video():
        st = SentenceTransformer(str(out), device="cpu").train()
    q = st.preprocess(texts, prompt=m.instruction_query)
    d = st.preprocess(pils, prompt=m.instruction_doc)
    cmnrl = CachedMultipleNegativesRankingLoss(st, scale=1.0 / temperature, mini_batch_size=chunk)

    def ours() -> torch.Tensor:
        emb.zero_grad(set_to_none=False)
        loss, _ = grad_cache(
            [lambda ids, mask: emb.encode_text(ids, mask), emb.encode_image],
            [q_chunks, d_chunks],
            lambda e: ours_loss(e[0], e[1]),
        )
        return loss

    def theirs() -> torch.Tensor:
        st.zero_grad(set_to_none=False)
        loss = cmnrl([dict(q), dict(d)], None)
        loss.backward()
        return loss.detach()

    return {
        "vltrain": ours,
        "st_cached": theirs,
        "_models": lambda: (emb.base_model().model, st[0].model),
    }


def agreement(steps: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Loss and per-parameter gradients of one step of each, matched by parameter name."""
    ours_model, st_model = steps["_models"]()
    loss_ours, loss_st = float(steps["vltrain"]()), float(steps["st_cached"]())
    st_params = dict(st_model.named_parameters())
    diffs, biggest, compared = [], 0.0, 0
    for name, p in ours_model.named_parameters():
        if p.grad is None:
            continue
        other = st_params[name].grad
        diffs.append(float((p.grad - other).abs().max()))
        biggest = max(biggest, float(other.abs().max()))
        compared += 1
    return {
        "loss_vltrain": loss_ours,
        "loss_st": loss_st,
        "loss_abs_diff": abs(loss_ours - loss_st),
        "grad_max_abs_diff": max(diffs),
        "grad_max_abs": biggest,
        "params_compared": compared,
    }


def memory(root: Path, method: str, batch: int, chunk: int) -> float:
    """Peak-RSS growth (MiB) of two steps of `method` in a fresh subprocess."""
    spec = json.dumps({"root": str(root), "method": method, "batch": batch, "chunk": chunk})
    cmd = [sys.executable, __file__, "--_mem", spec]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(res.strip().splitlines()[-1])["delta_mib"]


def memory_child(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    step = build(Path(spec["root"]), spec["batch"], spec["chunk"])[spec["method"]]
    step()  # warm-up: .grad buffers stay allocated
    base = _reset_peak()
    for _ in range(2):
        step()
    peak = _status_kib("VmHWM")
    print(json.dumps({"delta_mib": (peak - base) / 1024}))


def run(batch: int, chunk: int, runs: int) -> None:
    import sentence_transformers
    import transformers

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root)
        torch.set_num_threads(1)
        steps = build(root, batch, chunk)
        agree = agreement(steps)
        times = _median_times({k: steps[k] for k in ("vltrain", "st_cached")}, runs)
        mem: dict[str, list[float]] = {"vltrain": [], "st_cached": []}
        for _ in range(3):  # alternated too
            for method in mem:
                mem[method].append(memory(root, method, batch, chunk))
    med = {k: statistics.median(v) for k, v in mem.items()}
    print(
        f"\nmachine: {platform.machine()} CPU, 1 thread; {datetime.date.today()}; torch "
        f"{torch.__version__}, transformers {transformers.__version__}, sentence-transformers "
        f"{sentence_transformers.__version__}; batch {batch} queries + {batch} pages, "
        f"mini-batch / GradCache chunk {chunk}, temperature 0.02 (scale 50), query -> doc"
    )
    print(
        f"command: PYTHONPATH=. python bench/bench_st_cached_loss.py --batch {batch} "
        f"--chunk {chunk} --runs {runs}\n"
    )
    ok = agree["loss_abs_diff"] <= TOL and agree["grad_max_abs_diff"] <= TOL
    print(
        f"agreement: loss {agree['loss_vltrain']:.6f} vs {agree['loss_st']:.6f} "
        f"(|diff| {agree['loss_abs_diff']:.1e}); max |grad diff| "
        f"{agree['grad_max_abs_diff']:.1e} over {agree['params_compared']} parameters "
        f"(largest |grad| {agree['grad_max_abs']:.2e}); {'ok' if ok else 'MISMATCH'} (<= {TOL})\n"
    )
    print("| what | vltrain | sentence-transformers CMNRL | ratio |")
    print("|---|---|---|---|")
    t_ours, t_st = times["vltrain"], times["st_cached"]
    print(
        f"| step time (median of {runs}) | {t_ours * 1e3:.1f} ms | {t_st * 1e3:.1f} ms | "
        f"{t_ours / t_st:.2f}x |"
    )
    print(
        f"| peak RSS growth, 2 steps (median of 3) | {med['vltrain']:.1f} MiB | "
        f"{med['st_cached']:.1f} MiB | {med['vltrain'] / max(med['st_cached'], 1e-9):.2f}x |"
    )


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--_mem", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._mem:
        memory_child(json.loads(args._mem))
        return 0
    run(args.batch, args.chunk, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
