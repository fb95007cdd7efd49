"""The scorer against a hand computation: explicit windows, explicit log-softmax, explicit sums."""

import math
import re

import numpy as np
import pytest
import torch

from npuq.data.corpora import Document
from npuq.data.windows import document_windows, length_batches
from npuq.errors import NpuqError
from npuq.eval.perplexity import evaluate_perplexity, prefix_token_id, tokenize_documents, window_loglikelihood

CONTEXT = 8
LONG = (
    "Perplexity is the exponential of the average negative log-likelihood of a text.\n"
    "The quick brown fox jumps over the lazy dog; the lazy dog sleeps.\n"
    "Numbers such as 3.14, 42 and 2025 appear too (with brackets) and \"quotes\".\n"
)
PAGES = [
    LONG * 2,  # many windows
    "The lazy dog.",  # shorter than one window
    "  Windows are disjoint,\tand every token\nis scored once.  ",  # leading whitespace: one extra "word"
]


def _history(ids: list[int], i: int, prefix: int, context: int) -> list[int]:
    """The tokens token i is predicted from, derived from the window rule in words:

    window 0 scores ids[0:C] from [prefix] + ids; window k >= 1 scores ids[kC:(k+1)C] and its input
    is the C tokens ending just before the last token it scores.
    """
    if i < context:
        return [prefix] + ids[:i]
    last_scored = min((i // context + 1) * context, len(ids)) - 1
    return ids[last_scored - context : i]


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


def _by_hand(model, tokenizer, pages, context):
    prefix = tokenizer.bos_token_id
    ll, words, nbytes, ntokens = 0.0, 0, 0, 0
    for page in pages:
        ids = tokenizer.encode(page, add_special_tokens=False)
        for i, target in enumerate(ids):
            history = _history(ids, i, prefix, context)
            assert 1 <= len(history) <= context
            with torch.no_grad():
                row = model(torch.tensor([history]))[0, -1].numpy()
            ll += _log_softmax(row)[target]
        ntokens += len(ids)
        words += len(re.split(r"\s+", page))
        nbytes += len(page.encode("utf-8"))
    return {
        "word_perplexity": math.exp(-ll / words),
        "byte_perplexity": math.exp(-ll / nbytes),
        "bits_per_byte": -ll / (nbytes * math.log(2)),
        "tokens": ntokens, "words": words, "bytes": nbytes,
    }


@pytest.mark.parametrize("batch_size, mixed", [(1, False), (3, False), (4, True)])
def test_matches_a_hand_computation(tiny_lm, tokenizer, batch_size, mixed):
    """mixed: windows of different lengths share a forward, right-padded with token 0."""
    docs = [Document(f"d{i}", page) for i, page in enumerate(PAGES)]
    if mixed:  # the last batch holds a full window and the short page's
        windows = document_windows([d.tokens for d in tokenize_documents(tokenizer, docs)], prefix_token_id(tokenizer), CONTEXT)
        assert [len(windows[i].inputs) for i in length_batches(windows, batch_size, mixed)[-1]] == [8, 5]
    ours = evaluate_perplexity(tiny_lm, tokenizer, docs, CONTEXT, batch_size=batch_size, mixed=mixed)
    ref = _by_hand(tiny_lm, tokenizer, PAGES, CONTEXT)
    assert ref["tokens"] > 4 * CONTEXT  # the long page spans several windows
    for key in ("tokens", "words", "bytes"):
        assert getattr(ours, key) == ref[key], key
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert getattr(ours, key) == pytest.approx(ref[key], rel=1e-6), key
    assert ours.documents == 3 and ours.context == CONTEXT


def test_every_token_is_scored_exactly_once(tiny_lm, tokenizer):
    long_ids = tokenizer.encode(PAGES[0], add_special_tokens=False)
    short_ids = tokenizer.encode(PAGES[1], add_special_tokens=False)
    assert len(long_ids) > 4 * CONTEXT and len(long_ids) % CONTEXT != 0 and len(short_ids) < CONTEXT
    seen = []  # (B, T) token batches the scorer asked for

    def recording(tokens):
        seen.append(tokens.clone())
        return tiny_lm(tokens)

    docs = [Document("long", PAGES[0]), Document("short", PAGES[1])]
    result = evaluate_perplexity(recording, tokenizer, docs, CONTEXT, batch_size=2)
    assert result.tokens == len(long_ids) + len(short_ids)
    assert result.windows == math.ceil(len(long_ids) / CONTEXT) + 1
    assert all(b.shape[1] <= CONTEXT for b in seen)
    # Equal lengths only in a batch, and every window was run once.
    assert sum(b.shape[0] for b in seen) == result.windows
    # Scoring a document alone gives the same log-likelihood as inside the corpus (no leakage).
    alone = [evaluate_perplexity(tiny_lm, tokenizer, [d], CONTEXT).loglikelihood for d in docs]
    assert result.loglikelihood == pytest.approx(sum(alone), rel=1e-12)


def test_window_loglikelihood_uses_the_last_rows_in_float64():
    logits = torch.tensor([[9.0, 9.0, 9.0], [0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])  # (T=3, V=3)
    expected = (1.0 - math.log(1 + math.e + math.e**2)) + (3.0 - math.log(math.e**3 + 2))
    assert window_loglikelihood(logits, [1, 0]) == pytest.approx(expected, rel=1e-12)


def test_prefix_is_bos_else_eos(tokenizer):
    assert prefix_token_id(tokenizer) == tokenizer.bos_token_id

    class NoBos:
        bos_token_id, eos_token_id = None, 7

    class Neither:
        bos_token_id = eos_token_id = None

    assert prefix_token_id(NoBos()) == 7
    with pytest.raises(NpuqError, match="neither a BOS nor an EOS"):
        prefix_token_id(Neither())


def test_budgets(tokenizer):
    docs = [Document(f"d{i}", page) for i, page in enumerate(PAGES)]
    assert len(tokenize_documents(tokenizer, docs, max_docs=2)) == 2
    n0 = len(tokenizer.encode(PAGES[0], add_special_tokens=False))
    cut = tokenize_documents(tokenizer, docs, max_tokens=n0 + 2)
    assert [len(d.tokens) for d in cut] == [n0, 2]
    assert cut[0].page == PAGES[0] and cut[1].page == tokenizer.decode(cut[1].tokens)


@pytest.mark.parametrize("context", [0, 1])
def test_context_below_two_is_refused(tiny_lm, tokenizer, context):
    with pytest.raises(NpuqError, match=r"--context .* too small"):
        evaluate_perplexity(tiny_lm, tokenizer, [Document("d", "text")], context)


def test_context_above_the_model_limit_is_refused(tiny_lm, tokenizer):
    with pytest.raises(NpuqError, match="exceeds the model's limit of 64"):
        evaluate_perplexity(tiny_lm, tokenizer, [Document("d", "text")], 65, max_context=64)
