"""Perplexity arithmetic as lm-evaluation-harness's ``wikitext`` task reports it.

Per document: the summed token log-likelihood (natural log), the number of words
(``len(re.split(r"\\s+", page))``, as the harness counts, so a page that starts with
whitespace counts one extra) and the number of UTF-8 bytes, both on the original page.
Over the corpus the sums are combined: word and byte perplexity exp(-Σll / Σunits), bits per
byte -Σll / (Σbytes · ln 2). Normalising by words and bytes rather than tokens makes models
with different tokenizers comparable.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


def count_words(page: str) -> int:
    return len(re.split(r"\s+", page))


def count_bytes(page: str) -> int:
    return len(page.encode("utf-8"))


@dataclass(frozen=True)
class PerplexityTotals:
    loglikelihood: float  # Σ natural-log likelihood of every scored token (<= 0)
    words: int
    bytes: int
    tokens: int
    documents: int

    def __add__(self, other: PerplexityTotals) -> PerplexityTotals:
        return PerplexityTotals(
            self.loglikelihood + other.loglikelihood, self.words + other.words, self.bytes + other.bytes,
            self.tokens + other.tokens, self.documents + other.documents,
        )


def document_totals(page: str, loglikelihood: float, tokens: int) -> PerplexityTotals:
    return PerplexityTotals(loglikelihood, count_words(page), count_bytes(page), tokens, 1)


def perplexity_metrics(totals: PerplexityTotals) -> dict[str, float]:
    """word_perplexity, byte_perplexity, bits_per_byte of summed totals."""
    if totals.words <= 0 or totals.bytes <= 0:
        raise ValueError(f"perplexity needs words and bytes, got {totals.words} words and {totals.bytes} bytes")
    nll = -totals.loglikelihood
    return {
        "word_perplexity": _exp(nll / totals.words),
        "byte_perplexity": _exp(nll / totals.bytes),
        "bits_per_byte": nll / (totals.bytes * math.log(2)),
    }


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else math.inf  # exp(709.8) overflows a float64
