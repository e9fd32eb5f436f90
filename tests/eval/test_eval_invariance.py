"""Invariant 11: corpus metrics do not depend on the eval batch size or the world size.

A tiny random Qwen3-VL embedder (built from config objects, `test_qwen3vl_pages`) is trained
for a few steps on the synthetic pages, whose validation pages are resized to different
visual-token counts so that every multi-item batch pads its images and its prompts. Then
`vltrain eval` of that checkpoint at eval batch sizes 1, 7 and 64, the in-training evaluation
(batch size 7) and `vltrain eval` under torchrun with 2 gloo ranks give the same metrics, bit
for bit (==, not approx), and the same embeddings. Negative control: the batched forward the
evaluator used before (one padded forward per batch) moves embeddings with the batch size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.stages.test_hf_backbones_ddp import _one_process, _rows
from tests.stages.test_qwen3vl_pages import qwen3vl_dir  # noqa: F401  (a fixture)
from vltrain.data.batches import to_device
from vltrain.data.images import DEFAULT_MAX_PIXELS
from vltrain.data.pairs import encode_side, load_side, side_inputs
from vltrain.data.synth_pages import pages_command
from vltrain.eval.corpus import read_split_dir
from vltrain.tools.eval import eval_command
from vltrain.tools.loading import load_trained

#: (width, height) of the validation pages in turn: 1, 2, 4, 6 and 12 visual tokens after the
#: 2x2 merge of 4-pixel patches, so a batch of several pages pads most of them
SIZES = ((8, 8), (16, 8), (16, 16), (24, 16), (32, 24))
TIMINGS = ("encode_s", "total_s")
BATCHES = (1, 7, 64)


@pytest.fixture(scope="module")
def mixed_pages(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mixed_pages")
    pages_command(
        str(out), n_train=16, n_val=4, n_test=1, seed=0, image_size=32, negatives=2, distractors=4
    )
    for i, png in enumerate(sorted((out / "val" / "pages").glob("*.png"))):
        Image.open(png).convert("RGB").resize(SIZES[i % len(SIZES)]).save(png)
    return out


def _train(model_dir: str, pages: Path, out: Path, **over: object) -> Path:
    extra = {
        "model.path": model_dir,
        "model.lora_r": 4,
        "model.lora_alpha": 8,
        "model.matryoshka_dims": "[16,32]",
        "data.eval": pages / "val",
        "data.test": "",
        "data.max_visual_tokens": 16,
        "data.max_text_len": 16,
        "objective.hard_negatives": 2,
        "objective.grad_cache_chunk": 0,
        "data.batch_size": 4,
        "data.eval_batch_size": 7,
        **over,
    }
    _one_process("qwen3vl_embed_pages.yaml", pages, out, extra)
    return out


@pytest.fixture(scope="module")
def trained(
    qwen3vl_dir: str,  # noqa: F811
    mixed_pages: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    return _train(qwen3vl_dir, mixed_pages, tmp_path_factory.mktemp("evinv") / "run")


def _split(pages: Path) -> list[str]:
    val = pages / "val"
    return [str(val / "queries.jsonl"), str(val / "corpus.jsonl"), str(val / "qrels.tsv")]


def _plain(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if k not in TIMINGS}


def _batched_embed(stage, encoder, sides: list[dict], role: str, bs: int) -> torch.Tensor:
    """The negative control: one padded forward per batch (the evaluator's old path)."""
    ev, out = stage.corpus, []
    for start in range(0, len(sides), bs):
        chunk = sides[start : start + bs]
        loaded = [load_side(s, ev.image_size, ev.native, DEFAULT_MAX_PIXELS, role) for s in chunk]
        kind = "image" if "image" in chunk[0] else "text"
        inputs, _ = side_inputs(ev.batcher, role, kind, loaded, [""] * len(chunk))
        out.append(encode_side(encoder, kind, to_device(inputs, torch.device("cpu"))).float())
    return torch.cat(out)


@pytest.mark.slow
def test_metrics_equal_over_batch_sizes_and_in_training(
    trained: Path, mixed_pages: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    by_batch = {
        b: _plain(eval_command(str(trained), *_split(mixed_pages), batch_size=b)) for b in BATCHES
    }
    assert by_batch[1] == by_batch[7] == by_batch[64]
    assert by_batch[1]["n_docs"] == 16 and by_batch[1]["qrels_missing_docs"] == 0
    in_training = _in_training(trained)  # at eval batch size 7
    assert {k: v for k, v in in_training.items() if k in by_batch[1]} == by_batch[1]
    assert set(by_batch[1]) - set(in_training) == set()
    # model.matryoshka_dims: the in-training corpus evaluation scores each prefix as
    # `vltrain eval --dims` does (it reported none, and best_metric=eval_d16_* crashed)
    dims = _plain(eval_command(str(trained), *_split(mixed_pages), dims=(16, 32)))
    prefixed = {k: v for k, v in dims.items() if k.startswith(("d16_", "d32_"))}
    assert "d16_R@1" in prefixed and "d32_nDCG@10" in prefixed
    assert {k: v for k, v in in_training.items() if k.startswith(("d16_", "d32_"))} == prefixed
    # qrels naming a document absent from the corpus: counted, warned about, left out
    qrels = tmp_path / "qrels.tsv"
    qrels.write_text(Path(_split(mixed_pages)[2]).read_text() + "q000000\tghost\t1\n")
    capsys.readouterr()
    ghost = _plain(eval_command(str(trained), *_split(mixed_pages)[:2], str(qrels)))
    assert "1 rows name docs absent from the corpus file ('ghost')" in capsys.readouterr().err
    assert ghost == {**by_batch[1], "qrels_missing_docs": 1.0}
    # the embeddings themselves, not only their ranks (a tiny random model's page scores lie
    # within 0.005 of each other: metrics alone could agree by luck)
    _, stage, model = load_trained(trained)
    split = read_split_dir(mixed_pages / "val")
    for sides, role in ((split.queries, "query"), (split.docs, "doc")):
        emb = {b: stage.corpus.embed(model.encoder, sides, role, b)[0] for b in BATCHES}
        assert torch.equal(emb[1], emb[7]) and torch.equal(emb[1], emb[64]), role
        # negative control: batched forwards over these padded batches do move in the last bits
        if role == "doc":
            with torch.no_grad():
                batched = {b: _batched_embed(stage, model.encoder, sides, role, b) for b in BATCHES}
            assert torch.allclose(batched[1], emb[1], atol=1e-5)
            assert not torch.equal(batched[1], batched[7])
            assert not torch.equal(batched[7], emb[7])


def _torchrun_eval(ckpt: Path, pages: Path, out: Path, nproc: int, *extra: str) -> dict:
    """`vltrain eval` through the CLI under torchrun, as users run it."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "vltrain",
        "eval",
        str(ckpt),
        "--queries",
        *_split(pages)[:1],
        "--corpus",
        _split(pages)[1],
        "--qrels",
        _split(pages)[2],
        "--out",
        str(out),
        "--ranks",
        str(out.with_suffix(".ranks.jsonl")),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process(
    trained: Path, mixed_pages: Path, tmp_path: Path
) -> None:
    flags = ("--dims", "16,32", "--int8", "--batch-size", "7")
    one = _torchrun_eval(trained, mixed_pages, tmp_path / "one.json", 1, *flags)
    two = _torchrun_eval(trained, mixed_pages, tmp_path / "two.json", 2, *flags)
    assert _plain(one) == _plain(two)
    assert "d16_R@1" in one and "int8_R@1" in one and "d32_int8_nDCG@10" in one
    ranks_one = (tmp_path / "one.ranks.jsonl").read_text()
    assert ranks_one == (tmp_path / "two.ranks.jsonl").read_text() and ranks_one
    # and the in-process eval at another batch size
    here = _plain(
        eval_command(str(trained), *_split(mixed_pages), batch_size=64, dims=(16, 32), int8=True)
    )
    assert here == _plain(one)


def _in_training(run: Path) -> dict[str, float]:
    """The last in-training evaluation's metrics, without the ``eval_`` prefix."""
    evals = [r for r in _rows(run) if "eval_R@1" in r]
    assert evals, "the run evaluated its corpus split"
    return {k[len("eval_") :]: v for k, v in evals[-1].items() if k.startswith("eval_")}


@pytest.mark.slow
def test_bf16_run_evaluates_as_in_training(
    qwen3vl_dir: str,  # noqa: F811
    mixed_pages: Path,
    tmp_path: Path,
) -> None:
    """`vltrain eval` of a bf16 run embeds under the run's bf16 autocast, as training did."""
    run = _train(qwen3vl_dir, mixed_pages, tmp_path / "bf16", **{"run.precision": "bf16"})
    got = {b: _plain(eval_command(str(run), *_split(mixed_pages), batch_size=b)) for b in (1, 7)}
    assert got[1] == got[7]
    assert {k: v for k, v in _in_training(run).items() if k in got[1]} == got[1]
    # load_run embeds as evaluation does: under the run's bf16 autocast (it ran in fp32)
    from vltrain import load_run

    split = read_split_dir(mixed_pages / "val")
    _, stage, model = load_trained(run)
    with torch.no_grad(), stage.ctx.autocast():
        want = stage.corpus.embed(model.encoder, split.queries, "query", 1)[0]
    with torch.no_grad():  # negative control: the same forward in fp32
        fp32 = stage.corpus.embed(model.encoder, split.queries, "query", 1)[0]
    texts = [q["text"] for q in split.queries]
    got_api = load_run(run).embed_texts(texts, role="query", batch_size=1)
    assert torch.equal(got_api, want) and not torch.equal(fp32, want)
