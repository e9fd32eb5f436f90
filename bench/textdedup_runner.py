"""text-dedup's MinHash, run the way its own `text_dedup/minhash.py` script runs it, on a file
of captions (one per line); prints its candidate pairs and timings as JSON.

Runs in a separate virtual environment that has `text-dedup` (it pins datasets, pyspark and
friends, which stay out of vltrain's environment); no vltrain import here:

    python3 -m venv /work/venv-textdedup && /work/venv-textdedup/bin/pip install text-dedup
    /work/venv-textdedup/bin/python bench/textdedup_runner.py CAPTIONS.txt --threshold 0.7

What is its own code: `embed_func` (tokenise with its NON_ALPHA split, word n-grams, sha1
32-bit shingle hashes, (a x + b) mod 2^61-1 permutations from its seeded RNG, band byte
strings), `optimal_param` (bands x rows), and the bucket tables its `main` fills. What is not:
its `datasets.map` wrapper (called per caption here, in one process) and its union-find over
buckets (we report the bucket-sharing pairs, the candidates it would union, so P/R are at the
same pair level as datasketch's `query` and vltrain's verified pairs).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("captions")
    p.add_argument("--threshold", type=float, default=0.7)
    p.add_argument("--num-perm", type=int, default=128)
    p.add_argument("--ngram", type=int, default=3)
    a = p.parse_args()
    import text_dedup
    from text_dedup import minhash as td
    from text_dedup.utils import optimal_param, sha1_hash

    with open(a.captions, encoding="utf-8") as f:
        texts = f.read().split("\n")
    t0, c0 = time.perf_counter(), time.process_time()
    b, r = optimal_param(a.threshold, a.num_perm, 0.5, 0.5)
    dtype, max_hash, prime = np.uint64, np.uint32((1 << 32) - 1), np.uint64((1 << 61) - 1)
    rng = np.random.RandomState(td.SEED)  # the script's defaults: 64-bit config, sha1
    perms = (
        rng.randint(1, prime, size=(a.num_perm,), dtype=dtype),
        rng.randint(0, prime, size=(a.num_perm,), dtype=dtype),
    )
    ranges = [(i * r, (i + 1) * r) for i in range(b)]
    tables: list[dict[bytes, set[int]]] = [defaultdict(set) for _ in range(b)]
    for idx, text in enumerate(texts):
        out = td.embed_func(
            text, idx, num_perm=a.num_perm, ngram_size=a.ngram, min_length=0,
            hashranges=ranges, permutations=perms,
            hash_func=lambda x: sha1_hash(x, d=32), dtype=dtype, max_hash=max_hash,
            modulo_prime=prime,
        )  # fmt: skip
        for i, h in enumerate(out[td.SIGNATURE_COLUMN]):
            tables[i][h].add(idx)
    pairs = set()
    for table in tables:
        for cluster in table.values():
            if len(cluster) > 1:
                ids = sorted(cluster)
                pairs.update((x, y) for k, x in enumerate(ids) for y in ids[k + 1 :])
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({
        "version": getattr(text_dedup, "__version__", None), "bands": b, "rows": r,
        "wall_s": wall, "cpu_s": cpu, "pairs": sorted(pairs),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
