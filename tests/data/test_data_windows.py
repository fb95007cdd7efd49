"""Rolling windows: lm-evaluation-harness semantics, every token scored once, equal-length batches."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npuq.data.windows import Window, document_windows, length_batches, rolling_windows

PREFIX = -1


def _harness_requests(tokens, prefix, max_len):
    """What lm-evaluation-harness feeds the model for loglikelihood_rolling (context_len=1).

    get_rolling_token_windows → make_disjoint_window → HFLM's input rule
    (context + continuation)[-(max_len + 1):][:-1], scoring the last len(continuation) logits.
    """
    pairs, predicted = [], min(max_len, len(tokens))
    if tokens:
        pairs.append(([prefix] + tokens[: predicted - 1], tokens[:predicted]))
    while predicted < len(tokens):
        n = min(len(tokens) - predicted, max_len)
        end = predicted + n
        pairs.append((tokens[end - max_len - 1 : end - 1], tokens[end - n : end]))
        predicted += n
    requests = []
    for ctx, cont in pairs:
        ctx = ctx[: len(ctx) - (len(cont) - 1)]  # make_disjoint_window
        requests.append(((ctx + cont)[-(max_len + 1) :][:-1], cont))
    return requests


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 60), context=st.integers(1, 16))
def test_same_windows_as_the_harness(n, context):
    tokens = list(range(100, 100 + n))
    assert rolling_windows(tokens, PREFIX, context) == _harness_requests(tokens, PREFIX, context)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), context=st.integers(2, 16))
def test_every_token_scored_once_from_its_own_past(n, context):
    tokens = list(range(100, 100 + n))
    pairs = rolling_windows(tokens, PREFIX, context)
    assert [t for _, targets in pairs for t in targets] == tokens
    stream = [PREFIX] + tokens  # stream[j] is the token before tokens[j]
    for inputs, targets in pairs:
        assert 1 <= len(targets) <= len(inputs) <= context
        first = tokens.index(targets[0])
        # Position p of the input predicts input p + 1: the scored tail lines up with the targets.
        assert inputs[len(inputs) - len(targets):] == stream[first : first + len(targets)]
        # The input is a contiguous run of the document (after the prefix), ending right before the last target.
        start = first + len(targets) - len(inputs)
        assert inputs == stream[start : first + len(targets)]


def test_long_and_short_documents():
    long_doc, short_doc = list(range(23)), [7, 8]
    windows = document_windows([long_doc, short_doc], PREFIX, 5)
    assert [(w.doc, len(w.inputs), len(w.targets)) for w in windows] == [
        (0, 5, 5), (0, 5, 5), (0, 5, 5), (0, 5, 5), (0, 5, 3), (1, 2, 2)]
    assert windows[4].inputs == (17, 18, 19, 20, 21)  # the short last window keeps a full context
    assert windows[5].inputs == (PREFIX, 7)


def test_batches_group_equal_lengths():
    windows = [Window(0, tuple(range(n)), (0,)) for n in (5, 3, 5, 5, 3, 1)]
    batches = length_batches(windows, batch_size=2)
    assert batches == [[0, 2], [3], [1, 4], [5]]
    assert all(len({len(windows[i].inputs) for i in b}) == 1 for b in batches)


def test_mixed_batches_take_the_longest_first_whatever_their_lengths():
    windows = [Window(0, tuple(range(n)), (0,)) for n in (5, 3, 5, 5, 3, 1)]
    assert length_batches(windows, batch_size=4, mixed=True) == [[0, 2, 3, 1], [4, 5]]


def test_window_refuses_more_targets_than_inputs():
    with pytest.raises(ValueError):
        Window(0, (1, 2), (1, 2, 3))
