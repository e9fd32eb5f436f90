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
        [--negatives 2] [--parity-only [--world 2] [--float64] | --stages]

`--parity-only` prints only the loss / gradient table, adding with `--world 2` both methods on 2
gloo processes (each process half the batch; vltrain's InfoNCE gathers across ranks, CMNRL with
``gather_across_devices=True``; gradients averaged over the ranks as DDP would), and with
`--float64` everything in float64 (models, embeddings, logits: vltrain's ``.float()`` upcasts
then keep float64). vltrain against itself with one chunk per side, and each method on 1 vs 2
processes, show how far fp32 reduction order alone moves the numbers; fp32 runs are also compared
with the same runs in float64 (the same weights cast up), and with 2 processes the gradients are
compared per rank too, before the average.

`--stages` (1 process) shows where the fp32 difference enters: the chunk embeddings, the cached
embedding gradients of each library's loss stage (against a float64 loss on the same embeddings,
through a float64 encoder backward), the encoder backward from the same cached gradients (same
chunk order, and `grad_cache`'s order against CMNRL's) and its sensitivity to a 1-ulp change.

Runs in the bench venv (sentence-transformers >= 5.4; no torchvision).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grad_cache import _median_times, _reset_peak, _status_kib

from tests.tools.test_export_st import (
    pages_and_queries,
    qwen_processor_without_video,
    train_tiny_run,
)
from vltrain.cli import main as vltrain_main
from vltrain.config import load_config
from vltrain.data.batches import split_rows
from vltrain.data.hf_collate import HFCollate
from vltrain.models.hf_embedders import VLMEmbedder
from vltrain.objectives.contrastive import InfoNCELoss
from vltrain.objectives.grad_cache import grad_cache

TOL = 1e-5


def prepare(root: Path) -> Path:
    """A tiny Qwen3-VL run (1 step) exported for sentence-transformers; returns the export."""
    run = train_tiny_run(root, steps=1)
    out = root / "st"
    cmd = ["export", str(run), "--out", str(out), "--format", "sentence-transformers"]
    assert vltrain_main(cmd) == 0
    return out


def hard_negative_pages(root: Path, batch: int, k: int) -> list[list[Path]]:
    """`k` lists of `batch` pages: the k-th image hard negative of each of the first records."""
    lines = (root / "pages" / "train.jsonl").read_text().splitlines()[:batch]
    rows = [json.loads(line)["negatives"] for line in lines]
    return [[root / "pages" / r[j]["image"] for r in rows] for j in range(k)]


@contextlib.contextmanager
def keep_float64(on: bool) -> Iterator[None]:
    """vltrain upcasts embeddings and logits with ``.float()`` (never below fp32); in the float64
    runs that call keeps a float64 tensor float64 instead of rounding it to fp32."""
    if not on:
        yield
        return
    to_fp32 = torch.Tensor.float

    def at_least_fp32(self: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        return self if self.dtype == torch.float64 else to_fp32(self, *args, **kw)

    torch.Tensor.float = at_least_fp32
    try:
        yield
    finally:
        torch.Tensor.float = to_fp32


def build(
    root: Path,
    batch: int,
    chunk: int,
    negatives: int = 0,
    rank: int = 0,
    world: int = 1,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Callable[[], Any]]:
    """Step functions for both methods (and the models, for the gradient check). `world` > 1:
    this process holds rows [rank * batch / world, (rank + 1) * batch / world) of the batch and
    both losses gather across the ranks (vltrain's InfoNCE, CMNRL's gather_across_devices)."""
    from PIL import Image
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.losses.gradcache import _create_minibatch
    from sentence_transformers.sentence_transformer.losses import (
        CachedMultipleNegativesRankingLoss,
    )

    out = root / "st"
    cfg = load_config(root / "run" / "config.yaml")
    m = cfg.model
    temperature = cfg.objective.temperature
    rows = slice(rank * batch // world, (rank + 1) * batch // world)
    images, texts = pages_and_queries(root, batch)
    images, texts = images[rows], texts[rows]
    pils = [Image.open(p).convert("RGB") for p in images]

    emb = VLMEmbedder(out, instruction_query=m.instruction_query, instruction_doc=m.instruction_doc)
    emb.to(dtype).train()
    collate = HFCollate(
        out, "vlm", cfg.data.max_text_len, None, m.instruction_query, m.instruction_doc
    )
    negs = [
        [Image.open(p).convert("RGB") for p in col]
        for col in hard_negative_pages(root, batch, negatives)
    ]
    negs = [col[rows] for col in negs]
    q_in = collate.text_batch(texts, role="query")
    d_in = collate.image_batch(pils, role="doc")[0]
    n_in = [collate.image_batch(col, role="doc")[0] for col in negs]
    ours_loss = InfoNCELoss(
        temperature=temperature, learn_temperature=False, symmetric=False, gather=world > 1
    ).to(dtype)
    # the buffer holds log(1 / temperature) rounded to fp32; float64 runs take it unrounded
    ours_loss.logit_scale.fill_(math.log(1.0 / temperature))

    with qwen_processor_without_video():
        st = SentenceTransformer(str(out), device="cpu").to(dtype).train()
    q = st.preprocess(texts, prompt=m.instruction_query)
    d = st.preprocess(pils, prompt=m.instruction_doc)
    n = [st.preprocess(col, prompt=m.instruction_doc) for col in negs]
    cmnrl = CachedMultipleNegativesRankingLoss(
        st, scale=1.0 / temperature, mini_batch_size=chunk, gather_across_devices=world > 1
    )
    wide = dtype == torch.float64

    def ours(rows: int = chunk) -> torch.Tensor:
        """`rows` per chunk; `batch`: one chunk per side, the noise floor's reference."""
        emb.zero_grad(set_to_none=False)
        # one negatives side (column 0's pages, then column 1's, ...): the loss scores each
        # query against every positive and every negative, as CMNRL's extra columns
        n_chunks = [c for x in n_in for c in split_rows(x, rows)]
        sides = [split_rows(q_in, rows), split_rows(d_in, rows)] + ([n_chunks] if n_in else [])
        with keep_float64(wide):
            loss, _ = grad_cache(
                [lambda ids, mask: emb.encode_text(ids, mask)]
                + [emb.encode_image] * (len(sides) - 1),
                sides,
                lambda e: ours_loss(e[0], e[1], e[2] if len(e) > 2 else None),
            )
        return loss

    def theirs() -> torch.Tensor:
        st.zero_grad(set_to_none=False)
        with keep_float64(wide):
            loss = cmnrl([dict(q), dict(d), *(dict(f) for f in n)], None)
            loss.backward()
        return loss.detach()

    # The stage-by-stage view (`stages`): both libraries' chunks in one flat order (queries,
    # positives, then each negatives column), so embeddings and cached gradients line up
    v_flat = [c for x in (q_in, d_in, *n_in) for c in split_rows(x, chunk)]
    per_side = [len(split_rows(x, chunk)) for x in (q_in, d_in, *n_in)]
    s_flat = [(f, b) for f in (q, d, *n) for b in range(0, len(texts), chunk)]

    def v_encode(i: int) -> torch.Tensor:
        c = v_flat[i]
        with keep_float64(wide):
            return emb.encode_text(*c) if i < per_side[0] else emb.encode_image(c)

    def s_encode(i: int) -> torch.Tensor:
        f, b = s_flat[i]
        return st(_create_minibatch(dict(f), b, b + chunk))["sentence_embedding"]

    def cached_vltrain(flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """vltrain's InfoNCE on these chunk embeddings: each chunk's cached gradient."""
        sides, k = [], 0
        for n_side in per_side[:2] + ([sum(per_side[2:])] if n_in else []):
            sides.append(torch.cat(flat[k : k + n_side]).detach().requires_grad_())
            k += n_side
        with keep_float64(wide):
            loss, _ = ours_loss(sides[0], sides[1], sides[2] if n_in else None)
        loss.backward()
        return [g for x in sides for g in x.grad.split(chunk)]

    def cached_st(flat: list[torch.Tensor]) -> list[torch.Tensor]:
        """CMNRL's loss stage (`calculate_loss`, mini-batched, backward) on the same embeddings."""
        reps, k = [], 0
        for n_side in per_side:
            reps.append([x.detach().clone().requires_grad_() for x in flat[k : k + n_side]])
            k += n_side
        cmnrl.calculate_loss(reps, None, with_backward=True)
        return [x.grad for side in reps for x in side]

    def backward(
        encode: Callable[[int], torch.Tensor], grads: list[torch.Tensor], reverse: bool = False
    ) -> None:
        """The encoder backward of GradCache's step 3 from the given cached gradients, chunk by
        chunk into ``.grad``: CMNRL's order (first chunk first), or `reverse` (vltrain's
        `grad_cache`, which starts with the last chunk, whose graph it kept)."""
        for i in reversed(range(len(grads))) if reverse else range(len(grads)):
            out = encode(i)
            out.backward(grads[i].to(out.dtype))

    def parts() -> dict[str, Any]:
        return {
            "n_chunks": len(v_flat),
            "encode": {"vltrain": v_encode, "st_cached": s_encode},
            "cached": {"vltrain": cached_vltrain, "st_cached": cached_st},
            "backward": backward,
        }

    return {
        "vltrain": ours,
        "st_cached": theirs,
        "_vltrain_one_chunk": lambda: ours(batch),
        "_models": lambda: (emb.base_model().model, st[0].model),
        "_parts": parts,
    }


def agreement(steps: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Loss and per-parameter gradients of one step of each, matched by parameter name."""
    ours_model, st_model = steps["_models"]()
    steps["_vltrain_one_chunk"]()
    one_chunk = {n: p.grad.clone() for n, p in ours_model.named_parameters() if p.grad is not None}
    loss_ours, loss_st = float(steps["vltrain"]()), float(steps["st_cached"]())
    st_params = dict(st_model.named_parameters())
    diffs, floor, biggest, compared = [], [], 0.0, 0
    sq = {"st": 0.0, "floor": 0.0, "norm": 0.0}
    for name, p in ours_model.named_parameters():
        if p.grad is None:
            continue
        other = st_params[name].grad
        diffs.append(float((p.grad - other).abs().max()))
        floor.append(float((p.grad - one_chunk[name]).abs().max()))
        sq["st"] += float((p.grad - other).double().pow(2).sum())
        sq["floor"] += float((p.grad - one_chunk[name]).double().pow(2).sum())
        sq["norm"] += float(other.double().pow(2).sum())
        biggest = max(biggest, float(other.abs().max()))
        compared += 1
    return {
        # vltrain against itself with one chunk per side: fp32 summation-order noise
        "grad_noise_floor": max(floor),
        "grad_rel_l2": (sq["st"] / sq["norm"]) ** 0.5,
        "grad_rel_l2_floor": (sq["floor"] / sq["norm"]) ** 0.5,
        "loss_vltrain": loss_ours,
        "loss_st": loss_st,
        "loss_abs_diff": abs(loss_ours - loss_st),
        "grad_max_abs_diff": max(diffs),
        "grad_max_abs": biggest,
        "params_compared": compared,
    }


def _loss_and_grads(step: Callable[[], Any], model: torch.nn.Module) -> dict[str, Any]:
    loss = float(step())
    return {
        "loss": loss,
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    }


def _compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float, float]:
    """(|loss diff|, max |grad diff| over the shared parameters by name, largest |grad|)."""
    names = a["grads"].keys() & b["grads"].keys()
    assert len(names) == len(a["grads"]) == len(b["grads"]), "different trainable parameters"
    grad = max(float((a["grads"][k] - b["grads"][k]).abs().max()) for k in names)
    biggest = max(float(g.abs().max()) for g in a["grads"].values())
    return abs(a["loss"] - b["loss"]), grad, biggest


def dist_worker(spec: dict[str, Any]) -> None:
    """One rank of the 2-process run: both methods on this rank's half of the batch, gathering
    across ranks; losses and gradients averaged over the ranks (what DDP's all-reduce makes of
    them), written by rank 0."""
    import torch.distributed as dist

    from vltrain.core import distributed

    # tests/conftest.py (imported through the test helpers) checks every collective as NCCL
    # would; sentence-transformers' gather runs on these CPU tensors under gloo by design
    distributed.set_strict(None)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dtype = torch.float64 if spec["float64"] else torch.float32
    root, batch = Path(spec["root"]), spec["batch"]
    steps = build(root, batch, spec["chunk"], spec["negs"], rank, world, dtype)
    models = dict(zip(("vltrain", "st_cached"), steps["_models"](), strict=True))
    local = {name: _loss_and_grads(steps[name], model) for name, model in models.items()}
    if dtype == torch.float32:  # the same ranks in float64: the reference for both
        wide = build(root, batch, spec["chunk"], spec["negs"], rank, world, torch.float64)
        local["float64"] = _loss_and_grads(wide["vltrain"], wide["_models"]()[0])
    # before the all-reduce: each rank's gradient is `world` x its rows' share of the global
    # loss's gradient, in both libraries (vltrain's gather backward sums the ranks' identical
    # copies, CMNRL sums the ranks' local losses), so the per-rank gradients compare as they are
    v, st = local["vltrain"], local["st_cached"]
    per_rank = [_compare(v, st)[1], max(_compare(v, st)[2], _compare(st, v)[2])]
    if "float64" in local:
        per_rank += [_compare(v, local["float64"])[1], _compare(st, local["float64"])[1]]
    per_rank_max = distributed.all_reduce_max(torch.tensor(per_rank, dtype=torch.float64))
    result: dict[str, Any] = {"per_rank": per_rank_max.tolist()}
    for name, r in local.items():
        # vltrain: every rank holds the global batch's loss; CMNRL: the loss of its rows
        loss = distributed.all_reduce_mean(torch.tensor(r["loss"], dtype=torch.float64))
        grads = {k: distributed.all_reduce_mean(g) for k, g in r["grads"].items()}
        result[name] = {"loss": float(loss), "grads": grads}
    if rank == 0:
        torch.save(result, spec["out"])
    dist.destroy_process_group()


def parity(batch: int, chunk: int, negatives: int, world: int, float64: bool) -> None:
    """Loss and gradients of vltrain and CMNRL, 1 process and (`world` 2) 2 gloo processes,
    fp32 or float64; each against the others and vltrain against itself with one chunk."""
    import os

    import sentence_transformers

    dtype = torch.float64 if float64 else torch.float32
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root)
        steps = build(root, batch, chunk, negatives, dtype=dtype)
        ours_model, st_model = steps["_models"]()
        runs = {
            "vltrain 1 process, one chunk per side": _loss_and_grads(
                steps["_vltrain_one_chunk"], ours_model
            )
        }
        runs["vltrain 1 process"] = _loss_and_grads(steps["vltrain"], ours_model)
        runs["CMNRL 1 process"] = _loss_and_grads(steps["st_cached"], st_model)
        # fp32: every run also against float64 (the same weights cast up; vltrain's float64
        # step, which CMNRL's float64 step equals to ~1e-15)
        truth, dist_runs = {}, set()
        if not float64:
            wide = build(root, batch, chunk, negatives, dtype=torch.float64)
            truth[1] = _loss_and_grads(wide["vltrain"], wide["_models"]()[0])
        if world > 1:
            spec = {"root": str(root), "batch": batch, "chunk": chunk, "negs": negatives}
            spec |= {"float64": float64, "out": str(root / "dist.pt")}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += [f"--nproc_per_node={world}", __file__, "--_dist", json.dumps(spec)]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(res.stdout[-3000:] + res.stderr[-3000:])
            dist_res = torch.load(root / "dist.pt", weights_only=True)
            runs[f"vltrain {world} gloo ranks"] = dist_res["vltrain"]
            dist_runs = {
                f"vltrain {world} gloo ranks",
                f"CMNRL {world} processes, gather_across_devices",
            }
            runs[f"CMNRL {world} processes, gather_across_devices"] = dist_res["st_cached"]
            truth[world] = dist_res.get("float64")
            per_rank = dist_res["per_rank"]
    cpu = _cpu()
    print(
        f"\nmachine: {cpu} CPU, 1 thread; {datetime.date.today()}; torch "
        f"{torch.__version__}, sentence-transformers {sentence_transformers.__version__}; "
        f"{'float64' if float64 else 'fp32'}; batch {batch} queries + {batch} pages + "
        f"{negatives} page hard negatives each, chunk {chunk}, scale 50, query -> doc"
    )
    print(
        f"command: PYTHONPATH=. python bench/bench_st_cached_loss.py --batch {batch} --chunk "
        f"{chunk} --negatives {negatives} --world {world}{' --float64' if float64 else ''} "
        "--parity-only\n"
    )
    print(
        "| run | loss | vs vltrain 1 process: loss / max grad diff | vs CMNRL 1 process | vs "
        "float64, same processes: loss / max grad diff |"
    )
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        a = _compare(r, runs["vltrain 1 process"])
        b = _compare(r, runs["CMNRL 1 process"])
        ref = truth.get(world if name in dist_runs else 1)
        c = f"{_compare(r, ref)[0]:.1e} / {_compare(r, ref)[1]:.1e}" if ref else "-"
        print(
            f"| {name} | {r['loss']:.9f} | {a[0]:.1e} / {a[1]:.1e} | {b[0]:.1e} / {b[1]:.1e} "
            f"| {c} |"
        )
    if world > 1:
        x = _compare(
            runs[f"vltrain {world} gloo ranks"],
            runs[f"CMNRL {world} processes, gather_across_devices"],
        )
        ok = x[0] <= TOL and x[1] <= TOL
        print(
            f"\nvltrain {world} ranks vs CMNRL {world} processes: loss {x[0]:.1e}, max grad "
            f"{x[1]:.1e} (largest |grad| {x[2]:.2f}): {'ok' if ok else 'MISMATCH'} (<= {TOL})"
        )
        line = (
            f"per rank, before the all-reduce: max grad diff {per_rank[0]:.1e} (largest |grad| "
            f"{per_rank[1]:.2f})"
        )
        if len(per_rank) > 2:
            line += f"; vs float64: vltrain {per_rank[2]:.1e}, CMNRL {per_rank[3]:.1e}"
        print(line)


def _cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((x.split(":", 1)[1].strip() for x in out.splitlines() if "Model name" in x), "")
    return name or platform.machine()


def _grads(model: torch.nn.Module, fill: Callable[[], Any]) -> dict[str, torch.Tensor]:
    """`model`'s parameter gradients (float64 copies) after `fill()` backpropagates into them."""
    model.zero_grad(set_to_none=False)
    fill()
    return {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def stages(batch: int, chunk: int, negatives: int) -> None:
    """Where the fp32 gradient difference of one process enters: embeddings, the loss stage
    (cached embedding gradients) and the encoder backward, each against float64 (the same
    weights cast up; in float64 the two libraries agree to ~1e-15)."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root)
        s32, s64 = (
            build(root, batch, chunk, negatives, dtype=t) for t in (torch.float32, torch.float64)
        )
        (vm, sm), (vm64, _) = s32["_models"](), s64["_models"]()
        p32, p64 = s32["_parts"](), s64["_parts"]()
        enc, back, n = p32["encode"], p32["backward"], p32["n_chunks"]
        with torch.no_grad():
            ev = [enc["vltrain"](i) for i in range(n)]
            es = [enc["st_cached"](i) for i in range(n)]
        g = {k: f(ev) for k, f in p32["cached"].items()}
        g64 = p64["cached"]["vltrain"]([e.double() for e in ev])  # float64 loss, fp32 embeddings

        def exact(grads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
            return _grads(vm64, lambda: back(p64["encode"]["vltrain"], grads))

        truth = _grads(vm64, s64["vltrain"])
        full = {"vltrain": _grads(vm, s32["vltrain"]), "st_cached": _grads(sm, s32["st_cached"])}
        ref = exact(g64)
        rounded = [x.float() for x in g64]
        torch.manual_seed(0)
        ulp = [
            torch.where(torch.rand_like(x) < 0.5, x.nextafter(x + 1), x.nextafter(x - 1))
            for x in rounded
        ]
        worst = max(
            truth, key=lambda k: float((full["vltrain"][k] - full["st_cached"][k]).abs().max())
        )
        terms = []
        for i in range(n):  # the worst parameter's gradient, chunk by chunk (float64)
            one = [x if j == i else torch.zeros_like(x) for j, x in enumerate(g64)]
            terms.append(exact(one)[worst].abs())
        # the fp32 encoder backward from vltrain's cached gradients, in CMNRL's chunk order
        fp32 = {"vltrain": _grads(vm, lambda: back(enc["vltrain"], g["vltrain"]))}
        loss_only = {k: exact(g[k]) for k in ("vltrain", "st_cached")}
        emb_diff = max(float((a - b).abs().max()) for a, b in zip(ev, es, strict=True))
        rows = [
            ("chunk embeddings (fp32), vltrain vs CMNRL", emb_diff),
            ("full fp32 step: vltrain vs CMNRL", _max_diff(full["vltrain"], full["st_cached"])),
            ("full fp32 step: vltrain vs float64", _max_diff(full["vltrain"], truth)),
            ("full fp32 step: CMNRL vs float64", _max_diff(full["st_cached"], truth)),
            (
                "encoder backward from the same cached gradients, same chunk order: vltrain's "
                "model vs CMNRL's (`dot(out, g).backward()`)",
                _max_diff(
                    fp32["vltrain"], _grads(sm, lambda: back(enc["st_cached"], g["vltrain"]))
                ),
            ),
            (
                "encoder backward from the same cached gradients: `grad_cache`'s chunk order "
                "(last first) vs CMNRL's (first first)",
                _max_diff(
                    _grads(vm, lambda: back(enc["vltrain"], g["vltrain"], True)), fp32["vltrain"]
                ),
            ),
            (
                "loss stage only (each library's cached gradients, float64 backward): vltrain vs "
                "float64 loss / CMNRL vs float64 loss / vltrain vs CMNRL",
                (
                    _max_diff(loss_only["vltrain"], ref),
                    _max_diff(loss_only["st_cached"], ref),
                    _max_diff(loss_only["vltrain"], loss_only["st_cached"]),
                ),
            ),
            (
                "fp32 encoder backward alone: float64 cached gradients rounded to fp32, fp32 vs "
                "float64 backward",
                _max_diff(_grads(vm, lambda: back(enc["vltrain"], rounded)), ref),
            ),
            (
                "every cached gradient moved by 1 ulp (random sign), float64 backward",
                _max_diff(exact(ulp), exact(rounded)),
            ),
        ]
    cpu = _cpu()
    print(
        f"\nmachine: {cpu} CPU, 1 thread; {datetime.date.today()}; torch {torch.__version__}; "
        f"1 process, fp32 against float64 (the same weights cast up); batch {batch}, chunk "
        f"{chunk}, {negatives} page hard negatives each"
    )
    print(
        f"command: PYTHONPATH=. python bench/bench_st_cached_loss.py --batch {batch} --chunk "
        f"{chunk} --negatives {negatives} --stages\n"
    )
    print("| parameter gradients, max abs difference | |\n|---|---|")
    for name, v in rows:
        shown = " / ".join(f"{x:.1e}" for x in v) if isinstance(v, tuple) else f"{v:.1e}"
        print(f"| {name} | {shown} |")
    print(
        f"\nlargest |grad| (float64) {max(float(x.abs().max()) for x in truth.values()):.3f}; the "
        f"worst parameter {worst}: |grad| {float(truth[worst].abs().max()):.3f}, the sum over the "
        f"{n} chunks of |chunk contribution| {float(sum(terms).max()):.1f}"
    )


def memory(root: Path, method: str, batch: int, chunk: int, negatives: int) -> float:
    """Peak-RSS growth (MiB) of two steps of `method` in a fresh subprocess."""
    spec = json.dumps(
        {"root": str(root), "method": method, "batch": batch, "chunk": chunk, "negs": negatives}
    )
    cmd = [sys.executable, __file__, "--_mem", spec]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(res.strip().splitlines()[-1])["delta_mib"]


def memory_child(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    steps = build(Path(spec["root"]), spec["batch"], spec["chunk"], spec["negs"])
    step = steps[spec["method"]]
    step()  # warm-up: .grad buffers stay allocated
    base = _reset_peak()
    for _ in range(2):
        step()
    peak = _status_kib("VmHWM")
    print(json.dumps({"delta_mib": (peak - base) / 1024}))


def run(batch: int, chunk: int, runs: int, negatives: int) -> None:
    import sentence_transformers
    import transformers

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root)
        torch.set_num_threads(1)
        steps = build(root, batch, chunk, negatives)
        agree = agreement(steps)
        times = _median_times({k: steps[k] for k in ("vltrain", "st_cached")}, runs)
        mem: dict[str, list[float]] = {"vltrain": [], "st_cached": []}
        for _ in range(3):  # alternated too
            for method in mem:
                mem[method].append(memory(root, method, batch, chunk, negatives))
    med = {k: statistics.median(v) for k, v in mem.items()}
    print(
        f"\nmachine: {platform.machine()} CPU, 1 thread; {datetime.date.today()}; torch "
        f"{torch.__version__}, transformers {transformers.__version__}, sentence-transformers "
        f"{sentence_transformers.__version__}; batch {batch} queries + {batch} pages "
        f"+ {negatives} page hard negatives each, "
        f"mini-batch / GradCache chunk {chunk}, temperature 0.02 (scale 50), query -> doc"
    )
    print(
        f"command: PYTHONPATH=. python bench/bench_st_cached_loss.py --batch {batch} "
        f"--chunk {chunk} --runs {runs} --negatives {negatives}\n"
    )
    ok = agree["loss_abs_diff"] <= TOL and agree["grad_max_abs_diff"] <= TOL
    print(
        f"agreement: loss {agree['loss_vltrain']:.6f} vs {agree['loss_st']:.6f} "
        f"(|diff| {agree['loss_abs_diff']:.1e}); max |grad diff| "
        f"{agree['grad_max_abs_diff']:.1e} over {agree['params_compared']} parameters "
        f"(largest |grad| {agree['grad_max_abs']:.2e}); {'ok' if ok else 'MISMATCH'} (<= {TOL}); "
        f"vltrain chunk {chunk} vs one chunk per side: max |grad diff| "
        f"{agree['grad_noise_floor']:.1e}; relative L2 of the gradient difference: vs CMNRL "
        f"{agree['grad_rel_l2']:.1e}, vltrain vs itself {agree['grad_rel_l2_floor']:.1e}\n"
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
    ap.add_argument("--negatives", type=int, default=0, help="page hard negatives per query (<= 2)")
    ap.add_argument("--world", type=int, default=1, help="with --parity-only: 2 gloo processes")
    ap.add_argument("--float64", action="store_true", help="with --parity-only: both in float64")
    ap.add_argument("--parity-only", action="store_true", help="loss/gradient tables, no timing")
    ap.add_argument("--stages", action="store_true", help="1 process: where fp32 differences enter")
    ap.add_argument("--_mem", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_dist", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._mem:
        memory_child(json.loads(args._mem))
        return 0
    if args._dist:
        dist_worker(json.loads(args._dist))
        return 0
    if args.stages:
        stages(args.batch, args.chunk, args.negatives)
        return 0
    if args.parity_only:
        parity(args.batch, args.chunk, args.negatives, args.world, args.float64)
        return 0
    run(args.batch, args.chunk, args.runs, args.negatives)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
