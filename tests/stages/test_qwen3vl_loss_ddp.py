"""Exact across ranks, the hard case (issue 54 item 2): a tiny random Qwen3-VL (the reference
workload's fixture), text queries, page-image positives and 5 page-image hard negatives per
query, GradCache with chunk 1 on 2 gloo ranks (spawned), each rank half the global batch. The
loss and every gradient equal one process computing the full batch without GradCache, to
<= 1e-5 in fp32, with InfoNCE (hard negatives shared by every query, gathered across ranks)
and with the five-term qwen3vl loss (each query's own). Negative control: without gathering
(colpali-engine's behaviour) the gradients differ.

With qwen3vl a query's hard negatives live on its own rank, so what the gather adds there is
the other ranks' query-query, doc-doc and query-doc terms.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.stages.test_pages_workload import PRESET as PAGES_PRESET
from tests.stages.test_pages_workload import _overrides
from tests.stages.test_qwen3vl_pages import qwen3vl_dir  # noqa: F401  (fixture)
from vltrain.cli import main
from vltrain.config import load_config
from vltrain.data.pairs import PairCollate, PairDataset
from vltrain.data.synth_pages import pages_command
from vltrain.engine.parallel import ParallelModel
from vltrain.models.backbones import build_batcher
from vltrain.models.contrastive import ContrastiveModel
from vltrain.models.hf_embedders import VLMEmbedder
from vltrain.objectives.contrastive import build_loss
from vltrain.objectives.grad_cache import pair_grad_cache

PER_RANK, NEG = 2, 5
TOL = 1e-5
#: (loss, gather): the cases each rank runs, in this order
CASES = (("infonce", True), ("qwen3vl", True), ("infonce", False), ("qwen3vl", False))


def _model(path: str, loss: str, gather: bool, rank: int = 0, world: int = 1) -> ContrastiveModel:
    torch.manual_seed(0)
    # the random model embeds every page within cosine 1e-4 of every other: the copy clause
    # would mask all document terms as copies of the positive, so it is off here (the mask is
    # checked against the formula in tests/objectives/test_qwen3vl_loss.py)
    kw = {"negatives_per_query": NEG, "terms": "five", "duplicate_cosine": 2.0}
    kw = kw if loss == "qwen3vl" else {}
    fn = build_loss(loss, temperature=0.05, gather=gather, rank=rank, world_size=world, **kw)
    return ContrastiveModel(VLMEmbedder(path), fn)


def _batches(path: str, pages: Path) -> list[dict]:
    """The global batch, then each rank's half (negatives follow their queries' order)."""
    cfg = load_config(
        None,
        [
            "model.kind=vlm",
            f"model.path={path}",
            "data.max_visual_tokens=4",
            "data.max_text_len=16",
        ],
    )
    ds = PairDataset(pages / "train.jsonl", 32, 0, hard_negatives=NEG, train=False, native=True)
    collate = PairCollate(build_batcher(cfg, None), ds.modalities)
    samples = [ds[i] for i in range(2 * PER_RANK)]
    assert all(len(s["negatives"]) == NEG for s in samples)
    halves = [samples[r * PER_RANK : (r + 1) * PER_RANK] for r in range(2)]
    return [collate(samples), *(collate(h) for h in halves)]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _worker(rank: int, store: str, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        batch = torch.load(f"{out}/batches.pt", weights_only=True)[1 + rank]
        results = []
        for loss, gather in CASES:
            model = ParallelModel(_model(path, loss, gather, rank, 2), "ddp")
            value, _ = pair_grad_cache(model.module, batch, 1, 1.0)  # chunk 1: one row a pass
            model.reduce_gradients()
            results.append({"loss": value, "grads": _grads(model.module)})
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("q3loss_pages")
    pages_command(
        str(out), n_train=8, n_val=1, n_test=1, seed=0, image_size=32, negatives=NEG, distractors=1
    )
    return out


@pytest.mark.slow
def test_two_ranks_grad_cache_equal_one_process_full_batch(
    qwen3vl_dir: str,  # noqa: F811
    pages: Path,
    tmp_path: Path,
) -> None:
    batches = _batches(qwen3vl_dir, pages)
    torch.save(batches, tmp_path / "batches.pt")
    mp.start_processes(
        _worker,
        args=(str(tmp_path / "store"), qwen3vl_dir, str(tmp_path)),
        nprocs=2,
        join=True,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for case, (loss_name, gather) in enumerate(CASES):
        model = _model(qwen3vl_dir, loss_name, True)  # one process, full batch, no GradCache
        loss, metrics = model(batches[0])
        loss.backward()
        ref = _grads(model)
        zero = [k for k, g in ref.items() if not g.abs().max() > 0]
        # every parameter learns, but the deepstack merger (its features join after the one
        # decoder layer of the tiny model, where nothing reads them)
        assert len(ref) > 30 and all("deepstack_merger" in k for k in zero)
        if loss_name == "qwen3vl":  # every term of every kind counts
            assert float(metrics["masked_fraction"]) == 0.0
        for r in ranks:
            got = r[case]
            assert got["grads"].keys() == ref.keys()
            diff = max((got["grads"][k] - ref[k]).abs().max().item() for k in ref)
            if gather:
                assert abs(float(got["loss"]) - loss.item()) <= TOL, loss_name
                assert diff <= TOL, (loss_name, diff)
            else:  # control: each rank's own half-batch loss, DDP-averaged, is another thing
                assert diff > 100 * TOL, (loss_name, diff)


def test_stage_trains_with_qwen3vl_and_refuses_records_short_of_negatives(
    pages: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`vltrain train` end to end (built-in towers, image negatives, GradCache), and the
    load-time refusal when a record has fewer negatives than each query must own."""
    loss = ["objective.loss=qwen3vl", "objective.terms=two", "objective.grad_cache_chunk=4"]
    over = _overrides(
        pages, tmp_path / "run", **{"data.eval": "", "train.best_metric": "", "train.max_steps": 2}
    )
    assert main(["train", str(PAGES_PRESET), *over, *loss]) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in rows if "train_masked_fraction" in r]
    over = _overrides(
        pages,
        tmp_path / "short",
        **{"data.eval": "", "train.best_metric": "", "train.max_steps": 1},
    )
    assert main(["train", str(PAGES_PRESET), *over, *loss, f"objective.hard_negatives={NEG + 1}"])
    err = capsys.readouterr().err
    assert f"objective.hard_negatives={NEG + 1}" in err and "8 of 8 records" in err
    assert not (tmp_path / "short" / "metrics.jsonl").exists()  # refused before any step
