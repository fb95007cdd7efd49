"""Rolling windows: how a document longer than the context is cut for scoring.

lm-evaluation-harness's ``loglikelihood_rolling`` (``get_rolling_token_windows`` with
``context_len=1`` followed by ``make_disjoint_window``): the scored spans are disjoint and cover
the document once. The first window's input is [prefix] + tokens[:C-1] and scores tokens[:C];
each later window scores the next at most C tokens, and its input is the C tokens before the
last scored one, so a short final window still sees a full context of earlier tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Sequence


@dataclass(frozen=True)
class Window:
    doc: int  # index of the document the window belongs to
    inputs: tuple[int, ...]  # (T,) tokens fed to the model, T <= context
    targets: tuple[int, ...]  # (n,) tokens scored by the logits of the last n input positions, n <= T

    def __post_init__(self) -> None:
        if not 0 < len(self.targets) <= len(self.inputs):
            raise ValueError(f"a window scores 1..{len(self.inputs)} tokens, got {len(self.targets)}")


def rolling_windows(tokens: Sequence[int], prefix_token: int, context: int) -> list[tuple[list[int], list[int]]]:
    """(inputs, targets) pairs that score every token of ``tokens`` exactly once, in order.

    Token i is predicted from the tokens before it inside its window; the first token is
    predicted from ``prefix_token`` alone.
    """
    if context < 1:
        raise ValueError(f"context must be at least 1, got {context}")
    tokens = list(tokens)
    if not tokens:
        return []
    first = min(context, len(tokens))
    pairs = [([prefix_token] + tokens[: first - 1], tokens[:first])]
    done = first
    while done < len(tokens):
        end = min(done + context, len(tokens))  # score tokens[done:end]
        pairs.append((tokens[end - 1 - context : end - 1], tokens[done:end]))
        done = end
    return pairs


def document_windows(token_lists: Sequence[Sequence[int]], prefix_token: int, context: int) -> list[Window]:
    """The rolling windows of every document, in document order."""
    return [
        Window(doc, tuple(inputs), tuple(targets))
        for doc, tokens in enumerate(token_lists)
        for inputs, targets in rolling_windows(tokens, prefix_token, context)
    ]


def length_batches(windows: Sequence[Window], batch_size: int, mixed: bool = False) -> list[list[int]]:
    """Indices of ``windows`` grouped into batches of at most ``batch_size``, longest first (so a
    memory problem shows at the start). Each batch holds windows of one input length, so it is
    one plain (B, T) forward; ``mixed``: consecutive windows of that order whatever their
    lengths, for a scorer that right-pads them to the batch's longest.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = sorted(range(len(windows)), key=lambda i: (-len(windows[i].inputs), i))
    groups = [order] if mixed else [list(g) for _, g in groupby(order, key=lambda i: len(windows[i].inputs))]
    return [group[j : j + batch_size] for group in groups for j in range(0, len(group), batch_size)]
