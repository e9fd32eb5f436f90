"""Hard-negative accuracy of two runs compared query by query (issue 14's "ahead on every seed").

Reads the per-query ranks files that `vltrain eval ... --ranks FILE` writes (each line holds
"hardneg": [wins, judged] for a query with judged non-relevant docs) for pairs of runs on the
same split, and prints per pair: each run's hard-negative accuracy, the difference with its
paired standard error (per-query differences), the discordant queries (won by one run only) and
McNemar's exact two-sided p over them; plus R@1 of each run from the same files.

    python bench/pages_hn_paired.py P0.ranks.jsonl:H0.ranks.jsonl P1...:H1... [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def read(path: str) -> dict[str, dict]:
    """query id -> its ranks-file row."""
    return {r["query"]: r for r in map(json.loads, Path(path).read_text().splitlines())}


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p: P(a Binomial(b + c, 1/2) count at least as far from the mean)."""
    n, k = b + c, min(b, c)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def compare(a_path: str, b_path: str) -> dict[str, float]:
    """Run B against run A on the queries both judged (B's accuracy minus A's)."""
    a, b = read(a_path), read(b_path)
    if set(a) != set(b):
        raise SystemExit(f"{a_path} and {b_path} rank different queries")
    diffs, only_a, only_b, acc_a, acc_b, n = [], 0, 0, 0.0, 0.0, 0
    for q, ra in a.items():
        rb = b[q]
        if "hardneg" not in ra:
            continue
        (wa, ta), (wb, tb) = ra["hardneg"], rb["hardneg"]
        xa, xb = wa / ta, wb / tb
        acc_a, acc_b, n = acc_a + xa, acc_b + xb, n + 1
        diffs.append(xb - xa)
        only_a += int(xa > xb)
        only_b += int(xb > xa)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    r1 = {k: sum(r["rank"] == 1 for r in v.values()) / len(v) for k, v in (("a", a), ("b", b))}
    return {
        "queries": n,
        "hardneg_acc_a": acc_a / n,
        "hardneg_acc_b": acc_b / n,
        "diff_b_minus_a": mean,
        "paired_se": math.sqrt(var / n),
        "won_by_a_only": only_a,
        "won_by_b_only": only_b,
        "mcnemar_p": mcnemar_p(only_a, only_b),
        "R@1_a": r1["a"],
        "R@1_b": r1["b"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pairs", nargs="+", help="A.ranks.jsonl:B.ranks.jsonl (B is compared to A)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    out = {}
    head = "| pair | queries | hard-neg acc A | B | B - A (paired SE) | A only / B only | p |"
    print(head + " R@1 A / B |")
    print("|---|---:|---:|---:|---|---|---:|---|")
    for pair in args.pairs:
        a, b = pair.split(":")
        r = out[pair] = compare(a, b)
        print(
            f"| {Path(a).stem} vs {Path(b).stem} | {r['queries']} | {r['hardneg_acc_a']:.4f} | "
            f"{r['hardneg_acc_b']:.4f} | {r['diff_b_minus_a']:+.4f} ({r['paired_se']:.4f}) | "
            f"{r['won_by_a_only']} / {r['won_by_b_only']} | {r['mcnemar_p']:.3g} | "
            f"{r['R@1_a']:.3f} / {r['R@1_b']:.3f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
