"""Byte-level BPE tokenizer: training, padding/truncation rules, round trips, save/load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models

from vltrain.data.tokenizer import TextTokenizer, train_bpe_tokenizer

REPO = Path(__file__).resolve().parents[2]
WORDS = "a the dog cat sits on red blue mat grass runs through field with ball man woman".split()


def _corpus(n: int = 400) -> list[str]:
    """Deterministic caption-like texts."""
    out = []
    for i in range(n):
        k = 3 + (i * 7) % 9
        out.append(" ".join(WORDS[(i * 13 + j * 5) % len(WORDS)] for j in range(k)))
    return out


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return train_bpe_tokenizer(_corpus(), vocab_size=400, min_frequency=2)


def test_special_ids_and_vocab(tok: TextTokenizer) -> None:
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert 260 < tok.vocab_size <= 400


def test_bpe_merges_were_learned(tok: TextTokenizer) -> None:
    # A frequent word is one token; a never-seen word falls back to several byte tokens.
    assert len(tok.encode("dog")) == 1
    assert len(tok.encode("zqxj")) >= 3


def test_round_trip_normalises_case_whitespace_and_unicode(tok: TextTokenizer) -> None:
    texts = ["A Dog  sits on\tthe MAT", "ünïcode café 🙂 ok", "x"]
    ids, _ = tok.encode_batch(texts, max_len=64)
    assert [tok.decode(row) for row in ids] == [
        "a dog sits on the mat",
        "ünïcode café 🙂 ok",
        "x",
    ]
    assert tok.decode_batch(ids) == [tok.decode(row) for row in ids]
    assert tok.decode([tok.bos_id, *tok.encode("red ball"), tok.eos_id, 0, 0]) == "red ball"


def test_padding_rules(tok: TextTokenizer) -> None:
    texts = ["the dog", "a red ball on the grass with a man", "cat"]
    ids, mask = tok.encode_batch(texts, max_len=32)
    assert ids.dtype == mask.dtype == torch.long
    lengths = [len(tok.encode(t)) + 2 for t in texts]
    assert ids.shape == (3, max(lengths)) and mask.shape == ids.shape
    for row, n in enumerate(lengths):
        assert mask[row].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        assert ids[row, 0] == tok.bos_id and ids[row, n - 1] == tok.eos_id
        assert (ids[row, n:] == tok.pad_id).all()
    assert (ids[mask.bool()] != tok.pad_id).all()  # pad id never appears inside text


def test_truncation_keeps_bos_first_and_eos_last(tok: TextTokenizer) -> None:
    long = " ".join(["the dog runs through the field"] * 10)
    ids, mask = tok.encode_batch([long, "cat"], max_len=8)
    assert ids.shape == (2, 8) and mask[0].all()
    assert ids[0, 0] == tok.bos_id and ids[0, -1] == tok.eos_id
    assert ids[0, 1:7].tolist() == tok.encode(long)[:6]  # truncated from the end of the text
    no_specials, _ = tok.encode_batch([long], max_len=8, add_bos=False, add_eos=False)
    assert no_specials[0].tolist() == tok.encode(long)[:8]
    only_eos, _ = tok.encode_batch([long], max_len=8, add_bos=False)
    assert only_eos[0, 0] != tok.bos_id and only_eos[0, -1] == tok.eos_id


def test_encode_batch_errors(tok: TextTokenizer) -> None:
    with pytest.raises(ValueError, match="max_len"):
        tok.encode_batch(["a"], max_len=2)
    with pytest.raises(TypeError, match="list of strings"):
        tok.encode_batch("a dog", max_len=8)  # type: ignore[arg-type]
    ids, mask = tok.encode_batch([], max_len=8)
    assert ids.shape == mask.shape == (0, 0)


def test_save_load_gives_identical_ids(tok: TextTokenizer, tmp_path: Path) -> None:
    file = tok.save(tmp_path / "tok")
    assert file == tmp_path / "tok" / "tokenizer.json"
    assert json.loads(file.read_text())["model"]["type"] == "BPE"
    loaded = TextTokenizer.load(tmp_path / "tok")
    texts = _corpus(50) + ["Unseen WORDS, punctuation!"]
    for a, b in zip(tok.encode_batch(texts, 16), loaded.encode_batch(texts, 16), strict=True):
        assert torch.equal(a, b)
    assert loaded.vocab_size == tok.vocab_size


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        TextTokenizer.load(tmp_path)
    Tokenizer(models.BPE(vocab={"a": 0}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="<pad>"):
        TextTokenizer.load(tmp_path)


def test_training_is_deterministic(tok: TextTokenizer, tmp_path: Path) -> None:
    again = train_bpe_tokenizer(_corpus(), vocab_size=400, min_frequency=2)
    a = tok.save(tmp_path / "a").read_text()
    assert again.save(tmp_path / "b").read_text() == a
    # Another process (different hash seeds in Rust and Python) writes the same file.
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]);"
        "from test_tokenizer import _corpus;"
        "from vltrain.data.tokenizer import train_bpe_tokenizer;"
        "train_bpe_tokenizer(_corpus(), 400, 2).save(sys.argv[3])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    here = str(Path(__file__).parent)
    subprocess.run(
        [sys.executable, "-c", script, str(REPO), here, str(tmp_path / "c")], check=True, env=env
    )
    assert (tmp_path / "c" / "tokenizer.json").read_text() == a
    # Negative control: a different corpus gives a different tokenizer.
    other = train_bpe_tokenizer(_corpus(300), vocab_size=400, min_frequency=2)
    assert other.save(tmp_path / "d").read_text() != a


def test_a_tokenizer_is_trained_once_per_process_for_the_same_texts(tmp_path: Path) -> None:
    """A budgeted run trains its tokenizer to count FLOPs, then for its folder: the second
    time is the first one's result, identical to a fresh training; other texts or another
    vocabulary size train anew."""
    from vltrain.data.tokenizer import prepare_tokenizer, trained_once

    texts = _corpus()
    first = trained_once(texts, 400)
    assert trained_once(list(texts), 400) is first
    fresh = train_bpe_tokenizer(texts, vocab_size=400)
    for t in texts[:50]:
        assert first.encode(t) == fresh.encode(t)
    assert trained_once(texts[:-1], 400) is not first
    assert trained_once(texts, 300) is not first
    for name in ("a", "b"):  # the run folder gets the same files either way
        prepare_tokenizer(tmp_path / name, None, lambda: texts, 400, is_main=True)
    fresh.save(tmp_path / "c")
    same = [(tmp_path / d / "tokenizer.json").read_bytes() for d in "abc"]
    assert same[0] == same[1] == same[2]


def test_encode_batch_memo_gives_the_tokenizers_own_ids(monkeypatch) -> None:
    """The memo answers exactly what the Rust tokenizer does (repeats, a full memo cleared,
    duplicates within a call), and a pickled tokenizer (a DataLoader worker's) starts empty."""
    import pickle

    import vltrain.data.tokenizer as T

    tok = train_bpe_tokenizer(_corpus(), vocab_size=400, min_frequency=2)
    fresh = TextTokenizer(Tokenizer.from_str(tok._tok.to_str()))  # no memo use below
    texts = _corpus(60)[::-1] + ["", "a dog", "a dog", "zebra quartz"]

    def plain(batch: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        encodings = fresh._tok.encode_batch(batch, add_special_tokens=False)
        rows = [[1, *e.ids[: max_len - 2], 2] for e in encodings]
        t = max(map(len, rows))
        ids = torch.tensor([r + [0] * (t - len(r)) for r in rows])
        return ids, (ids != 0).long()

    monkeypatch.setattr(T, "MEMO_TEXTS", 50)
    for start in (0, 20, 0, 40, 0):  # misses, hits, a memo over its size cleared
        batch = texts[start : start + 25]
        got = tok.encode_batch(batch, max_len=8)
        want = plain(batch, 8)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert len(tok._memo) <= 50
    assert tok._memo  # it was used
    assert pickle.loads(pickle.dumps(tok))._memo == {}
    tok._memo.clear()
    big = tok.encode_batch(texts, max_len=12)  # one call of more texts than the memo holds
    assert torch.equal(big[0], plain(texts, 12)[0]) and tok._memo == {}
