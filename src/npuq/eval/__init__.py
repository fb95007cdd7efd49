"""Evaluation: perplexity the way lm-evaluation-harness's wikitext task reports it, the divergence
from the float model (kld), and lm-evaluation-harness tasks (lm_eval_adapter, optional extra)."""

from npuq.eval.kld import Divergence, percentile, token_divergence
from npuq.eval.metrics import PerplexityTotals, count_bytes, count_words, document_totals, perplexity_metrics
from npuq.eval.perplexity import (
    LogitsFn, check_context, evaluate_model, evaluate_perplexity, prefix_token_id, score_windows,
    tokenize_documents, window_loglikelihood,
)

__all__ = [
    "Divergence", "percentile", "token_divergence",
    "PerplexityTotals", "count_bytes", "count_words", "document_totals", "perplexity_metrics",
    "LogitsFn", "check_context", "evaluate_model", "evaluate_perplexity", "prefix_token_id", "score_windows",
    "tokenize_documents", "window_loglikelihood",
]
