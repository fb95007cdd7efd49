"""Divergence of quantized graphs from their float model, token by token (docs/design.md §14).

llama.cpp's ``perplexity --kl-divergence`` reports, beside perplexity, the per-token
Kullback-Leibler divergence KL(P ‖ Q) = Σ_v P(v) (log P(v) - log Q(v)) from the float model's
next-token distribution P to the quantized one's Q, over the full vocabulary, each from the
log-softmax of its logits; and how often the two argmaxes agree. This module is that arithmetic
only: :class:`Divergence` takes the two models' logits for the scored rows of one window at a
time (so neither model's (tokens, V) logits are held for more than one batch of windows) and
keeps one float64 KLD and one agreement flag per scored token.

Summaries: ``kld_mean`` (nats), ``kld_p99`` (the 99th percentile, interpolated linearly between
the sorted values the way llama.cpp's and numpy's default percentile do) and ``top1_agreement``
(share of scored tokens whose quantized argmax is the float argmax; ties go to the lowest id in
both, as ``torch.argmax`` picks).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

_ROWS_PER_CHUNK = 128  # float64 log-softmax of (128, V) twice at a time bounds the extra memory


def token_divergence(reference: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KL(softmax(reference) ‖ softmax(logits)) in nats, float64 (n,), and whether the
    two rows' argmaxes agree, bool (n,), of two (n, V) logit tensors on one device; both
    results on the CPU."""
    if reference.shape != logits.shape or reference.dim() != 2:
        raise ValueError(f"expected two (n, V) logit tensors of one shape, got {tuple(reference.shape)} and "
                         f"{tuple(logits.shape)}")
    klds, agree = [], []
    for start in range(0, reference.shape[0], _ROWS_PER_CHUNK):
        p_log = torch.log_softmax(reference[start : start + _ROWS_PER_CHUNK].double(), dim=1)  # (c, V)
        q_log = torch.log_softmax(logits[start : start + _ROWS_PER_CHUNK].double(), dim=1)  # (c, V)
        # P(v) = 0 (underflow) contributes 0 · (-inf - x) = nan in a plain product; its limit is 0
        terms = torch.where(p_log > -math.inf, p_log.exp() * (p_log - q_log), 0.0)
        klds.append(terms.sum(dim=1).clamp_min(0.0).cpu())  # ≥ 0 exactly; rounding can give -1e-17
        agree.append((p_log.argmax(dim=1) == q_log.argmax(dim=1)).cpu())
    return torch.cat(klds), torch.cat(agree)


def percentile(values: Sequence[float] | torch.Tensor, fraction: float) -> float:
    """The ``fraction`` quantile of ``values`` (0..1), linear between the two nearest sorted
    values: at position fraction · (n - 1) of the sorted list."""
    ordered = torch.as_tensor(values, dtype=torch.float64).flatten().sort().values
    if ordered.numel() == 0:
        raise ValueError("the percentile of no values")
    position = min(max(fraction, 0.0), 1.0) * (ordered.numel() - 1)
    low = int(math.floor(position))
    high = min(low + 1, ordered.numel() - 1)
    weight = position - low
    return float((1.0 - weight) * ordered[low] + weight * ordered[high])


class Divergence:
    """Per-token KLD and top-1 agreement of the rows given so far (:meth:`add`), summarised by
    :meth:`metrics`, and the float model's summed log-likelihood of the same tokens (its
    perplexity on the same windows). Holds 9 bytes per scored token on the CPU."""

    def __init__(self) -> None:
        self._klds: list[torch.Tensor] = []
        self._agree: list[torch.Tensor] = []
        self.reference_loglikelihood = 0.0  # Σ natural-log likelihood of the targets under the float model

    def add(self, reference: torch.Tensor, logits: torch.Tensor, reference_loglikelihood: float = 0.0) -> None:
        """The float model's and the quantized graphs' logits (n, V) of the same n scored tokens,
        and the float model's log-likelihood of those n targets."""
        kld, agree = token_divergence(reference, logits)
        self._klds.append(kld)
        self._agree.append(agree)
        self.reference_loglikelihood += reference_loglikelihood

    @property
    def tokens(self) -> int:
        return sum(int(k.numel()) for k in self._klds)

    def values(self) -> torch.Tensor:
        """Every scored token's KLD, float64 (N,), in the order added."""
        return torch.cat(self._klds) if self._klds else torch.zeros(0, dtype=torch.float64)

    def metrics(self) -> dict[str, float]:
        """kld_mean and kld_p99 (nats), top1_agreement (0..1)."""
        if not self._klds:
            raise ValueError("no scored tokens to compare")
        klds = self.values()
        return {
            "kld_mean": float(klds.mean()),
            "kld_p99": percentile(klds, 0.99),
            "top1_agreement": float(torch.cat(self._agree).double().mean()),
        }
