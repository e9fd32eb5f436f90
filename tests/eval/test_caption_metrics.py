"""Parity of vltrain's BLEU / CIDEr-D / PTB tokenizer with pycocoevalcap, plus the stored-df API."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
from pycocoevalcap.bleu.bleu import Bleu as CocoBleu
from pycocoevalcap.bleu.bleu_scorer import BleuScorer
from pycocoevalcap.cider.cider import Cider as CocoCider
from pycocoevalcap.cider.cider_scorer import CiderScorer

import vltrain.eval.caption_metrics as cm
import vltrain.eval.ngram_counts as nc
from vltrain.eval.caption_metrics import Bleu, Cider, CiderD, sentence_bleu
from vltrain.eval.ptb_tokenize import ptb_tokenize, ptb_tokenize_caption

TOL = 1e-9


def random_set(
    seed: int, n_img: int, vocab: int, max_len: int = 20, max_refs: int = 5
) -> tuple[dict, dict]:
    """Random captions, lengths 1..max_len, 1..max_refs refs; a small vocab forces repeats."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocab)]

    def cap() -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(1, max_len)))

    gts = {f"img{i}": [cap() for _ in range(rng.randint(1, max_refs))] for i in range(n_img)}
    res = {}
    for k, refs in gts.items():  # half the candidates copy-and-mutate a reference: real overlap
        base = rng.choice(refs).split() if rng.random() < 0.5 else cap().split()
        res[k] = [" ".join(w if rng.random() < 0.7 else rng.choice(words) for w in base)]
    return gts, res


EDGE_GTS = {
    "short1": ["a dog runs on the grass", "the dog"],
    "short2": ["a cat", "a cat on a mat is sitting"],
    "short3": ["one two three four five", "one two three"],
    "repeat": ["a a a a b", "a b a b a b"],
    "same": ["a man rides a horse", "a person on a horse"],
    "none": ["completely different words here"],
    "empty_cand": ["a red bus", "a bus"],
    "spaces": ["  a  dog\tbarks ", "a dog"],
}
EDGE_RES = {
    "short1": ["dog"],
    "short2": ["a cat"],
    "short3": ["one two three"],
    "repeat": ["a a a a a a a"],
    "same": ["a man rides a horse"],
    "none": ["zebra giraffe"],
    "empty_cand": [""],
    "spaces": ["a dog  barks"],
}


def assert_bleu_equal(gts: dict, res: dict, n: int = 4) -> None:
    ours, ours_items = Bleu(n).compute_score(gts, res)
    ref, ref_items = CocoBleu(n).compute_score(gts, res, verbose=0)
    assert isinstance(ours, list) and isinstance(ours_items, list)
    assert len(ours) == n and len(ours_items) == n and len(ours_items[0]) == len(gts)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(np.array(ours_items), np.array(ref_items), rtol=0, atol=TOL)


def assert_cider_equal(gts: dict, res: dict) -> None:
    ours, ours_items = CiderD().compute_score(gts, res)
    ref, ref_items = CocoCider().compute_score(gts, res)
    assert isinstance(ours_items, np.ndarray) and ours_items.shape == (len(gts),)
    assert abs(float(ours) - float(ref)) <= TOL
    np.testing.assert_allclose(ours_items, ref_items, rtol=0, atol=TOL)


@pytest.mark.parametrize("seed", range(12))
def test_random_sets_match_pycocoevalcap(seed: int) -> None:
    gts, res = random_set(seed, n_img=1 + 7 * seed, vocab=[3, 8, 40, 300][seed % 4])
    assert_bleu_equal(gts, res)
    assert_cider_equal(gts, res)


def test_random_scores_are_not_degenerate() -> None:
    """Negative control: the parity data give varied, non-zero scores, and a change shows."""
    gts, res = random_set(3, n_img=40, vocab=40)
    _, items = CiderD().compute_score(gts, res)
    assert items.std() > 0.1 and (items > 0).mean() > 0.5
    _, b_items = Bleu(4).compute_score(gts, res)
    assert np.std(b_items[0]) > 0.05
    key = next(iter(gts))
    changed = dict(res, **{key: [gts[key][0]]})  # candidate := a reference
    _, items2 = CiderD().compute_score(gts, changed)
    assert abs(items2[0] - items[0]) > 1e-3
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(items2, items, rtol=0, atol=TOL)


def test_edge_cases_match_pycocoevalcap() -> None:
    assert_bleu_equal(EDGE_GTS, EDGE_RES)
    assert_cider_equal(EDGE_GTS, EDGE_RES)
    for n in (1, 2, 3):
        assert_bleu_equal(EDGE_GTS, EDGE_RES, n=n)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_cider_other_orders_generalise(n: int) -> None:
    # pycocoevalcap's Cider crashes for n < 4 (its precook always makes 4-grams); ours averages
    # orders 1..n, so a candidate equal to all its references scores exactly 10
    corpus, _ = random_set(40 + n, n_img=20, vocab=10)
    refs = ["w1 w2 w3 w4 w5", "w1 w2 w3 w4 w5"]
    assert CiderD(corpus, n=n).score_many([refs[0]], [refs])[0] == pytest.approx(10.0, abs=TOL)
    part = CiderD(corpus, n=n).score_many(["w1 w2 w9 w9 w9"], [refs])[0]
    assert 0.0 < part < 10.0


def test_single_image_matches_and_cider_is_zero() -> None:
    gts, res = {"x": ["a dog on a couch", "a brown dog"]}, {"x": ["a dog on the couch"]}
    assert_bleu_equal(gts, res)
    assert_cider_equal(gts, res)
    assert CiderD().compute_score(gts, res)[0] == 0.0  # df from one image: every idf is 0


@pytest.mark.parametrize("option", ["closest", "shortest", "average"])
def test_bleu_reflen_options_match_bleu_scorer(option: str) -> None:
    gts, res = random_set(7, n_img=30, vocab=10)
    scorer = BleuScorer(n=4)
    for k in gts:
        scorer += (res[k][0], gts[k])
    ref, ref_items = scorer.compute_score(option=option)
    ours, ours_items = Bleu(4, option=option).compute_score(gts, res)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=TOL)
    np.testing.assert_allclose(np.array(ours_items), np.array(ref_items), rtol=0, atol=TOL)


def test_closest_ties_pick_the_shorter_reference() -> None:
    # testlen 4, refs of length 3 and 5: pycocoevalcap takes 3, so no brevity penalty
    gts, res = {"a": ["x y z", "a b c d e"]}, {"a": ["x y z q"]}
    assert_bleu_equal(gts, res)
    scores, _ = Bleu(4).compute_score(gts, res)
    assert scores[0] == pytest.approx(0.75, abs=1e-6)  # 3 of 4 unigrams match
    avg, _ = Bleu(4, option="average").compute_score(gts, res)
    assert avg[0] == pytest.approx(0.75, abs=1e-6)  # average length 4: no penalty either
    shortest_gts = {"a": ["a b c d e", "x y z a b c"]}  # closest is 5: penalty
    s2, _ = Bleu(4).compute_score(shortest_gts, res)
    assert s2[0] == pytest.approx(0.75 * np.exp(1 - 5 / 4), abs=1e-6)


def test_separator_token_and_lexsort_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    gts, res = random_set(11, n_img=15, vocab=6)
    k = next(iter(gts))
    gts[k] = gts[k] + [f"w1 {nc._SEP} w2"]  # the join separator inside a caption
    assert_bleu_equal(gts, res)
    assert_cider_equal(gts, res)
    monkeypatch.setattr(cm, "_PACK_LIMIT", 0)  # force the lexsort path
    assert_bleu_equal(gts, res)
    assert_cider_equal(gts, res)


def coco_cider_with_corpus_df(corpus: dict, gts: dict, res: dict) -> np.ndarray:
    """pycocoevalcap's own CIDEr-D arithmetic with df and ref_len taken from ``corpus``."""
    full = CiderScorer(n=4, sigma=6.0)
    for refs in corpus.values():
        full += (refs[0], refs)
    full.compute_doc_freq()

    class CorpusLen(list):  # compute_cider sets ref_len = log(len(crefs))
        def __len__(self) -> int:
            return len(corpus)

    sub = CiderScorer(n=4, sigma=6.0)
    for k in gts:
        sub += (res[k][0], gts[k])
    sub.crefs = CorpusLen(sub.crefs)
    sub.document_frequency = full.document_frequency
    return np.array(sub.compute_cider())


def test_stored_df_matches_pycocoevalcap_arithmetic() -> None:
    corpus, _ = random_set(21, n_img=60, vocab=25)
    gts, res = random_set(22, n_img=10, vocab=30)  # words 25..29 never occur in the corpus
    expected = coco_cider_with_corpus_df(corpus, gts, res)
    scorer = CiderD(refs_corpus=corpus)
    score, items = scorer.compute_score(gts, res)
    np.testing.assert_allclose(items, expected, rtol=0, atol=TOL)
    assert float(score) == pytest.approx(expected.mean(), abs=TOL)
    keys = list(gts)
    many = scorer.score_many([res[k][0] for k in keys], [gts[k] for k in keys])
    np.testing.assert_allclose(many, expected, rtol=0, atol=TOL)
    # negative control: df computed from gts alone gives different numbers
    assert np.abs(CiderD().compute_score(gts, res)[1] - expected).max() > 1e-3


def test_stored_df_from_same_corpus_equals_pycocoevalcap() -> None:
    gts, res = random_set(5, n_img=25, vocab=20)
    _, ref_items = CocoCider().compute_score(gts, res)
    _, items = CiderD(refs_corpus=gts).compute_score(gts, res)
    np.testing.assert_allclose(items, ref_items, rtol=0, atol=TOL)


def test_corpus_without_higher_order_ngrams() -> None:
    corpus = {i: [w] for i, w in enumerate(["dog", "cat", "bus", "dog"])}  # unigrams only
    gts, res = {"a": ["a dog runs", "dog"]}, {"a": ["a dog runs fast"]}
    expected = coco_cider_with_corpus_df(corpus, gts, res)
    np.testing.assert_allclose(CiderD(corpus).compute_score(gts, res)[1], expected, atol=TOL)


def test_score_many_single_image_is_a_usable_reward() -> None:
    corpus, _ = random_set(30, n_img=50, vocab=20)
    scorer = CiderD(refs_corpus=corpus)
    refs = corpus[next(iter(corpus))]
    good = scorer.score_many([refs[0]], [refs])
    bad = scorer.score_many(["w19 w18 w17"], [refs])
    assert good.shape == (1,) and good[0] > 1.0 and good[0] > bad[0]
    assert CiderD().compute_score({0: refs}, {0: [refs[0]]})[0] == 0.0  # the trap it avoids
    # several sampled candidates per image (RL): same refs repeated
    batch = scorer.score_many([refs[0], "w19 w18 w17", refs[0]], [refs, refs, refs])
    np.testing.assert_allclose(batch, [good[0], bad[0], good[0]], rtol=0, atol=TOL)
    assert scorer.score_many([], []).shape == (0,)


def test_sentence_bleu_matches_per_item_scores() -> None:
    gts, res = random_set(9, n_img=30, vocab=12)
    keys = list(gts)
    cands, refs_list = [res[k][0] for k in keys], [gts[k] for k in keys]
    _, items = CocoBleu(4).compute_score(gts, res, verbose=0)
    for n in (1, 2, 4):
        np.testing.assert_allclose(
            sentence_bleu(cands, refs_list, n=n), items[n - 1], rtol=0, atol=TOL
        )


def test_cider_alias_and_method_names() -> None:
    assert Cider is CiderD
    assert CiderD().method() == CocoCider().method()
    assert Bleu().method() == CocoBleu().method()


def test_input_errors_are_readable() -> None:
    with pytest.raises(ValueError, match="same image ids"):
        Bleu().compute_score({"a": ["x"]}, {"b": ["x"]})
    with pytest.raises(ValueError, match="exactly one caption"):
        CiderD().compute_score({"a": ["x"]}, {"a": ["x", "y"]})
    with pytest.raises(ValueError, match="non-empty list"):
        CiderD().compute_score({"a": []}, {"a": ["x"]})
    with pytest.raises(TypeError, match="captions must be str"):
        Bleu().compute_score({"a": ["x", 3]}, {"a": ["x"]})
    with pytest.raises(ValueError, match="no images"):
        CiderD().compute_score({}, {})
    with pytest.raises(ValueError, match="refs_corpus"):
        CiderD().score_many(["a"], [["a"]])
    with pytest.raises(ValueError, match="one list of references per candidate"):
        sentence_bleu(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="option"):
        Bleu(option="longest")


# ---------------------------------------------------------------------------------------- PTB

# inputs and the output of pycocoevalcap's PTBTokenizer (CoreNLP 3.4.1 + PUNCTUATIONS removal)
PTB_CASES = [
    ("A man riding a wave on top of a surfboard.", "a man riding a wave on top of a surfboard"),
    ("It's a dog, isn't it?", "it 's a dog is n't it"),
    ("Two dogs don't like the cat's toy.", "two dogs do n't like the cat 's toy"),
    (
        "A man in a T-shirt holds a well-known brand's bag.",
        "a man in a t-shirt holds a well-known brand 's bag",
    ),
    (
        "The U.S. flag waves at 10:30 a.m. over 1,000 people.",
        "the u.s. flag waves at 10:30 a.m. over 1,000 people",
    ),
    (
        "A plate of food (eggs, bacon, toast) on a table.",
        "a plate of food -lrb- eggs bacon toast -rrb- on a table",
    ),
    ('A sign that says "STOP" near the road...', "a sign that says stop near the road"),
    ("There are 2 dogs!!! Really?!", "there are 2 dogs !!! really ?!"),
    (
        "A red double-decker bus -- parked; it's empty: no one inside.",
        "a red double-decker bus parked it 's empty no one inside",
    ),
    ("A 3.5-inch phone costs $5.00 & more", "a 3.5-inch phone costs $ 5.00 & more"),
    ("Mr. Smith's dogs' bowls are black/white.", "mr. smith 's dogs bowls are black/white"),
    ("Pizza w/ cheese and 50% off", "pizza w / cheese and 50 % off"),
    (
        "The kids can't wait, we'll go, they're gonna love it.",
        "the kids ca n't wait we 'll go they 're gon na love it",
    ),
    (
        "A giraffe\u2019s neck and \u201csmart\u201d quotes\u2026",
        "a giraffe 's neck and smart quotes",
    ),
    ("A  cat   sitting on a laptop keyboard.", "a cat sitting on a laptop keyboard"),
    (
        "An old-fashioned 100-year-old clock at 5 o'clock",
        "an old-fashioned 100-year-old clock at 5 o'clock",
    ),
    (
        "A woman - holding an umbrella - walks in the rain",
        "a woman holding an umbrella walks in the rain",
    ),
    (
        "A baseball player swings at a pitch [left] {right}",
        "a baseball player swings at a pitch -lsb- left -rsb- -lcb- right -rcb-",
    ),
    ("TWO ZEBRAS STANDING IN A FIELD", "two zebras standing in a field"),
    ("a man , a woman,and a child on the beach .", "a man a woman and a child on the beach"),
]


@pytest.mark.parametrize(("caption", "expected"), PTB_CASES)
def test_ptb_tokenize_caption(caption: str, expected: str) -> None:
    assert ptb_tokenize_caption(caption) == expected


def test_ptb_plain_caption_fast_path_equals_the_full_scan(monkeypatch) -> None:
    import random
    import re

    from vltrain.eval import ptb_tokenize as ptb

    rng = random.Random(0)
    words = ["a", "cannot", "gonna", "red", "circle", "3", "1000", "x2", "wanna", "no", "www"]
    spaces = [" ", "  ", "\t", "\n", "\x1c", "\r\n", ",", ", ", " ,"]
    caps = ["", " ", "Two RED circles", "cannot gonna gimme", "\tA 3 b\x1f", "1,000 x", "a,b"]
    for _ in range(300):
        n = rng.randrange(1, 9)
        caps.append("".join(rng.choice(words) + rng.choice(spaces) for _ in range(n)))
    fast = [ptb.ptb_tokenize_caption(c) for c in caps]
    monkeypatch.setattr(ptb, "_PLAIN", re.compile(r"(?!)"))  # never plain: always the scan
    assert fast == [ptb.ptb_tokenize_caption(c) for c in caps]
    assert fast[2:4] == ["two red circles", "can not gon na gim me"]


def test_ptb_tokenize_dict_interface() -> None:
    caps = {1: ["A dog.", {"caption": "It's red!"}], "b": []}
    assert ptb_tokenize(caps) == {1: ["a dog", "it 's red"], "b": []}
    with pytest.raises(TypeError, match="bare str"):
        ptb_tokenize({1: "A dog."})
    with pytest.raises(TypeError, match="must be a str"):
        ptb_tokenize({1: [None]})


@pytest.mark.skipif(shutil.which("java") is None, reason="Java not installed")
def test_ptb_tokenize_matches_java_tokenizer() -> None:
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    caps = {i: [{"caption": c}] for i, (c, _) in enumerate(PTB_CASES)}
    try:
        expected = PTBTokenizer().tokenize(caps)
    except (OSError, PermissionError) as err:  # read-only site-packages: it writes a temp file
        pytest.skip(f"pycocoevalcap's PTBTokenizer could not run: {err}")
    assert expected == {i: [want] for i, (_, want) in enumerate(PTB_CASES)}  # table is right
    assert ptb_tokenize({k: [v[0]["caption"]] for k, v in caps.items()}) == expected


@pytest.mark.parametrize(
    "sentences",
    [
        ["a dog", "", "  a\tcat\x1csat \x1f", "on the\nmat\r\x0b\x0c", "x"],
        ["skateboarding refrigerator a", "a skateboarding dog", "12345678 123456789 abcdefgh"],
        ["caf\u00e9 au lait", "a\u00a0b c\u2003d", "na\u00efve"],  # non-ASCII: str.split path
        ["a\x00b c", "a b"],  # NUL inside a caption: str.split path
        [f"w1 {nc._SEP} w2", "w1"],
        [],
    ],
)
def test_word_ids_match_str_split(sentences: list[str]) -> None:
    lengths, n_words, ids = nc.word_ids(sentences)
    toks = [s.split() for s in sentences]
    flat = [w for t in toks for w in t]
    assert lengths.tolist() == [len(t) for t in toks]
    assert n_words == len(set(flat)) and len(ids) == len(flat)
    pairs = set(zip(flat, ids.tolist(), strict=True))
    assert len(pairs) == len(set(flat))  # same word <-> same id, both ways


def test_word_ids_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match="captions must be str"):
        nc.word_ids(["a b", 3])  # type: ignore[list-item]


def test_bleu_long_and_non_ascii_words_match_pycocoevalcap() -> None:
    gts, res = random_set(13, n_img=25, vocab=30)
    long = {f"w{i}": f"verylongword{i}" for i in range(0, 30, 2)}
    uni = {f"w{i}": f"caf\u00e9{i}" for i in range(1, 30, 4)}
    for table in (long, {**long, **uni}):
        g = {k: [" ".join(table.get(w, w) for w in c.split()) for c in v] for k, v in gts.items()}
        r = {k: [" ".join(table.get(w, w) for w in c.split()) for c in v] for k, v in res.items()}
        assert_bleu_equal(g, r)


@pytest.mark.parametrize("limit", ["local", "interned", "cells"])
def test_bleu_fallback_paths_match_pycocoevalcap(
    monkeypatch: pytest.MonkeyPatch, limit: str
) -> None:
    gts, res = random_set(5, n_img=40, vocab=80)
    calls: list[object] = []
    clipped = nc.clipped_matches
    monkeypatch.setattr(cm, "clipped_matches", lambda *a: calls.append(out := clipped(*a)) or out)
    if limit == "local":  # global word codes overflow, per-image codes fit
        words = {w for v in (gts, res) for caps in v.values() for c in caps for w in c.split()}
        per_img = max(len({w for c in gts[k] + res[k] for w in c.split()}) for k in gts)
        scale = 40 * (max(map(len, gts.values())) + 1)
        assert per_img < len(words)
        monkeypatch.setattr(nc, "_INT64_LIMIT", scale * (per_img + 1) ** 4)
    elif limit == "interned":  # even per-image codes overflow: general interned path
        monkeypatch.setattr(nc, "_INT64_LIMIT", 0)
    else:
        monkeypatch.setattr(nc, "_MAX_CELLS", 0)
    assert_bleu_equal(gts, res, n=4)
    keys = list(gts)
    cands, refs_list = [res[k][0] for k in keys], [gts[k] for k in keys]
    _, items = CocoBleu(4).compute_score(gts, res, verbose=0)
    np.testing.assert_allclose(sentence_bleu(cands, refs_list), items[3], rtol=0, atol=TOL)
    assert all((c is None) == (limit != "local") for c in calls) and calls


def test_bleu_many_references_and_large_n(monkeypatch: pytest.MonkeyPatch) -> None:
    gts, res = random_set(21, n_img=12, vocab=5, max_len=30, max_refs=12)
    assert_bleu_equal(gts, res)
    # pycocoevalcap's BleuScorer only handles n <= 4; compare the fast path with the interned one
    fast = {n: Bleu(n).compute_score(gts, res) for n in (6, 9)}
    monkeypatch.setattr(nc, "_INT64_LIMIT", 0)
    for n, (ours, ours_items) in fast.items():
        ref, ref_items = Bleu(n).compute_score(gts, res)
        assert ours == ref and ours_items == ref_items


def test_caption_scores_take_lists_or_dicts_and_refuse_what_does_not_pair() -> None:
    """The API's call as docs/api.md writes it, with lists in order, equals the call with dicts
    by id; a single reference string is one reference (not its characters); what does not
    pair up is a ValueError (lists used to fail inside the tokenizer)."""
    hyps = ["a red circle on white", "a small blue square"]
    refs = [["a red circle", "red circle on white"], "a blue square"]
    by_id = cm.caption_scores(dict(enumerate(hyps)), {0: refs[0], 1: [refs[1]]})
    assert cm.caption_scores(hyps, refs) == by_id and by_id["CIDEr-D"] > 0
    with pytest.raises(ValueError, match="2 captions for 1 reference lists"):
        cm.caption_scores(hyps, refs[:1])
    with pytest.raises(ValueError, match="both dicts"):
        cm.caption_scores(dict(enumerate(hyps)), refs)
    with pytest.raises(ValueError, match=r"no caption for 1 id\(s\), e.g. \[1\]"):
        cm.caption_scores({0: hyps[0]}, {0: refs[0], 1: [refs[1]]})
