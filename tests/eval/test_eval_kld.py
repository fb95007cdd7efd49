"""KL divergence from float and top-1 agreement: the arithmetic against hand computations and an
independent numpy computation, and the streaming scorer against the same on whole windows."""

import math

import numpy as np
import pytest
import torch

from npuq.data.corpora import Document
from npuq.data.windows import document_windows
from npuq.eval.kld import Divergence, percentile, token_divergence
from npuq.eval.perplexity import evaluate_perplexity, prefix_token_id, tokenize_documents

CONTEXT = 12
PAGES = [
    "The quick brown fox jumps over the lazy dog; the lazy dog sleeps.",
    "Windows are disjoint, and every token of a document is scored exactly once! " * 2,
    "Numbers such as 3.14, 42 and 2025 appear too.",
]


def test_hand_computed_rows():
    # P = (1, 2, 3)/6 and Q = (3, 2, 1)/6: KL(P || Q) = 1/6 ln(1/3) + 2/6 ln 1 + 3/6 ln 3 = ln(3) / 3.
    # Logits are log-probabilities plus any constant per row (here 5 and -2), which softmax removes.
    p = [math.log(1) + 5, math.log(2) + 5, math.log(3) + 5]
    q = [math.log(3) - 2, math.log(2) - 2, math.log(1) - 2]
    reference = torch.tensor([p, p, [0.0, 0.0, 0.0]], dtype=torch.float32)
    logits = torch.tensor([q, p, [0.0, 0.0, 0.0]], dtype=torch.float32)
    kld, agree = token_divergence(reference, logits)
    assert kld.dtype == torch.float64 and agree.tolist() == [False, True, True]  # argmax 2 vs 0; equal rows
    # float32 logits carry 2^-24 relative rounding (6e-8 · 5 on a row shifted by 5); KL moves by at most that
    assert kld[0].item() == pytest.approx(math.log(3) / 3, abs=1e-6)
    assert kld[1].item() == 0.0 and kld[2].item() == 0.0  # identical rows: exactly nothing


def test_a_masked_vocabulary_entry_is_not_nan():
    # the float model gives token 2 probability 0 (logit -inf): its term p · (log p - log q) is 0, not nan.
    # P = (1/2, 1/2, 0), Q = (1/4, 1/4, 1/2): KL = 2 · 1/2 · ln 2 = ln 2.
    reference = torch.tensor([[0.0, 0.0, -math.inf]])
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.5]]))
    kld, agree = token_divergence(reference, logits)
    assert kld.item() == pytest.approx(math.log(2), abs=1e-6) and agree.tolist() == [False]


def test_summaries_by_hand():
    d = Divergence()
    # rows: KL 0 (agree), ln 3 / 3 (disagree), then the same two again in one call
    p = [0.0, math.log(2), math.log(3)]
    q = [math.log(3), math.log(2), 0.0]
    d.add(torch.tensor([p]), torch.tensor([p]), -1.5)
    d.add(torch.tensor([p, p, p]), torch.tensor([q, p, q]), -2.5)
    m = d.metrics()
    k = math.log(3) / 3
    assert d.tokens == 4 and d.reference_loglikelihood == -4.0
    assert m["kld_mean"] == pytest.approx(2 * k / 4, abs=1e-6)
    assert m["top1_agreement"] == 0.5
    # sorted (0, 0, k, k); position 0.99 · 3 = 2.97 lies between two copies of k
    assert m["kld_p99"] == pytest.approx(k, abs=1e-6)


def test_percentile_interpolates_like_numpy():
    rng = np.random.default_rng(0)
    values = rng.exponential(size=37)
    for fraction in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert percentile(values.tolist(), fraction) == pytest.approx(float(np.percentile(values, 100 * fraction)), abs=1e-12)
    # by hand: (1, 2, 3, 4, 10) at 0.99 → position 3.96, 4 + 0.96 · (10 - 4) = 9.76
    assert percentile([10.0, 1.0, 3.0, 2.0, 4.0], 0.99) == pytest.approx(9.76, abs=1e-12)
    with pytest.raises(ValueError):
        percentile([], 0.5)


def test_no_rows_no_metrics():
    with pytest.raises(ValueError, match="no scored tokens"):
        Divergence().metrics()


class Shifted(torch.nn.Module):
    """The tiny LM with a fixed random perturbation of its logits: another model of the same shapes."""

    def __init__(self, lm, scale):
        super().__init__()
        self.lm = lm
        self.noise = torch.randn(64, lm.out.shape[1], generator=torch.Generator().manual_seed(1)) * scale

    def forward(self, tokens):
        return self.lm(tokens) + self.noise[: tokens.shape[1]]


def _independent(reference_fn, logits_fn, tokenizer, context):
    """KLD and argmax agreement of every scored token in numpy float64, each window run alone
    (no batching or padding), from the full logits of both models."""
    docs = tokenize_documents(tokenizer, [Document(f"d{i}", p) for i, p in enumerate(PAGES)])
    windows = document_windows([d.tokens for d in docs], prefix_token_id(tokenizer), context)
    klds, agree, ref_ll = [], [], 0.0
    for w in windows:
        tokens = torch.tensor([w.inputs])
        with torch.no_grad():
            p = reference_fn(tokens)[0, -len(w.targets):].double().numpy()
            q = logits_fn(tokens)[0, -len(w.targets):].double().numpy()
        logp = p - p.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        logq = q - q.max(1, keepdims=True)
        logq -= np.log(np.exp(logq).sum(1, keepdims=True))
        klds += list((np.exp(logp) * (logp - logq)).sum(1))
        agree += list(p.argmax(1) == q.argmax(1))
        ref_ll += float(logp[np.arange(len(w.targets)), list(w.targets)].sum())
    return np.array(klds), np.array(agree), ref_ll


@pytest.mark.parametrize("batch_size,mixed", [(1, False), (3, True)])
def test_streaming_scorer_matches_whole_windows(tiny_lm, tokenizer, batch_size, mixed):
    torch.manual_seed(0)
    other = Shifted(tiny_lm, 0.3).eval()
    docs = [Document(f"d{i}", p) for i, p in enumerate(PAGES)]
    result = evaluate_perplexity(other, tokenizer, docs, CONTEXT, batch_size=batch_size, mixed=mixed,
                                 reference_fn=tiny_lm)
    klds, agree, ref_ll = _independent(tiny_lm, other, tokenizer, CONTEXT)
    assert result.tokens == len(klds) and 0 < result.kld_mean
    # float32 logits of magnitude ~5 (2^-24 relative rounding, and a padded batch may round a sum differently):
    # each KL term moves by ~1e-6, far below the 0.3-sigma perturbation's KLD (~0.05)
    assert result.kld_mean == pytest.approx(float(klds.mean()), abs=1e-5)
    assert result.kld_p99 == pytest.approx(float(np.percentile(klds, 99)), abs=1e-5)
    assert result.top1_agreement == pytest.approx(float(agree.mean()), abs=1e-12)
    assert 0 < result.top1_agreement < 1
    # the float model's perplexity on the same windows, and the one evaluate_perplexity reports alone
    alone = evaluate_perplexity(tiny_lm, tokenizer, docs, CONTEXT)
    assert result.reference["loglikelihood"] == pytest.approx(ref_ll, abs=1e-4)
    assert result.reference["word_perplexity"] == pytest.approx(alone.word_perplexity, rel=1e-6)


def test_the_same_model_diverges_by_nothing(tiny_lm, tokenizer):
    docs = [Document("d", PAGES[0])]
    result = evaluate_perplexity(tiny_lm, tokenizer, docs, CONTEXT, reference_fn=tiny_lm)
    assert result.kld_mean == 0.0 and result.kld_p99 == 0.0 and result.top1_agreement == 1.0
    assert result.reference["word_perplexity"] == result.word_perplexity


def test_more_noise_diverges_more(tiny_lm, tokenizer):
    docs = [Document(f"d{i}", p) for i, p in enumerate(PAGES)]
    small, large = (evaluate_perplexity(Shifted(tiny_lm, s), tokenizer, docs, CONTEXT, reference_fn=tiny_lm)
                    for s in (0.05, 0.5))
    assert small.kld_mean < large.kld_mean and small.top1_agreement >= large.top1_agreement
    # second order: KL ≈ Var_p(δz) / 2 for a small logit change δz, so 10x the noise gives ~100x the KLD
    assert 30 < large.kld_mean / small.kld_mean < 300


def test_without_a_reference_the_json_has_no_divergence(tiny_lm, tokenizer):
    from npuq.records import to_json

    result = to_json(evaluate_perplexity(tiny_lm, tokenizer, [Document("d", PAGES[0])], CONTEXT))
    assert not {"kld_mean", "kld_p99", "top1_agreement", "reference"} & set(result)
