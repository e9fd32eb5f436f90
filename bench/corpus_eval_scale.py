"""Corpus evaluation at the reference scale: 4,575 queries x 36,430 documents.

    python bench/corpus_eval_scale.py --pages bench/out/pages_small/data/val --encode-docs 2000

Phases, each timed: encode (the built-in tiny towers of configs/pages.yaml through the
evaluation path: page images decoded, batched, embedded; measured on --encode-docs pages and
queries and reported as a rate), search (the exact kernel over the full 4,575 x 36,430 at the
tower's embedding width, one pass for top-10 and ranks) and metrics (R@k, MRR, graded nDCG).
Peak resident memory of the process is reported at the end.
"""

from __future__ import annotations

import argparse
import platform
import resource
import time
from pathlib import Path

import torch

from vltrain.config import load_config
from vltrain.engine.runtime import RunContext
from vltrain.eval import corpus
from vltrain.stages import check_config

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pages", default="bench/out/pages_small/data/val")
    p.add_argument("--queries", type=int, default=4575)
    p.add_argument("--docs", type=int, default=36430)
    p.add_argument("--encode-docs", type=int, default=2000)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    pages = (ROOT / a.pages).resolve()
    out = ROOT / "bench/out/corpus_eval_scale"
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    train = pages.parent / "train.jsonl"
    cfg = load_config(
        ROOT / "configs/pages.yaml",
        [
            f"data.train={train}",
            f"data.eval={pages}",
            "data.test=",
            f"run.out_dir={out}",
            "data.eval_batch_size=128",
        ],
    )
    ctx = RunContext(torch.device("cpu"), rank=0, world_size=1, precision="fp32", seed=0)
    stage = check_config(cfg)(cfg, out, ctx)
    stage.prepare()
    model = stage.build_model().eval()
    split = corpus.read_split_dir(pages)
    n = min(a.encode_docs, len(split.docs))
    t = time.perf_counter()
    d_emb, _, _ = stage.corpus.embed(model.encoder, split.docs[:n], "doc")
    doc_rate = n / (time.perf_counter() - t)
    t = time.perf_counter()
    q_emb, _, _ = stage.corpus.embed(model.encoder, split.queries, "query")
    q_rate = len(split.queries) / (time.perf_counter() - t)
    dim = d_emb.shape[1]
    g = torch.Generator().manual_seed(0)
    q = torch.nn.functional.normalize(torch.randn(a.queries, dim, generator=g), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(a.docs, dim, generator=g), dim=-1)
    qrels = [{int(j): 1} for j in torch.randint(a.docs, (a.queries,), generator=g)]
    t = time.perf_counter()
    _, ranks, top = corpus.corpus_metrics(q, d, qrels)  # search + metrics
    both = time.perf_counter() - t
    t = time.perf_counter()
    corpus.graded_ndcg(top, qrels)
    ndcg_s = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    enc_full = a.docs / doc_rate + a.queries / q_rate
    print(
        f"CPU {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{a.threads} threads, embed dim {dim}"
    )
    print("| phase | measured | at 4,575 x 36,430 |")
    print("|---|---|---|")
    print(
        f"| encode docs (96x96 pages) | {doc_rate:.0f} docs/s over {n} | "
        f"{a.docs / doc_rate:.0f} s |"
    )
    print(
        f"| encode queries (text) | {q_rate:.0f} queries/s over {len(split.queries)} | "
        f"{a.queries / q_rate:.0f} s |"
    )
    print(f"| search (exact top-10 + ranks) | {both - ndcg_s:.2f} s | {both - ndcg_s:.2f} s |")
    print(f"| metrics (R@k, MRR, graded nDCG) | {ndcg_s:.2f} s | {ndcg_s:.2f} s |")
    print(f"| total | | {enc_full + both:.0f} s |")
    print(f"peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()
