"""Pure-Python stand-in for pycocoevalcap's PTBTokenizer (Stanford CoreNLP 3.4.1, no Java).

pycocoevalcap runs ``edu.stanford.nlp.process.PTBTokenizer -preserveLines -lowerCase`` and then
drops the tokens in ``PUNCTUATIONS``. This module reproduces that pipeline for ordinary captions:

- lowercase; split off punctuation; keep hyphens, periods, slashes and apostrophes *inside*
  words (``t-shirt``, ``keyboard.a``, ``black/white``, ``o'clock``) and digit groups (``1,000``,
  ``10:30``, ``3.5``); keep abbreviations (``mr.``, ``u.s.``, ``a.m.``);
- PTB clitics: ``it's`` -> ``it 's``, ``don't`` -> ``do n't``, ``can't`` -> ``ca n't``,
  ``cannot`` -> ``can not``, ``gonna`` -> ``gon na``;
- brackets become ``-lrb-``/``-rrb-``/``-lsb-``/``-rsb-``/``-lcb-``/``-rcb-`` and are *kept*:
  pycocoevalcap's list holds ``-LRB-`` in upper case, which never matches lower-cased output;
- runs of ``!``/``?`` stay one token (``!!!`` is kept, ``!`` is dropped), quotes, ``.``,
  ``,``, ``...``, ``-``, ``--``, ``:``, ``;`` are dropped.

Known differences from the Java tokenizer are in rare forms only (``y'all``,
``rock'n'roll``, single-letter abbreviations such as ``j. smith``, SGML/HTML entities).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PUNCTUATIONS", "ptb_tokenize", "ptb_tokenize_caption"]

# pycocoevalcap's list verbatim; its upper-case bracket names never match -lowerCase output
PUNCTUATIONS = frozenset(
    ["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-"]
    + [".", "?", "!", ",", ":", "-", "--", "...", ";"]
)

_ABBREVIATIONS = (
    "mr|mrs|ms|messrs|dr|prof|rev|gen|sen|rep|gov|st|jr|sr|vs|etc|inc|co|corp|ltd|mt|ft|ave"
    "|blvd|rd|dept|univ|fig|jan|feb|mar|apr|jun|jul|aug|sep|sept|oct|nov|dec"
)
_LETTER = r"[^\W\d_]"
_ALNUM = r"[^\W_]"
_TOKEN = re.compile(
    "|".join(
        [
            r"(?P<url>(?:https?://|www\.)[^\s\"'()<>\[\]{}]*[^\s\"'()<>\[\]{}.,;:!?])",
            rf"(?P<email>{_ALNUM}[\w.+-]*@{_ALNUM}+(?:\.{_ALNUM}+)+)",
            # u.s. / a.m. / plan b. / mr. ; "no." only before a number
            rf"(?P<abbr>(?:(?:{_LETTER}\.){{2,}}|(?<!{_ALNUM})(?:{_LETTER}|{_ABBREVIATIONS})\.)"
            rf"(?!{_ALNUM})|(?<!{_ALNUM})no\.(?=\s*\d))",
            r"(?P<special>'\d\ds\b|'t(?=is\b|was\b))",  # '90s, 'tis -> 't is
            # words: letters/digits joined by - . / ' ; commas and colons only between digits
            rf"(?P<word>@?{_ALNUM}+(?:(?:[-./']|(?<=\d)[,:](?=\d)){_ALNUM}+)*)",
            r"(?P<ellipsis>\.{2,}|\u2026)",
            r"(?P<bang>[!?]+)",
            r"(?P<dashes>-{2,}|[\u2013\u2014])",
            r"(?P<other>\S)",
        ]
    )
)
_BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}
_QUOTES = {'"': "''", "\u201c": "``", "\u201d": "''", "\u2018": "`", "\u2019": "'", "`": "`"}
_SPLIT_WORDS = {
    "cannot": ("can", "not"),
    "gonna": ("gon", "na"),
    "gotta": ("got", "ta"),
    "wanna": ("wan", "na"),
    "lemme": ("lem", "me"),
    "gimme": ("gim", "me"),
}
_CLITIC = re.compile(r"^(.+?)(n't|'s|'m|'d|'ll|'re|'ve)$")
#: lower-case ASCII letters, digits and white space (or letters, white space and commas, which
#: are dropped when no digit is beside them): every token is a plain word
_PLAIN = re.compile(r"[a-z0-9\s]*|[a-z\s,]*")


def _split_word(word: str) -> list[str]:
    """PTB clitic splitting of one word token: ``don't`` -> ``do n't``, ``it's`` -> ``it 's``."""
    if word in _SPLIT_WORDS:
        return list(_SPLIT_WORDS[word])
    m = _CLITIC.match(word)
    return [m.group(1), m.group(2)] if m else [word]


def ptb_tokenize_caption(caption: str) -> str:
    """Tokenize one caption the way pycocoevalcap's PTBTokenizer does; space-separated output."""
    if not isinstance(caption, str):
        raise TypeError(f"a caption must be a str, got {type(caption).__name__}: {caption!r}")
    text = caption.replace("\n", " ").replace("\u2019", "'").lower()
    if _PLAIN.fullmatch(text):  # the common case, ~10x faster; same tokens as the scan below
        words = text.replace(",", " ").split()
        return " ".join(t for w in words for t in _SPLIT_WORDS.get(w, (w,)))
    tokens: list[str] = []
    for m in _TOKEN.finditer(text):
        kind, tok = m.lastgroup, m.group()
        if kind == "word":
            tokens.extend(_split_word(tok))
        elif kind == "ellipsis":
            tokens.append("...")
        elif kind == "dashes":
            tokens.append("--")
        elif kind == "other":
            tokens.append(_BRACKETS.get(tok) or _QUOTES.get(tok) or tok)
        else:  # url, email, abbr, special, bang
            tokens.append(tok)
    return " ".join(t for t in tokens if t not in PUNCTUATIONS)


def ptb_tokenize(captions: Mapping[Any, Sequence[str | Mapping[str, str]]]) -> dict[Any, list[str]]:
    """Tokenize ``{id: [caption, ...]}`` like pycocoevalcap's ``PTBTokenizer().tokenize``.

    Captions may be strings or COCO-style ``{"caption": str}`` dicts (what pycocoevalcap takes).
    Returns ``{id: [tokenized caption, ...]}`` ready for :class:`Bleu` and :class:`CiderD`.
    """
    out: dict[Any, list[str]] = {}
    for key, caps in captions.items():
        if isinstance(caps, str):
            raise TypeError(
                f"captions[{key!r}] must be a list of captions, got a bare str {caps!r}; "
                "wrap it in a list"
            )
        out[key] = [
            ptb_tokenize_caption(c["caption"] if isinstance(c, Mapping) else c) for c in caps
        ]
    return out
