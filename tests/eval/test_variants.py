"""Matryoshka-prefix and int8 settings of corpus evaluation against brute-force computations."""

from __future__ import annotations

import pytest
import torch

from vltrain.config.core import ConfigError
from vltrain.eval import corpus, variants


def _embeddings(q: torch.Tensor, d: torch.Tensor, qrels: list[dict[int, int]]):
    return corpus.SplitEmbeddings(
        queries=q,
        docs=d,
        qrels=qrels,
        judged=[[] for _ in qrels],
        query_ids=[f"q{i}" for i in range(len(qrels))],
        doc_ids=[f"d{i}" for i in range(d.shape[0])],
        groups=[None] * len(qrels),
        bad=0,
        encode_s=0.0,
    )


def test_prefix_and_int8_settings_score_the_transformed_embeddings() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(20, 32, generator=g), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(60, 32, generator=g), dim=-1)
    qrels = [{i: 1, i + 20: 2} for i in range(20)]
    m = variants.variant_metrics(_embeddings(q, d, qrels), dims=(8, 16), int8=True)
    for key, dim, quantise in (("d8_", 8, False), ("d16_", 16, False), ("int8_", 32, True)):
        qq = torch.nn.functional.normalize(q[:, :dim], dim=-1)
        dd = torch.nn.functional.normalize(d[:, :dim], dim=-1)
        if quantise:
            qq, dd = variants.int8_roundtrip(qq), variants.int8_roundtrip(dd)
        want = corpus.corpus_metrics(qq, dd, qrels)[0]
        assert {k: m[key + k] for k in ("R@1", "R@5", "MRR@10", "nDCG@10")} == {
            k: want[k] for k in ("R@1", "R@5", "MRR@10", "nDCG@10")
        }
    assert "d16_int8_R@1" in m and "int8_n_docs" not in m
    # the prefixes are re-normalised and really shorter: 8 of 32 random dims rank differently
    assert m["d8_nDCG@10"] != corpus.corpus_metrics(q, d, qrels)[0]["nDCG@10"]


def test_int8_roundtrip_is_per_vector_symmetric() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25], [100.0, 3.0, -50.0]])
    r = variants.int8_roundtrip(x)
    scale = x.abs().amax(dim=-1, keepdim=True) / 127
    assert torch.allclose(r.abs().amax(-1), x.abs().amax(-1))  # the largest is exact
    assert ((r - x).abs() <= scale / 2 + 1e-6).all()  # within half a step of its own scale
    assert torch.equal(r / scale, (r / scale).round())  # on the int8 grid


def test_dims_must_be_increasing_positive_and_fit() -> None:
    variants.check_dims((64, 128), 128)
    for bad in ((128, 64), (0, 8), (8, 8)):
        with pytest.raises(ConfigError, match="increasing positive"):
            variants.check_dims(bad)
    with pytest.raises(ConfigError, match="256 is above the embedding width 128"):
        variants.check_dims((64, 256), 128)


def test_cli_rejects_bad_dims_before_loading(tmp_path, capsys) -> None:
    from vltrain.cli import main

    files = []
    for name in ("queries.jsonl", "corpus.jsonl", "qrels.tsv"):
        (tmp_path / name).write_text("")
        files += [f"--{name.split('.')[0]}", str(tmp_path / name)]
    for dims, says in (("128,64", "increasing positive"), ("64,x", "comma-separated")):
        code = main(["eval", str(tmp_path / "no_such_run"), *files, "--dims", dims])
        assert code == 2 and says in capsys.readouterr().err
