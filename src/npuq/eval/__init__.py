"""Evaluation: perplexity the way lm-evaluation-harness's wikitext task reports it."""

from npuq.eval.metrics import PerplexityTotals, count_bytes, count_words, document_totals, perplexity_metrics
from npuq.eval.perplexity import (
    LogitsFn, check_context, evaluate_model, evaluate_perplexity, prefix_token_id, score_windows,
    tokenize_documents, window_loglikelihood,
)

__all__ = [
    "PerplexityTotals", "count_bytes", "count_words", "document_totals", "perplexity_metrics",
    "LogitsFn", "check_context", "evaluate_model", "evaluate_perplexity", "prefix_token_id", "score_windows",
    "tokenize_documents", "window_loglikelihood",
]
