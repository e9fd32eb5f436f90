"""Corpus evaluation: BEIR files, graded nDCG against a brute-force computation, metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vltrain.data.readers import DataError
from vltrain.eval import corpus


def _brute_ndcg(scores: torch.Tensor, rel: dict[int, int]) -> float:
    order = sorted(range(len(scores)), key=lambda j: (-float(scores[j]), j))[:10]
    dcg = sum(rel.get(j, 0) / math.log2(i + 2) for i, j in enumerate(order))
    ideal = sorted(rel.values(), reverse=True)[:10]
    return dcg / sum(g / math.log2(i + 2) for i, g in enumerate(ideal))


def test_metrics_match_brute_force_with_graded_qrels() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(30, 8, generator=g), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(200, 8, generator=g), dim=-1)
    qrels = [
        {int(j): 1 + (k % 3) for k, j in enumerate(torch.randperm(200, generator=g)[:4])}
        for _ in range(30)
    ]
    m, ranks, top = corpus.corpus_metrics(q, d, qrels)
    scores = q @ d.T
    want_ranks = []
    for i, rel in enumerate(qrels):
        order = sorted(range(200), key=lambda j: (-float(scores[i, j]), j))
        want_ranks.append(1 + min(order.index(j) for j in rel))
    assert ranks.tolist() == want_ranks
    for k in (1, 5, 10, 100):
        assert m[f"R@{k}"] == pytest.approx(sum(r <= k for r in want_ranks) / 30)
    ndcg = sum(_brute_ndcg(scores[i], rel) for i, rel in enumerate(qrels)) / 30
    assert m["nDCG@10"] == pytest.approx(ndcg, abs=1e-9)
    # negative control: binary gains give a different number on graded qrels
    binary = [{j: 1 for j in rel} for rel in qrels]
    assert corpus.corpus_metrics(q, d, binary)[0]["nDCG@10"] != pytest.approx(ndcg, abs=1e-6)


def test_read_split_and_judged_negatives(tmp_path: Path) -> None:
    (tmp_path / "queries.jsonl").write_text(
        '{"_id": "a", "text": "x"}\n{"_id": "b", "text": "y"}\n'
    )
    (tmp_path / "corpus.jsonl").write_text(
        '{"_id": "d0", "text": "x"}\n{"_id": "d1", "text": "y"}\n'
    )
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\na\td0\t2\na\td1\t0\n")
    split = corpus.read_split_dir(tmp_path)
    assert split.query_ids == ["a"] and split.n_no_relevant == 1  # b has no relevant doc
    assert split.qrels == [{0: 2}] and split.judged_negatives == [[1]]
    e = torch.eye(2)
    assert corpus.judged_negative_accuracy(e[:1], e, split.qrels, split.judged_negatives) == 1.0
    assert corpus.judged_negative_accuracy(e[1:], e, split.qrels, split.judged_negatives) == 0.0
    # per query, and into the ranks file: which queries lose to their hard negatives
    two = [{0: 2}, {1: 1}]  # the second query has no judged negative
    wins = corpus.judged_negative_wins(e[[1, 1]], e, two, [[1], []])
    assert wins == [(0, 1), (0, 0)] and corpus.wins_fraction(wins) == 0.0
    assert corpus.judged_negative_wins(e, e, two, [[1], []])[0] == (1, 1)
    m, ranks, top = corpus.corpus_metrics(e[[1, 1]], e, two)
    corpus.write_ranks(tmp_path / "ranks.jsonl", ["a", "b"], ["d0", "d1"], ranks, top, wins)
    rows = [json.loads(x) for x in (tmp_path / "ranks.jsonl").read_text().splitlines()]
    assert rows[0]["hardneg"] == [0, 1] and rows[0]["rank"] == 2 and "hardneg" not in rows[1]


def test_qrels_naming_absent_ids_are_counted_and_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "queries.jsonl").write_text('{"_id": "a", "text": "x"}\n')
    (tmp_path / "corpus.jsonl").write_text('{"_id": "d0", "text": "x"}\n')
    rows = "a\td0\t1\na\tzz\t1\na\tyy\t0\nghost\td0\t1\n"
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows)
    split = corpus.read_split_dir(tmp_path)
    assert split.qrels == [{0: 1}] and split.judged_negatives == [[]]
    assert split.missing == {"queries": ["ghost"], "docs": ["zz", "yy"]}
    assert corpus.missing_metrics(split) == {
        "qrels_missing_docs": 2.0,
        "qrels_missing_queries": 1.0,
    }
    line = corpus.missing_warning(split, "q.tsv")
    assert line is not None and line.startswith("warning: q.tsv: 2 rows name docs absent")
    assert "'yy', 'zz'" in line and "1 rows name queries absent from the queries file" in line
    # in training: rank 0 prints the same line once, when the evaluator first reads the split
    where = SimpleNamespace(is_main=True)
    evaluator = corpus.CorpusEvaluator(None, where, 1, 32, False, "dual_encoder")  # type: ignore[arg-type]
    evaluator.split(tmp_path)
    evaluator.split(tmp_path)
    err = capsys.readouterr().err
    assert err.count("2 rows name docs absent from the corpus file") == 1, err
    # control: a clean qrels file warns of nothing and counts zeros
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\na\td0\t1\n")
    clean = corpus.read_split_dir(tmp_path)
    assert corpus.missing_warning(clean, "q.tsv") is None
    assert set(corpus.missing_metrics(clean).values()) == {0.0}


def test_metrics_per_query_group(tmp_path: Path) -> None:
    (tmp_path / "queries.jsonl").write_text(
        '{"_id": "a", "text": "x", "group": "title"}\n'
        '{"_id": "b", "text": "y", "group": "body phrase"}\n'
        '{"_id": "c", "text": "z", "group": "title"}\n'
        '{"_id": "d", "text": "w"}\n'
    )
    (tmp_path / "corpus.jsonl").write_text(
        "".join(f'{{"_id": "d{i}", "text": "t{i}"}}\n' for i in range(4))
    )
    rows = "".join(f"{q}\td{i}\t1\n" for i, q in enumerate("abcd"))
    (tmp_path / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + rows)
    split = corpus.read_split_dir(tmp_path)
    assert split.groups == ["title", "body phrase", "title", None]
    m = corpus.group_metrics(torch.tensor([1, 3, 12, 1]), split.groups)
    assert m == {
        "R@1_title": 0.5,
        "R@5_title": 0.5,
        "MRR@10_title": 0.5,  # ranks 1 and 12 (beyond 10 counts 0)
        "n_queries_title": 2.0,
        "R@1_body_phrase": 0.0,
        "R@5_body_phrase": 1.0,
        "MRR@10_body_phrase": pytest.approx(1 / 3),
        "n_queries_body_phrase": 1.0,
    }
    assert corpus.group_metrics(torch.tensor([1, 2]), [None, None]) == {}
    with pytest.raises(ValueError, match="both become metric suffix 'a_b'"):
        corpus.group_metrics(torch.tensor([1, 2]), ["a b", "a-b"])
    with pytest.raises(ValueError, match="2 groups for 3 ranks"):
        corpus.group_metrics(torch.tensor([1, 2, 3]), ["a", "b"])
    (tmp_path / "queries.jsonl").write_text('{"_id": "a", "text": "x", "group": 3}\n')
    with pytest.raises(DataError, match="'group' must be a non-empty string"):
        corpus.read_split_dir(tmp_path)


def test_scores_stay_fp32_inside_a_bf16_autocast() -> None:
    """Training evaluates under a bf16 run's autocast; the scoring must not follow it."""
    g = torch.Generator().manual_seed(0)
    base = torch.nn.functional.normalize(torch.randn(1, 64, generator=g), dim=-1)
    noise = 1e-3 * torch.randn(40, 64, generator=g)  # near ties, as a young model's scores are
    q = torch.nn.functional.normalize(base + noise[:10], dim=-1)
    d = torch.nn.functional.normalize(base + noise[10:], dim=-1)
    qrels = [{i: 1} for i in range(10)]
    judged = [[(i + 1) % 30, (i + 2) % 30] for i in range(10)]
    emb = corpus.SplitEmbeddings(
        q, d, qrels, judged, [f"q{i}" for i in range(10)], [f"d{j}" for j in range(30)],
        [None] * 10, 0, 0.0,
    )  # fmt: skip
    want = corpus.score_split(emb)
    fp32_wins = corpus.judged_negative_wins(q, d, qrels, judged)
    assert want["hardneg_acc"] not in (0.0, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert corpus.score_split(emb) == want
        # negative control: the same comparisons with bf16 scores tie (and lose)
        assert corpus.judged_negative_wins(q, d, qrels, judged) != fp32_wins


def test_fractional_grades_are_relevant_with_their_own_gain(tmp_path: Path) -> None:
    """int(float('0.5')) read a 0.5 grade as 0: judged non-relevant (and a hard negative)."""
    (tmp_path / "queries.jsonl").write_text('{"_id": "a", "text": "x"}\n')
    (tmp_path / "corpus.jsonl").write_text(
        '{"_id": "d0", "text": "x"}\n{"_id": "d1", "text": "y"}\n{"_id": "d2", "text": "z"}\n'
    )
    (tmp_path / "qrels.tsv").write_text("a\td0\t0.5\na\td1\t1.5\na\td2\t0\n")
    split = corpus.read_split_dir(tmp_path)
    assert split.qrels == [{0: 0.5, 1: 1.5}] and split.judged_negatives == [[2]]
    e = torch.eye(3)
    m, _, _ = corpus.corpus_metrics(e[:1], e, split.qrels)  # d0 first, then d1 (ties by row)
    assert m["nDCG@10"] == pytest.approx(_brute_ndcg((e[:1] @ e.T)[0], split.qrels[0]))
    assert m["nDCG@10"] < 1.0  # the 1.5 doc belongs first
    for bad in ("nan", "inf"):
        (tmp_path / "qrels.tsv").write_text(f"a\td0\t1\na\td1\t{bad}\n")
        with pytest.raises(DataError, match="is not a number"):
            corpus.read_split_dir(tmp_path)


def test_corpus_input_mistakes_name_what_is_wrong(tmp_path: Path) -> None:
    """A duplicate query id was called a "document id"; a split folder given as --queries was
    "does not exist"; a folder missing only qrels.tsv listed every file."""
    from vltrain.config.core import ConfigError
    from vltrain.stages import load_run_config
    from vltrain.tools.eval import eval_command

    (tmp_path / "queries.jsonl").write_text(
        '{"_id": "a", "text": "x"}\n{"_id": "a", "text": "y"}\n'
    )
    (tmp_path / "corpus.jsonl").write_text('{"_id": "d0", "text": "x"}\n')
    (tmp_path / "qrels.tsv").write_text("a\td0\t1\n")
    with pytest.raises(DataError, match=r"queries\.jsonl: id 'a' appears twice"):
        corpus.read_split_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="is a folder; name its file"):
        eval_command("RUN", str(tmp_path), str(tmp_path), str(tmp_path))
    (tmp_path / "qrels.tsv").unlink()
    with pytest.raises(ConfigError, match=r"lacks qrels\.tsv beside its queries\.jsonl"):
        load_run_config(None, [f"data.eval={tmp_path}"])
