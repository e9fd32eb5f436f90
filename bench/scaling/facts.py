"""Captions with facts to memorise: the scaling demo's data (docs/scaling.md, "Demo").

The shapes captions are templated: ~50k decoder parameters model them and a larger decoder
gains nothing, so an isoFLOP sweep on them has an optimum that cannot move. This appends to
every record's captions one *fact*: a key of three pseudo-words and its value of two, from a
fixed random table of `keys` facts, the key drawn with Zipf frequencies (rank r with
probability proportional to r^-zipf). Predicting a value needs the fact stored in the weights
(capacity grows with N) and seen often enough (rare facts need more data D): the setting where
power laws in N and D appear (Michaud et al. 2023, "The quantization model of neural
scaling"; Allen-Zhu & Li 2024, "Physics of language models 3.3: knowledge capacity").
Validation records draw their facts from the same distribution, so the eval loss weights each
fact by how often it occurs. The images and every other field stay as they were.

    PYTHONPATH=. python bench/scaling/facts.py SRC DST [--keys 4000] [--zipf 1.2] [--per-record 2] \
        [--key-words 2] [--value-words 4]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"


def pseudo_words(n: int, rng: np.random.Generator) -> list[str]:
    """`n` distinct consonant-vowel-consonant-vowel words (none is an English caption word)."""
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        c = rng.choice(list(CONSONANTS), 2)
        v = rng.choice(list(VOWELS), 2)
        w = f"{c[0]}{v[0]}{c[1]}{v[1]}"
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def fact_table(
    keys: int, seed: int, words: int = 64, key_words: int = 3, value_words: int = 2
) -> list[str]:
    """`keys` facts "k1 .. : v1 .." (distinct keys of `key_words` pseudo-words, random values
    of `value_words`), in Zipf rank order."""
    rng = np.random.default_rng(seed)
    vocab = pseudo_words(words, rng)
    if keys > words**key_words:
        raise ValueError(f"{keys} keys need more than {key_words} key words of {words}")
    ids = rng.choice(words**key_words, size=keys, replace=False)
    values = rng.integers(0, words, size=(keys, value_words))
    out = []
    for k, vals in zip(ids, values, strict=True):
        key = [(int(k) // words**i) % words for i in reversed(range(key_words))]
        out.append(" ".join(vocab[i] for i in key) + " : " + " ".join(vocab[v] for v in vals))
    return out


def zipf_probs(keys: int, zipf: float) -> np.ndarray:
    p = np.arange(1, keys + 1, dtype=np.float64) ** -zipf
    return p / p.sum()


def add_facts(
    src: Path,
    dst: Path,
    keys: int,
    zipf: float,
    seed: int,
    per_record: int = 1,
    key_words: int = 3,
    value_words: int = 2,
) -> dict[str, int]:
    """Write DST/<split>.jsonl = SRC's records with `per_record` facts appended to each
    caption (each split draws from its own seed); DST/images holds hard links to SRC's
    images (a symlink would point outside the data folder, which the loader refuses)."""
    (dst / "images").mkdir(parents=True, exist_ok=True)
    for f in (src / "images").iterdir():
        if not (dst / "images" / f.name).exists():
            os.link(f, dst / "images" / f.name)
    table = fact_table(keys, seed, key_words=key_words, value_words=value_words)
    probs = zipf_probs(keys, zipf)
    counts = {}
    for split_no, split in enumerate(("train", "val", "test")):
        path = src / f"{split}.jsonl"
        if not path.exists():
            continue
        lines = [x for x in path.read_text().splitlines() if x.strip()]
        rng = np.random.default_rng([seed, split_no])
        draws = rng.choice(keys, size=(len(lines), per_record), p=probs)
        out = []
        for line, ks in zip(lines, draws, strict=True):
            rec = json.loads(line)
            texts = rec["text"] if isinstance(rec["text"], list) else [rec["text"]]
            tail = " ; ".join(table[k] for k in ks)
            texts = [f"{t} ; {tail}" for t in texts]
            rec["text"] = texts if isinstance(rec["text"], list) else texts[0]
            out.append(json.dumps(rec))
        (dst / f"{split}.jsonl").write_text("\n".join(out) + "\n")
        counts[split] = len(out)
    meta = {"keys": keys, "zipf": zipf, "seed": seed, "per_record": per_record,
            "key_words": key_words, "value_words": value_words, "records": counts}  # fmt: skip
    (dst / "facts.json").write_text(json.dumps(meta, indent=2))
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--keys", type=int, default=4000)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-record", type=int, default=2, help="facts appended to each caption")
    p.add_argument("--key-words", type=int, default=2)
    p.add_argument("--value-words", type=int, default=4)
    a = p.parse_args()
    counts = add_facts(Path(a.src), Path(a.dst), a.keys, a.zipf, a.seed, a.per_record,
                       a.key_words, a.value_words)  # fmt: skip
    print(counts)


if __name__ == "__main__":
    main()
