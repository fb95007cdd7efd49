"""One document of a corpus: the record every corpus reader returns (npuq.data.corpora,
npuq.data.prose) and perplexity scores."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

REPLACEMENT = "\ufffd"


def hash_split(key: str) -> str:
    """"calib" or "eval" for a document's stable key (a topic name, a module path): the first
    byte of SHA-256(key) decides (Python's hash() is salted), so the split is the same on every
    machine."""
    return "calib" if hashlib.sha256(key.encode("utf-8")).digest()[0] % 2 == 0 else "eval"


def decode_utf8(data: bytes) -> tuple[str, int]:
    """(text, replaced): ``data`` decoded as UTF-8 with every undecodable byte sequence read as
    U+FFFD, and how many there were.

    Python's "replace" handler writes one U+FFFD per maximal invalid subsequence; a valid
    EF BF BD in the input (a literal U+FFFD) always decodes as one, and its lead byte EF can
    never be swallowed by an invalid sequence before it (EF is not a continuation byte), so
    the difference of the two counts is exact.
    """
    text = data.decode("utf-8", errors="replace")
    return text, text.count(REPLACEMENT) - data.count(REPLACEMENT.encode("utf-8"))


@dataclass(frozen=True)
class Document:
    id: str
    page: str  # the original text: words and bytes are counted on it
    text: str | None = None  # what the model scores, where it differs from page (detokenized wikitext)
    replaced: int = 0  # undecodable byte sequences of the source read as U+FFFD (see decode_utf8)
    part: str = ""  # the corpus spec it came from, in a mix ("A+B"); "" otherwise

    @property
    def target(self) -> str:
        return self.page if self.text is None else self.text
