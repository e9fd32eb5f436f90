"""Byte-level BPE tokenizer for captions (HF ``tokenizers``), trained locally, saved as json.

Special tokens have fixed ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3. Text is
NFKC-normalised, lowercased and whitespace-collapsed before byte-level BPE, so any string
encodes (no unknown bytes) and decoding returns the normalised text.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch import Tensor

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
TOKENIZER_FILE = "tokenizer.json"

#: texts whose ids `TextTokenizer.encode_batch` keeps per tokenizer object (the quickstart's
#: 12,000 records hold ~130,000 distinct captions and negatives; a cleared memo costs nothing
#: but the re-encoding)
MEMO_TEXTS = 500_000


def _new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"\s+"), " "),
            normalizers.Strip(),
        ]
    )
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 2000, min_frequency: int = 2
) -> TextTokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` (deterministic for the same texts)."""
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size} (specials + 256 bytes)")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(tok)


class TextTokenizer:
    """A trained tokenizer with batch encoding to padded tensors."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if ids != list(range(len(SPECIAL_TOKENS))):
            found = dict(zip(SPECIAL_TOKENS, ids, strict=True))
            raise ValueError(
                f"tokenizer must map {list(SPECIAL_TOKENS)} to ids 0..3, found {found}; "
                "train it with vltrain.data.tokenizer.train_bpe_tokenizer"
            )
        self._tok = tokenizer
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = ids
        # text -> its ids without specials: training draws the same captions every epoch, and
        # a lookup is ~30x cheaper than the Rust call (bench: 17 -> 3 ms per batch of 384)
        self._memo: dict[str, list[int]] = {}

    def __getstate__(self) -> dict:
        """Pickled for DataLoader workers without the memo (each process fills its own)."""
        return {**self.__dict__, "_memo": {}}

    @property
    def vocab_size(self) -> int:
        """Number of ids (including special tokens)."""
        return self._tok.get_vocab_size()

    def digest(self) -> str:
        """sha256 of the serialised tokenizer: equal for equal tokenizers, across objects."""
        return hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()

    def save(self, directory: str | Path) -> Path:
        """Write ``directory/tokenizer.json`` (creating the directory); returns the file path."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        file = path / TOKENIZER_FILE
        file.write_text(self._tok.to_str(pretty=True), encoding="utf-8")
        return file

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        """Load a tokenizer saved by ``save`` from ``directory``."""
        file = Path(directory) / TOKENIZER_FILE
        if not file.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {directory}; train one with train_bpe_tokenizer and "
                "save it there"
            )
        return cls(Tokenizer.from_file(str(file)))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def pieces(self, text: str) -> list[tuple[int, int, int]]:
        """``(id, start, end)`` of each token of ``text`` (no specials): the character span it
        covers, e.g. to place a word's tokens along the word's box on an image."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return [(i, a, b) for i, (a, b) in zip(enc.ids, enc.offsets, strict=True)]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in one call into the Rust tokenizer (threads of its own)."""
        if self._tok.padding is not None or self._tok.truncation is not None:
            return [self.encode(t) for t in texts]  # a batch would pad or cut: not `encode`
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_batch(
        self, texts: Sequence[str], max_len: int, add_bos: bool = True, add_eos: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Encode to ``(input_ids, attention_mask)``, both LongTensor (B, T), right-padded.

        T is the longest row, at most ``max_len``. Over-long rows are truncated from the end
        of the text, keeping ``<bos>`` first and ``<eos>`` last.
        """
        n_special = int(add_bos) + int(add_eos)
        if max_len <= n_special:
            raise ValueError(f"max_len {max_len} leaves no room for text (specials: {n_special})")
        if isinstance(texts, str):
            raise TypeError("encode_batch takes a list of strings, not one string")
        bos = [self.bos_id] if add_bos else []
        eos = [self.eos_id] if add_eos else []
        keep = max_len - n_special
        rows = [bos + ids[:keep] + eos for ids in self._memo_ids(texts)]
        t = max((len(r) for r in rows), default=0)
        pad = [self.pad_id] * t
        input_ids = torch.tensor([r + pad[len(r) :] for r in rows], dtype=torch.long)  # (B, T)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)  # (B,)
        attention_mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # (B, T)
        return input_ids.view(len(rows), t), attention_mask

    def _memo_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text through the memo (callers copy, never edit, the lists); the
        misses go to `encode_many` in one call."""
        memo = self._memo
        missing = list(dict.fromkeys(t for t in texts if t not in memo))
        found = dict(zip(missing, self.encode_many(missing), strict=True)) if missing else {}
        out = [memo[t] if t in memo else found[t] for t in texts]
        if len(memo) + len(found) > MEMO_TEXTS:
            memo.clear()
        if len(found) <= MEMO_TEXTS:
            memo.update(found)
        return out

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Text of ``ids`` with special tokens (and padding) removed and spaces cleaned."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        return self._tok.decode(list(ids), skip_special_tokens=True).strip()

    def decode_batch(self, ids: Sequence[Sequence[int]] | Tensor) -> list[str]:
        """``decode`` for each row of a (B, T) batch."""
        if isinstance(ids, Tensor):
            ids = ids.tolist()
        rows = [list(r) for r in ids]
        return [s.strip() for s in self._tok.decode_batch(rows, skip_special_tokens=True)]


def prepare_tokenizer(
    tok_dir: Path,
    init_ckpt: Path | None,
    texts: Callable[[], list[str]],
    vocab_size: int,
    is_main: bool,
) -> None:
    """Make sure `tok_dir` holds the run's tokenizer (rank 0 writes; callers barrier after).

    Reuse the one already there (a resumed run), else copy `init_ckpt`'s (token ids must match
    the weights it holds), else train a BPE tokenizer on `texts()`.
    """
    from vltrain.config.core import ConfigError

    have = (tok_dir / "tokenizer.json").is_file()
    if init_ckpt is not None:
        src = init_ckpt / "tokenizer"
        if not (src / "tokenizer.json").is_file():
            raise ConfigError(f"model.init_from: {init_ckpt} holds no tokenizer/")
        if have and not _same_files(src, tok_dir):
            raise ConfigError(
                f"{tok_dir} holds another tokenizer than model.init_from={init_ckpt}: token ids "
                "would not match the weights; start over with train.overwrite=true"
            )
        if is_main and not have:  # through a temp folder: another rank checking the folder
            tmp = tok_dir.with_name(f".{tok_dir.name}.copy")  # meanwhile sees all of it or none
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(src, tmp)
            os.replace(tmp, tok_dir)
        return
    if is_main and not have:
        trained_once(texts(), vocab_size).save(tok_dir)


#: per process: (digest of the training texts, vocab size) -> the BPE tokenizer trained on
#: them. A budgeted run trains its tokenizer to count FLOPs (vltrain.scaling.budget) and then
#: again for its folder; training is deterministic, so the second is the first.
_TRAINED: dict[tuple[str, int], TextTokenizer] = {}


def trained_once(texts: Sequence[str], vocab_size: int) -> TextTokenizer:
    """`train_bpe_tokenizer(texts, vocab_size)`, trained at most once per process for the
    same texts (keyed by a digest of them, in order) and vocabulary size."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    key = (h.hexdigest(), vocab_size)
    if key not in _TRAINED:
        _TRAINED[key] = train_bpe_tokenizer(texts, vocab_size=vocab_size)
    return _TRAINED[key]


def require_tokenizer(tok_dir: Path) -> None:
    """A checkpoint must carry its own tokenizer: loaders never train or write one."""
    if not (tok_dir / "tokenizer.json").is_file():
        from vltrain.config.core import ConfigError

        raise ConfigError(
            f"{tok_dir / 'tokenizer.json'} is missing: a checkpoint carries the tokenizer its "
            "weights were trained with; copy the whole checkpoint folder"
        )


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.is_file())
    if names != sorted(p.name for p in b.iterdir() if p.is_file()):
        return False
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)
