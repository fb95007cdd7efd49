"""Corpora (documents with stable ids) and the rolling windows they are scored in."""

from npuq.data.corpora import CORPUS_HELP, SPLITS, load_corpus, wikitext_detokenize
from npuq.data.document import Document
from npuq.data.windows import Window, document_windows, length_batches, rolling_windows

__all__ = [
    "CORPUS_HELP", "SPLITS", "Document", "load_corpus", "wikitext_detokenize",
    "Window", "document_windows", "length_batches", "rolling_windows",
]
