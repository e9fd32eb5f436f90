"""Exactness of chunked retrieval against a brute-force full-matrix reference."""

from __future__ import annotations

import json
import math

import pytest
import torch

from vltrain.eval import topk
from vltrain.eval.retrieval import (
    evaluate_retrieval,
    image_text_retrieval,
    per_query_metrics,
    rank_of_positives,
)
from vltrain.eval.topk import topk_similarity

CHUNKINGS = [(None, None), (1, None), (7, None), (4, 5), (13, 11), (1000, 3), (3, 1000)]


def _int_data(n_q: int, n_docs: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Small-integer embeddings: every dot product is exact in fp32 whatever the blocking, and
    there are many exact ties; a few docs are exact duplicates of earlier ones."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-2, 3, (n_q, dim), generator=g).float()
    d = torch.randint(-2, 3, (n_docs, dim), generator=g).float()
    d[n_docs // 2 :: 7] = d[: len(d[n_docs // 2 :: 7])]  # duplicate docs
    return q, d


def _ref_order(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full (Q, N) matrix, stable descending sort: equal scores keep lower doc index first."""
    s = q.double() @ d.double().T
    vals, idx = torch.sort(s, dim=1, descending=True, stable=True)
    return vals, idx


def _ref_ranks(q, d, positives, ties="index"):
    s = q.double() @ d.double().T
    _, order = _ref_order(q, d)
    ranks = []
    for i, pos in enumerate(positives):
        if ties == "index":
            where = [order[i].tolist().index(p) for p in pos]
            ranks.append(min(where) + 1)
        else:
            best = max(float(s[i, p]) for p in pos)
            ranks.append(int((s[i] > best).sum()) + 1)
    return torch.tensor(ranks)


def _random_positives(n_q: int, n_docs: int, seed: int, max_pos: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_q):
        n = int(torch.randint(1, max_pos + 1, (1,), generator=g))
        out.append(torch.randint(0, n_docs, (n,), generator=g).tolist())
    return out


@pytest.mark.parametrize("chunk_size,doc_chunk_size", CHUNKINGS)
@pytest.mark.parametrize("k", [1, 3, 10, 50])
def test_topk_equals_bruteforce_with_ties(chunk_size, doc_chunk_size, k):
    q, d = _int_data(23, 50, 6, seed=k)
    ref_vals, ref_idx = _ref_order(q, d)
    vals, idx = topk_similarity(q, d, k, chunk_size=chunk_size, doc_chunk_size=doc_chunk_size)
    assert vals.shape == idx.shape == (23, k) and idx.dtype == torch.long
    assert torch.equal(idx, ref_idx[:, :k])
    assert torch.equal(vals.double(), ref_vals[:, :k])


@pytest.mark.parametrize("n_docs,k", [(3001, 1), (3001, 10), (2048, 5), (4000, 20)])
@pytest.mark.parametrize("doc_chunk_size", [None, 1500])
def test_grouped_topk_equals_bruteforce_on_large_blocks(n_docs, k, doc_chunk_size):
    """Blocks wide enough for the candidate-group selection (M // 16 >= 8 (k + 1)); integer data
    has many exact ties at the k-th place and duplicate docs, which force the exact redo."""
    q, d = _int_data(37, n_docs, 5, seed=n_docs + k)
    ref_vals, ref_idx = _ref_order(q, d)
    vals, idx = topk_similarity(q, d, k, chunk_size=16, doc_chunk_size=doc_chunk_size)
    assert torch.equal(idx, ref_idx[:, :k])
    assert torch.equal(vals.double(), ref_vals[:, :k])


def test_grouped_topk_selects_from_groups_on_untied_data(monkeypatch):
    """Random floats (no ties): the group path answers every row without the full top-k, and
    the answer still equals brute force (negative control: the full top-k is never called)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(50, 16, generator=g)
    d = torch.randn(5003, 16, generator=g)  # 5003 % 16 = 11 tail columns
    ref_vals, ref_idx = _ref_order(q, d)

    def no_full_topk(*args):
        raise AssertionError("full top-k used on untied data")

    monkeypatch.setattr(topk, "_plain_topk", no_full_topk)
    vals, idx = topk_similarity(q, d, 10, chunk_size=50, doc_chunk_size=5003)
    assert torch.equal(idx, ref_idx[:, :10])
    torch.testing.assert_close(vals.double(), ref_vals[:, :10], rtol=0, atol=1e-5)


def test_grouped_topk_redoes_rows_tied_with_an_unselected_group():
    """A doc outside the k best groups can tie the k-th candidate; the lower index must win."""
    d = torch.zeros(4096, 2)
    d[:, 0] = -1.0
    d[3000, 0] = 5.0  # the best doc
    d[2000, 0] = 1.0  # ties with docs 1000 and 3500 for second place; 1000 has the lowest index
    d[1000, 0] = 1.0
    d[3500, 0] = 1.0
    q = torch.tensor([[1.0, 0.0]])
    vals, idx = topk_similarity(q, d, 2, doc_chunk_size=4096)
    assert idx.tolist() == [[3000, 1000]] and vals.tolist() == [[5.0, 1.0]]


def test_data_really_has_boundary_ties():
    """Negative control for the test above: without tie handling, topk alone would differ."""
    q, d = _int_data(23, 50, 6, seed=3)
    ref_vals, _ = _ref_order(q, d)
    assert bool((ref_vals[:, 2] == ref_vals[:, 3]).any())  # ties straddle the k=3 boundary


def test_topk_all_docs_tied_returns_lowest_indices():
    q = torch.randn(5, 4)
    d = torch.zeros(100, 4)
    vals, idx = topk_similarity(q, d, 7, chunk_size=2, doc_chunk_size=30)
    assert torch.equal(idx, torch.arange(7).expand(5, 7))
    assert bool((vals == 0).all())


def test_topk_random_float_data_matches_bruteforce():
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(64, 32, generator=g), dim=1)
    d = torch.nn.functional.normalize(torch.randn(333, 32, generator=g), dim=1)
    ref_vals, ref_idx = _ref_order(q, d)
    for cs, dcs in [(None, None), (10, 100)]:
        vals, idx = topk_similarity(q, d, 10, chunk_size=cs, doc_chunk_size=dcs)
        assert torch.equal(idx, ref_idx[:, :10])
        torch.testing.assert_close(vals.double(), ref_vals[:, :10], rtol=0, atol=1e-6)


def test_topk_matches_faiss_flat_ip():
    faiss = pytest.importorskip("faiss")
    g = torch.Generator().manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(50, 48, generator=g), dim=1)
    d = torch.nn.functional.normalize(torch.randn(500, 48, generator=g), dim=1)
    index = faiss.IndexFlatIP(48)
    index.add(d.numpy())
    f_vals, f_idx = index.search(q.numpy(), 10)
    vals, idx = topk_similarity(q, d, 10)
    assert torch.equal(idx, torch.from_numpy(f_idx).long())  # no near-ties at this seed
    torch.testing.assert_close(vals, torch.from_numpy(f_vals), rtol=0, atol=1e-5)


def test_topk_k_equals_n_is_full_order_and_k_above_n_raises():
    q, d = _int_data(4, 9, 3, seed=5)
    _, idx = topk_similarity(q, d, 9, doc_chunk_size=4)
    assert torch.equal(idx, _ref_order(q, d)[1])
    with pytest.raises(ValueError, match="k=10 must be in"):
        topk_similarity(q, d, 10)
    with pytest.raises(ValueError, match="k=0"):
        topk_similarity(q, d, 0)


@pytest.mark.parametrize("ties", ["index", "optimistic"])
@pytest.mark.parametrize("chunk_size,doc_chunk_size", CHUNKINGS)
def test_rank_of_positives_equals_bruteforce(ties, chunk_size, doc_chunk_size):
    q, d = _int_data(31, 60, 5, seed=7)
    positives = _random_positives(31, 60, seed=8)
    ref = _ref_ranks(q, d, positives, ties)
    got = rank_of_positives(q, d, positives, chunk_size, doc_chunk_size, ties=ties)
    assert got.dtype == torch.long
    assert torch.equal(got, ref)


def test_tie_rules_differ_on_tied_data():
    """Negative control: the data has positives tied with lower-index docs."""
    q, d = _int_data(31, 60, 5, seed=7)
    positives = _random_positives(31, 60, seed=8)
    assert not torch.equal(
        rank_of_positives(q, d, positives), rank_of_positives(q, d, positives, ties="optimistic")
    )


def test_ranks_agree_with_topk_lists():
    q, d = _int_data(40, 70, 4, seed=11)
    positives = _random_positives(40, 70, seed=12)
    ranks = rank_of_positives(q, d, positives, chunk_size=9)
    _, idx = topk_similarity(q, d, 10, chunk_size=9)
    for i, pos in enumerate(positives):
        hits = [j for j, doc in enumerate(idx[i].tolist()) if doc in pos]
        if int(ranks[i]) <= 10:
            assert hits and hits[0] + 1 == int(ranks[i])
        else:
            assert not hits


def _score_docs(n_docs: int) -> torch.Tensor:
    return torch.eye(n_docs)  # then a query's embedding IS its score vector


def test_metrics_hand_made():
    d = _score_docs(12)
    base = torch.linspace(1.0, 0.0, 12)  # doc j has the (j+1)-th highest score
    queries = torch.stack([base, base, base, base.flip(0)])
    positives = [[0], [2], [0, 3], [0]]
    # ranks: 1, 3, 1 (best of 1 and 4), 12 (doc 0 is now last)
    m = evaluate_retrieval(queries, d, positives, ks=(1, 5, 10))
    assert m["R@1"] == pytest.approx(2 / 4)
    assert m["R@5"] == pytest.approx(3 / 4)
    assert m["R@10"] == pytest.approx(3 / 4)
    assert m["MRR@10"] == pytest.approx((1 + 1 / 3 + 1 + 0) / 4)
    ndcg = [1.0, 1 / math.log2(4), (1 + 1 / math.log2(5)) / (1 + 1 / math.log2(3)), 0.0]
    assert m["nDCG@10"] == pytest.approx(sum(ndcg) / 4)
    assert m["mean_rank"] == pytest.approx((1 + 3 + 1 + 12) / 4)
    assert m["median_rank"] == pytest.approx(1.0)  # torch median: lower middle value
    assert m["n_queries"] == 4


def test_ndcg_ideal_caps_at_ten_positives():
    d = _score_docs(30)
    q = torch.linspace(1.0, 0.0, 30)[None]
    m = evaluate_retrieval(q, d, [list(range(15))])  # top-10 all relevant, 15 positives
    assert m["nDCG@10"] == pytest.approx(1.0)
    m = evaluate_retrieval(q, d, [list(range(1, 16))])  # position 1 irrelevant
    disc = [1 / math.log2(i + 2) for i in range(10)]
    assert m["nDCG@10"] == pytest.approx(sum(disc[1:]) / sum(disc))


def test_recall_k_beyond_corpus_and_tiny_corpus():
    d = _score_docs(4)
    q = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    m = evaluate_retrieval(q, d, [[0]], ks=(1, 4, 50))
    assert (m["R@1"], m["R@4"], m["R@50"]) == (0.0, 1.0, 1.0)
    assert m["MRR@10"] == pytest.approx(1 / 4)


def test_shuffled_positives_give_chance_recall():
    g = torch.Generator().manual_seed(0)
    n, dim = 400, 32
    d = torch.nn.functional.normalize(torch.randn(n, dim, generator=g), dim=1)
    q = torch.nn.functional.normalize(d + 0.1 * torch.randn(n, dim, generator=g), dim=1)
    true = [[i] for i in range(n)]
    good = evaluate_retrieval(q, d, true)
    perm = torch.randperm(n, generator=g).tolist()
    shuffled = evaluate_retrieval(q, d, [[perm[i]] for i in range(n)])
    assert good["R@1"] > 0.95
    assert shuffled["R@10"] < 3 * 10 / n  # chance is 10/n = 0.025
    assert shuffled["mean_rank"] == pytest.approx(n / 2, rel=0.2)


def test_ranks_path_jsonl_and_max_queries(tmp_path):
    q, d = _int_data(12, 15, 4, seed=2)
    positives = _random_positives(12, 15, seed=3)
    path = tmp_path / "sub" / "ranks.jsonl"
    m = evaluate_retrieval(q, d, positives, max_queries=5, ranks_path=path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert m["n_queries"] == 5 and [r["query"] for r in rows] == list(range(5))
    ref_ranks = _ref_ranks(q[:5], d, positives[:5])
    assert [r["rank"] for r in rows] == ref_ranks.tolist()
    assert [r["top10"] for r in rows] == _ref_order(q[:5], d)[1][:, :10].tolist()


def test_per_query_metrics_shards_combine_to_whole():
    q, d = _int_data(20, 30, 4, seed=9)
    positives = _random_positives(20, 30, seed=10)
    ranks = rank_of_positives(q, d, positives)
    _, top = topk_similarity(q, d, 10)
    whole = per_query_metrics(ranks, top, positives, (1, 5))
    a = per_query_metrics(ranks[:7], top[:7], positives[:7], (1, 5))
    b = per_query_metrics(ranks[7:], top[7:], positives[7:], (1, 5))
    for key, v in whole.items():
        assert torch.equal(torch.cat([a[key], b[key]]), v)
    assert float(whole["R@5"].mean()) == evaluate_retrieval(q, d, positives, ks=(5,))["R@5"]


def _naive_image_text(img, txt, t2i, k):
    s = img.double() @ txt.double().T  # (I, T)
    i2t = [
        bool(
            set(s[i].argsort(descending=True)[:k].tolist())
            & set((t2i == i).nonzero().squeeze(1).tolist())
        )
        for i in range(len(img))
    ]
    t2i_hits = [
        int(t2i[t]) in s[:, t].argsort(descending=True)[:k].tolist() for t in range(len(txt))
    ]
    return sum(i2t) / len(i2t), sum(t2i_hits) / len(t2i_hits)


def test_image_text_retrieval_matches_naive_coco_protocol():
    g = torch.Generator().manual_seed(4)
    n_img, per, dim = 40, 5, 16
    img = torch.nn.functional.normalize(torch.randn(n_img, dim, generator=g), dim=1)
    t2i = torch.arange(n_img).repeat_interleave(per)
    txt = torch.nn.functional.normalize(
        img[t2i] + 0.8 * torch.randn(n_img * per, dim, generator=g), dim=1
    )
    m = image_text_retrieval(img, txt, t2i)
    for k in (1, 5, 10):
        ref_i2t, ref_t2i = _naive_image_text(img, txt, t2i, k)
        assert m[f"i2t_R@{k}"] == pytest.approx(ref_i2t)
        assert m[f"t2i_R@{k}"] == pytest.approx(ref_t2i)
    for key in ("i2t_MRR@10", "i2t_nDCG@10", "t2i_MRR@10", "t2i_nDCG@10"):
        assert 0.0 < m[key] <= 1.0
    assert 0.2 < m["i2t_R@1"] < 1.0  # not trivially perfect: the naive comparison is informative


def test_image_text_hand_made():
    img = torch.eye(3)
    # captions 0,1 -> image 0; 2 -> image 1; 3 -> image 2 (caption 3 looks like image 1)
    txt = torch.tensor([[1.0, 0, 0], [0.9, 0.1, 0], [0, 1.0, 0], [0, 0.95, 0.2]])
    m = image_text_retrieval(img, txt, torch.tensor([0, 0, 1, 2]), ks=(1, 2))
    assert m["t2i_R@1"] == pytest.approx(3 / 4) and m["t2i_R@2"] == pytest.approx(1.0)
    # image 2's best caption is 3 at rank 1 (scores 0, 0, 0, 0.2)
    assert m["i2t_R@1"] == pytest.approx(1.0)
    # image 0: captions 0, 1 at positions 1, 2 -> nDCG 1
    assert m["i2t_nDCG@10"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: topk_similarity(torch.randn(3, 4), torch.randn(5, 3), 1), "dim 4 != docs dim 3"),
        (lambda: topk_similarity(torch.randn(3), torch.randn(5, 3), 1), "2-D"),
        (lambda: topk_similarity(torch.full((2, 3), math.nan), torch.randn(5, 3), 1), "NaN"),
        (lambda: topk_similarity(torch.randn(2, 3), torch.randn(5, 3), 1, chunk_size=0), "chunk"),
        (lambda: rank_of_positives(torch.randn(2, 3), torch.randn(5, 3), [[1], []]), "query 1"),
        (lambda: rank_of_positives(torch.randn(2, 3), torch.randn(5, 3), [[1], [5]]), "outside"),
        (lambda: rank_of_positives(torch.randn(2, 3), torch.randn(5, 3), [[1]]), "1 entries"),
        (lambda: rank_of_positives(torch.randn(1, 3), torch.randn(5, 3), [[1]], ties="x"), "ties"),
        (
            lambda: image_text_retrieval(
                torch.randn(3, 4), torch.randn(2, 4), torch.tensor([0, 1])
            ),
            "no caption",
        ),
    ],
)
def test_errors_are_explained(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_auto_doc_chunking_when_rows_exceed_budget(monkeypatch):

    monkeypatch.setattr(topk, "_BLOCK_BYTES", 4 * 40 * 14)  # whole rows do not fit
    assert topk.chunk_sizes(40, 70, None, None) == (40, 14)
    q, d = _int_data(40, 70, 4, seed=13)
    positives = _random_positives(40, 70, seed=14)
    _, idx = topk_similarity(q, d, 10)
    assert torch.equal(idx, _ref_order(q, d)[1][:, :10])
    assert torch.equal(rank_of_positives(q, d, positives), _ref_ranks(q, d, positives))


def test_torch_matmul_path_equals_numpy_path(monkeypatch):

    assert topk._np is not None  # the default CPU path is the numpy one
    q, d = _int_data(30, 45, 5, seed=15)
    positives = _random_positives(30, 45, seed=16)
    by_numpy = (topk_similarity(q, d, 10, 7, 11), rank_of_positives(q, d, positives, 7, 11))
    monkeypatch.setattr(topk, "_np", None)
    by_torch = (topk_similarity(q, d, 10, 7, 11), rank_of_positives(q, d, positives, 7, 11))
    assert torch.equal(by_torch[0][1], by_numpy[0][1]) and torch.equal(by_torch[1], by_numpy[1])
    assert torch.equal(by_torch[0][1], _ref_order(q, d)[1][:, :10])


def test_float64_and_grad_inputs():
    q, d = _int_data(6, 20, 3, seed=17)
    vals, idx = topk_similarity(q.double().requires_grad_(), d, 5)
    assert vals.dtype == torch.float64 and not vals.requires_grad
    assert torch.equal(idx, _ref_order(q, d)[1][:, :5])


def test_parallel_cpu_workers_equal_one_worker(monkeypatch):
    """Query ranges on parallel threads (single-threaded kernels) = the sequential scan; the
    torch thread count is restored afterwards."""
    g = torch.Generator().manual_seed(5)
    q = torch.nn.functional.normalize(torch.randn(301, 24, generator=g), dim=1)
    d = torch.nn.functional.normalize(torch.randn(2500, 24, generator=g), dim=1)
    positives = _random_positives(301, 2500, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert topk.cpu_workers(q.device, 10) == 2
        par_top = topk_similarity(q, d, 10, chunk_size=32)
        par_ranks = rank_of_positives(q, d, positives, chunk_size=32, doc_chunk_size=700)
        par_metrics = evaluate_retrieval(q, d, positives, chunk_size=32)
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(topk, "_threadpoolctl", None)  # one worker
        assert topk.cpu_workers(q.device, 10) == 1
        assert torch.equal(topk_similarity(q, d, 10, chunk_size=32)[1], par_top[1])
        one = rank_of_positives(q, d, positives, chunk_size=32, doc_chunk_size=700)
        assert torch.equal(one, par_ranks)
        assert evaluate_retrieval(q, d, positives, chunk_size=32) == par_metrics
    finally:
        torch.set_num_threads(threads)
    ref_vals, ref_idx = _ref_order(q, d)
    assert torch.equal(par_top[1], ref_idx[:, :10])


def test_default_cpu_topk_blocks_split_evenly_and_stay_exact():
    """CPU top-k default: doc blocks of _TOPK_DOC_CHUNK, equal query chunks per worker, the
    shared block budget respected; a corpus wider than one doc block is still exact."""
    for n_q, n_docs, workers in [(4575, 36430, 2), (10, 5, 1), (100_000, 9000, 8), (7, 9000, 2)]:
        qc, dc = topk._topk_chunk_sizes(n_q, n_docs, workers)
        assert dc == min(n_docs, topk._TOPK_DOC_CHUNK)
        assert workers * qc * dc * 4 <= topk._BLOCK_BYTES or qc == 1
        chunks = math.ceil(n_q / qc)
        assert chunks % workers == 0 or chunks < workers  # every worker gets as many chunks
    assert topk._topk_chunk_sizes(4575, 36430, 2) == (1144, 8192)
    q, d = _int_data(30, 9000, 5, seed=9)
    ref_vals, ref_idx = _ref_order(q, d)
    vals, idx = topk_similarity(q, d, 10)
    assert torch.equal(idx, ref_idx[:, :10]) and torch.equal(vals.double(), ref_vals[:, :10])
