"""One document of a corpus: the record every corpus reader returns (npuq.data.corpora,
npuq.data.prose) and perplexity scores."""

from __future__ import annotations

from dataclasses import dataclass


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
