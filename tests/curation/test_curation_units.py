"""Curation building blocks against brute force: MinHash/LSH, Hamming index, Bloom filter,
pHash/dHash against imagehash, and the semantic witness rule on a chain."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from vltrain.curation import minhash, semantic
from vltrain.curation.bloom import BloomFilter
from vltrain.curation.hamming import HammingIndex
from vltrain.curation.hashing import image_hashes
from vltrain.curation.text import (
    NgramHasher,
    fmix64,
    jaccard,
    normalize,
    sort_within,
    words,
    words_batch,
)


def test_normalize_and_shingles_are_order_sensitive_and_seeded() -> None:
    assert normalize("A  Dog, running!") == "a dog running"
    h = NgramHasher(2, seed=0)
    assert not np.array_equal(h.shingles("a b c"), h.shingles("c b a"))
    assert np.array_equal(h.shingles("A b, c"), NgramHasher(2, seed=0).shingles("a b c"))
    assert not np.array_equal(h.shingles("a b c"), NgramHasher(2, seed=1).shingles("a b c"))


def test_minhash_estimates_jaccard_and_lsh_verified_pairs_are_exact() -> None:
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(300)]
    base = [" ".join(rng.choices(vocab, k=20)) for _ in range(60)]
    texts = base + [" ".join(t.split()[:19] + ["x"]) for t in base[:30]]
    h = NgramHasher(3)
    sh = [h.shingles(t) for t in texts]
    sigs = minhash.MinHasher(256, seed=3).signatures(sh)
    est = (sigs[0] == sigs[60]).mean()
    assert abs(est - jaccard(sh[0], sh[60])) < 0.12
    b, r = minhash.optimal_params(0.7, 128)
    found = minhash.verified_pairs(sh, sigs[:, :128], b, r, 0.7)
    truth = {(i, j) for i in range(len(sh)) for j in range(i + 1, len(sh))
             if jaccard(sh[i], sh[j]) >= 0.7}  # fmt: skip
    assert found.keys() <= truth  # verified: never a pair below the threshold
    assert len(found) >= 0.9 * len(truth) and len(truth) >= 30


def test_signatures_are_pinned_for_the_seed() -> None:
    """The vectorised path gives the values the per-caption code gave (seeded, portable)."""
    h = NgramHasher(3, seed=0)
    sig = minhash.MinHasher(128, seed=1).signatures(
        [h.shingles("a red circle on a blue square"), h.shingles("x")]
    )
    assert [hex(int(v)) for v in sig[0, :4]] == [
        "0x3faa5ae491e0374c", "0xa649c47d00ccb477", "0xcc9f603a702d5243", "0x4090749ce771d0c3"
    ]  # fmt: skip
    assert [hex(int(v)) for v in sig[1, :2]] == ["0x5fd50ec0598fa1f2", "0x686996bc8e669e86"]
    assert not np.array_equal(sig, minhash.MinHasher(128, seed=2).signatures([h.shingles("x")]))


def test_batch_tokens_shingles_and_pairs_equal_the_one_by_one_definitions() -> None:
    rng = random.Random(1)
    alpha = "abcXYZ019_ -,.!?'\t\n\x1c()/\\@#&*+=;:"
    texts = ["".join(rng.choice(alpha) for _ in range(rng.randint(0, 40))) for _ in range(300)]
    unicode = ["Café ÉCOLE ﬁne", "naïve—über STRASSE", "Ǆ ǅ", "a\x1eb c", ""]
    for batch in (texts, unicode, unicode[:3], []):
        assert words_batch(batch) == [words(t) for t in batch]
    h = NgramHasher(3, seed=4)
    toks = words_batch(texts)
    docs = [[toks[i], toks[i + 1]] if i % 3 == 0 else [toks[i]] for i in range(299)] + [[]]
    flat, off = h.shingle_sets(docs)
    for d, doc in enumerate(docs):
        want = [h.ngrams(t) for t in doc if t]
        want = np.unique(np.concatenate(want)) if want else np.zeros(0, np.uint64)
        assert np.array_equal(flat[off[d] : off[d + 1]], want)
    sigs = minhash.MinHasher(64, seed=0).signatures_flat(flat, off)
    keys = minhash.band_keys(sigs, 8, 8)
    pairs = minhash.candidate_pairs(sigs, 8, 8)
    bands = sigs.reshape(len(docs), 8, 8)
    share = (bands[:, None] == bands[None, :]).all(-1).any(-1)  # (N, N) brute force
    brute = {(i, j) for i, j in zip(*np.nonzero(np.triu(share, 1)), strict=True)}
    assert {tuple(p) for p in pairs.tolist()} == {(int(i), int(j)) for i, j in brute} and len(
        brute
    ) > 10
    assert all((keys[i] == keys[j]).any() for i, j in brute)
    sets = [flat[off[d] : off[d + 1]] for d in range(len(docs))]
    some = np.array([(i, j) for i in range(0, 300, 7) for j in range(i + 1, 300, 11)])
    got = minhash.pair_jaccard(flat, off, some)
    assert np.allclose(got, [jaccard(sets[i], sets[j]) for i, j in some.tolist()])


def _brute_signature(h: minhash.MinHasher, values: np.ndarray) -> np.ndarray:
    """The MinHash definition, one set at a time: min over values of fmix64(v * a + b)."""
    if len(values) == 0:
        return np.full(h.num_perm, np.iinfo(np.uint64).max, np.uint64)
    return fmix64(values[:, None] * h.a[None, :] + h.b[None, :]).min(axis=0)


def test_blocked_signatures_equal_the_definition_for_every_set_size() -> None:
    """Size-sorted, padded blocks (and the sliced path for sets over a block) change no value;
    the control shows a wrong padding value would be caught."""
    rng = np.random.default_rng(5)
    sizes = [0, 1, 2, 3, 17, 17, 40, 0, minhash._BLOCK, minhash._BLOCK + 1, 3 * minhash._BLOCK + 7]
    sizes += rng.integers(0, 60, 200).tolist()
    sets = [np.unique(rng.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2)) for n in sizes]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in sets])]).astype(np.int64)
    h = minhash.MinHasher(32, seed=9)
    got = h.signatures_flat(np.concatenate(sets), offsets)
    want = np.stack([_brute_signature(h, x) for x in sets])
    assert np.array_equal(got, want)
    padded_with_zero = _brute_signature(h, np.append(sets[4], np.uint64(0)))  # negative control
    assert not np.array_equal(padded_with_zero, want[4])


def test_key_pairs_of_large_runs_and_sort_within_equal_the_brute_force() -> None:
    rng = np.random.default_rng(2)
    keys = rng.integers(0, 6, (80, 3)).astype(np.uint64)  # runs of ~13 equal keys per band
    keys[:, 2] = np.arange(80, dtype=np.uint64)  # a band with no equal keys at all
    brute = {(i, j) for i in range(80) for j in range(i + 1, 80) if (keys[i] == keys[j]).any()}
    got = minhash.key_pairs(keys)
    assert {tuple(p) for p in got.tolist()} == brute and len(got) == len(brute) > 400
    assert np.all(got[:, 0] < got[:, 1]) and len(minhash.key_pairs(keys[:, 2:])) == 0
    for hi in (50, 70_000, 2**32 + 5):  # radix halves, both halves, the lexsort fallback
        group = np.sort(rng.integers(0, hi, 5000))
        group[-1] = hi - 1  # the top group id is what picks the path
        vals = rng.integers(0, 2**63, 5000, dtype=np.uint64) * np.uint64(2)
        order = sort_within(group, vals)
        assert np.array_equal(group[order], np.sort(group))
        assert np.array_equal(vals[order], vals[np.lexsort((vals, group))])


def test_word_hash_cache_reset_gives_the_same_hashes(monkeypatch) -> None:
    from vltrain.curation import text

    toks = [f"w{i % 37}" for i in range(300)]
    want = NgramHasher(2, seed=3).word_hashes(toks)
    monkeypatch.setattr(text, "_CACHE_MAX", 10)  # the cache is cleared on every call
    h = NgramHasher(2, seed=3)
    for _ in range(3):
        assert np.array_equal(h.word_hashes(iter(toks), len(toks)), want)
    assert len(h._vocab) <= 37
    assert not np.array_equal(NgramHasher(2, seed=4).word_hashes(toks), want)


def test_optimal_params_matches_datasketch_rule() -> None:
    assert minhash.optimal_params(0.7, 128) == (14, 9)  # datasketch _optimal_param(0.7, 128)
    assert "J=0.90" in minhash.s_curve(14, 9)


def test_hamming_index_finds_exactly_the_brute_force_neighbours() -> None:
    rng = np.random.default_rng(0)
    codes = [int(x) for x in rng.integers(0, 2**63, 400, dtype=np.uint64)]
    flips = zip(codes[:50], rng.integers(0, 64, 50), rng.integers(0, 64, 50), strict=True)
    codes += [c ^ (1 << int(b)) ^ (1 << int(b2)) for c, b, b2 in flips]  # near neighbours
    for radius in (0, 3, 10):
        idx = HammingIndex(radius)
        for i, c in enumerate(codes):
            idx.insert(i, c)
        for q in codes[::7]:
            got = {j for _, j in idx.query(q)}
            want = {j for j, c in enumerate(codes) if (c ^ q).bit_count() <= radius}
            assert got == want


def test_bloom_filter_fp_rate_and_reload_in_a_new_process(tmp_path) -> None:
    f = BloomFilter(5000, 1e-3, seed=7)
    f.update(f"item {i}" for i in range(5000))
    assert all(f"item {i}" in f for i in range(5000))
    fp = sum(f"other {i}" in f for i in range(20000)) / 20000
    assert fp <= 3e-3
    f.save(tmp_path / "f.bloom")
    code = (
        "import sys; from vltrain.curation.bloom import BloomFilter;"
        f"f = BloomFilter.load({str(tmp_path / 'f.bloom')!r});"
        "print(sum(f'item {i}' in f for i in range(5000)),"
        " sum(f'other {i}' in f for i in range(20000)))"
    )
    env_out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**__import__("os").environ, "PYTHONHASHSEED": "123"},
    ).stdout.split()  # fmt: skip
    assert env_out == ["5000", str(round(fp * 20000))]
    with pytest.raises(ValueError, match="not a vltrain Bloom"):
        (tmp_path / "x").write_bytes(b"garbage")
        BloomFilter.load(tmp_path / "x")


def test_hashes_match_imagehash_bit_for_bit() -> None:
    imagehash = pytest.importorskip("imagehash")
    rng = np.random.default_rng(0)
    for shape in ((40, 60, 3), (97, 31, 3), (64, 64)):
        arr = (rng.random(shape) * 255).astype(np.uint8)
        arr = np.cumsum(arr, axis=0).astype(np.uint8)  # some low-frequency structure
        img = Image.fromarray(arr)
        h = image_hashes(img)
        assert h.phash == int(str(imagehash.phash(img)), 16)
        assert h.dhash == int(str(imagehash.dhash(img)), 16)
        mirror = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        assert h.phash_mirror == int(str(imagehash.phash(mirror)), 16)


def _chain() -> torch.Tensor:
    """A~B and B~C above 0.9 cosine, A and C below it."""
    ang = torch.tensor([0.0, 0.4, 0.8])  # radians: cos(0.4) = 0.92, cos(0.8) = 0.70
    return torch.stack([ang.cos(), ang.sin()], 1)


def test_witness_rule_keeps_a_copy_where_official_semdedup_does_not() -> None:
    emb, eps = _chain(), 0.1
    official = semantic.official_semdedup_keep(emb, eps)
    assert official == [True, False, False]  # C dropped although nothing kept is similar to C
    assert float(emb[0] @ emb[2]) < 1 - eps
    removals = semantic.witness_dedup(emb, eps)
    assert [(r.index, r.witness) for r in removals] == [(1, 0)]  # C kept: its only twin left
    kept = {0, 1, 2} - {r.index for r in removals}
    for r in removals:
        assert r.witness in kept and float(emb[r.index] @ emb[r.witness]) > 1 - eps


def test_witness_rule_with_pinned_items_and_clusters() -> None:
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(30, 16, generator=g), dim=1)
    emb = torch.nn.functional.normalize(
        centres.repeat(4, 1) + 0.03 * torch.randn(120, 16, generator=g), dim=1
    )
    pinned = torch.zeros(120, dtype=torch.bool)
    pinned[60:90] = True
    removals = semantic.witness_dedup(emb, 0.05, cluster_size=40, pinned=pinned)
    removed = {r.index for r in removals}
    assert not removed & set(range(60, 90))
    assert len(removed) >= 60
    for r in removals:
        assert r.witness not in removed and float(emb[r.index] @ emb[r.witness]) > 0.95


def _blobs(seed: int, size: int = 240) -> Image.Image:
    """A smooth random colour picture (a few Gaussian blobs on a gradient)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    out = np.stack([xx * rng.uniform(50, 150), yy * rng.uniform(50, 150), xx * yy * 100], -1)
    for _ in range(6):
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.2)
        blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * r * r))[..., None]
        out += blob * rng.uniform(0, 150, 3)
    return Image.fromarray(np.clip(out, 0, 255).astype(np.uint8))


def test_crop_windows_find_a_90_percent_crop_either_way_round_but_not_another_picture() -> None:
    from vltrain.curation.features import Features
    from vltrain.curation.pipeline import CurateOptions, Decider

    def feat(i: int, img: Image.Image) -> Features:
        z = np.zeros(0, np.uint64)
        return Features(i, image_hashes(img), None, i, z, np.full(128, i, np.uint64),
                        np.full(14, i, np.uint64), "", (), ())  # fmt: skip

    orig = _blobs(0)
    crop = orig.crop((7, 17, 7 + 216, 17 + 216))  # 90%, off the 3 x 3 grid
    for first, second in ((orig, crop), (crop, orig)):
        dec = Decider(CurateOptions(), 14, 9)
        dec.insert(feat(0, first))
        assert dec._near_image(image_hashes(second)) is None  # the plain hashes miss it
        d = dec.match(feat(1, second))
        assert d.reason == "dup_near_image" and d.witness == 0 and "window" in d.detail
        assert dec.match(feat(2, _blobs(1))).reason is None  # negative control
        off = Decider(CurateOptions(crop_radius=0), 14, 9)
        off.insert(feat(0, first))
        assert off.match(feat(1, second)).reason is None  # the crop check is what finds it


def test_a_hamming_radius_outside_64_bits_is_a_clean_error() -> None:
    from vltrain.curation.pipeline import CurateOptions
    from vltrain.data.readers import DataError

    CurateOptions(crop_radius=0).check()  # 0: the crop check is off
    with pytest.raises(DataError, match="--crop-radius is a Hamming radius"):
        CurateOptions(crop_radius=64).check()


def test_captions_in_scripts_without_spaces_are_words_not_one_token() -> None:
    """A Chinese or Japanese caption was one 'word' (caption_short: curate removed every one);
    in scripts written without spaces each character, with its marks, counts as a word."""
    from vltrain.curation.filters import CaptionRules, caption_problem
    from vltrain.curation.text import words, words_batch

    chinese, japanese, thai = "一个男人在骑自行车", "公園で犬が走っている", "ผู้ชายขี่จักรยาน"
    assert words(chinese) == list(chinese)
    assert words(thai)[:2] == ["ผู้", "ช"]  # the vowel and tone marks stay with their letter
    assert words("mixed 一个man, 2 Dogs") == ["mixed", "一", "个", "man", "2", "dogs"]
    assert words("한국어 문장") == ["한국어", "문장"]  # Korean has spaces: words as written
    for text in (chinese, japanese, thai, "a red circle"):
        assert caption_problem(text, CaptionRules()) is None, text
    assert caption_problem("猫", CaptionRules()) == "caption_short"
    texts = [chinese, "A  Dog!", thai, japanese]
    assert words_batch(texts) == [words(t) for t in texts]
