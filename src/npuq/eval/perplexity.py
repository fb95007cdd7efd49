"""Score a corpus with any "logits for these tokens" callable: word/byte perplexity, bits per byte.

The scorer only needs ``LogitsFn``: tokens (B, T) int64 → logits (B, T, V) of a causal forward
that starts from an empty cache. The float model, a quantized PT2E program and an ONNX session
all fit, so one code path evaluates every stage. Windows follow lm-evaluation-harness
(:mod:`npuq.data.windows`), the arithmetic is :mod:`npuq.eval.metrics`.

Tokens are built on the scoring ``device`` and the log-probabilities are computed where the
logits come back, so only one float64 sum per chunk of rows returns to the host, never the
(B, T, V) logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from npuq.data.corpora import SPLITS
from npuq.data.document import Document
from npuq.data.windows import Window, document_windows, length_batches
from npuq.device import device_of
from npuq.errors import NpuqError
from npuq.eval.kld import Divergence
from npuq.eval.metrics import PerplexityTotals, document_totals, perplexity_metrics
from npuq.records import optional_key
from npuq.runtime.runner import forward_logits
from npuq.threads import scope_or_keep

LogitsFn = Callable[[torch.Tensor], torch.Tensor]  # (B, T) int64 → (B, T, V) float

_ROWS_PER_CHUNK = 128  # float64 log-softmax over (128, V) at a time bounds the extra memory


@dataclass(frozen=True)
class EvalOptions:
    """What ``npuq eval`` scores and how; each field is the flag of the same name. ``npuq run``
    scores its float, quantized and exported graphs with one of these."""

    corpus: str = "builtin"  # builtin, file:PATH or wikitext2
    split: str = "eval"
    context: int = 512
    max_docs: int | None = None
    max_tokens: int | None = None
    batch_size: int = 4  # windows of equal length per forward of the float model

    def __post_init__(self) -> None:
        check_context(self.context)
        if self.split not in SPLITS:
            raise NpuqError(f"--split {self.split!r}: choose one of {', '.join(SPLITS)}")
        if self.max_docs is not None and self.max_tokens is not None:
            raise NpuqError("pass either --max-docs or --max-tokens, not both")
        for name in ("max_docs", "max_tokens", "batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise NpuqError(f"--{name.replace('_', '-')} {value} must be at least 1")
        if self.max_tokens is not None and self.max_tokens < 2:
            raise NpuqError(f"--max-tokens {self.max_tokens}: scoring needs at least 2 tokens")


@dataclass(frozen=True)
class EvalResult:
    """Perplexity of one set of graphs on one corpus (docs/design.md §7)."""

    word_perplexity: float
    byte_perplexity: float
    bits_per_byte: float
    loglikelihood: float
    tokens: int
    words: int
    bytes: int
    documents: int
    windows: int
    context: int
    seconds: float  # tokenization and scoring
    threads: int = 0  # torch threads while scoring
    device: str = "cpu"
    graphs: dict[str, Any] = field(default_factory=dict)  # what was scored: model, artifact or onnx folder
    corpus: str | None = None
    split: str | None = None
    replacement_characters: int = 0  # non-UTF-8 byte sequences in the text, read as U+FFFD
    # --kl-divergence (docs/design.md §14): the float model scored on the same windows
    kld_mean: float | None = optional_key()  # mean per-token KL(float ‖ these graphs), nats
    kld_p99: float | None = optional_key()  # its 99th percentile, nats
    top1_agreement: float | None = optional_key()  # share of scored tokens whose argmax is the float one
    reference: dict[str, Any] | None = optional_key()  # the float model: what it is and its perplexity here

    def describe(self) -> str:
        text = (f"word perplexity {self.word_perplexity:.4f}, byte perplexity {self.byte_perplexity:.4f}, "
                f"bits per byte {self.bits_per_byte:.4f}")
        if self.kld_mean is not None:
            text += (f"; against float (word perplexity {self.reference['word_perplexity']:.4f}): KLD mean "
                     f"{self.kld_mean:.5f} nats, p99 {self.kld_p99:.5f}, top-1 agreement {self.top1_agreement:.4f}")
        return text


@dataclass(frozen=True)
class TokenizedDocument:
    page: str  # words and bytes are counted on it
    tokens: tuple[int, ...]


def check_context(context: int, limit: int | None = None) -> None:
    if context < 2:
        raise NpuqError(f"--context {context} is too small: a window needs at least 2 tokens; use 2 or more (e.g. 512)")
    if limit is not None and context > limit:
        raise NpuqError(f"--context {context} exceeds the model's limit of {limit} tokens (max_position_embeddings): use at most {limit}")


def prefix_token_id(tokenizer: Any) -> int:
    """The token that starts every document's first window: BOS if the tokenizer has one, else EOS."""
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            return int(token)
    raise NpuqError("the tokenizer has neither a BOS nor an EOS token to start documents with: use a model whose tokenizer defines one")


def tokenize_documents(
    tokenizer: Any, documents: Sequence[Document], max_docs: int | None = None, max_tokens: int | None = None
) -> list[TokenizedDocument]:
    """Token ids of each document (no special tokens), within the optional budgets.

    ``max_docs`` keeps the first N documents. ``max_tokens`` keeps whole documents until N tokens;
    the document that crosses N is cut at N tokens and its words and bytes are counted on the
    decoded kept tokens (so with a budget the figures are not the full-corpus ones).
    """
    out: list[TokenizedDocument] = []
    used = 0
    for doc in documents[:max_docs]:
        if max_tokens is not None and used >= max_tokens:
            break
        tokens = list(tokenizer.encode(doc.target, add_special_tokens=False))
        if not tokens:
            continue
        page = doc.page
        if max_tokens is not None and used + len(tokens) > max_tokens:
            tokens = tokens[: max_tokens - used]
            page = tokenizer.decode(tokens)
        out.append(TokenizedDocument(page, tuple(tokens)))
        used += len(tokens)
    if not out:
        raise NpuqError("no tokens to score: the selected documents are empty after tokenization; choose more documents or another corpus")
    return out


def window_loglikelihood(logits: torch.Tensor, targets: Sequence[int]) -> float:
    """Σ log p(targets[j]) from the last n = len(targets) rows of ``logits`` (T, V), in float64,
    computed on the logits' device."""
    n = len(targets)
    rows = logits[logits.shape[0] - n :]  # (n, V)
    target = torch.as_tensor(targets, dtype=torch.long, device=logits.device)
    total = 0.0
    for start in range(0, n, _ROWS_PER_CHUNK):
        chunk = rows[start : start + _ROWS_PER_CHUNK].double()  # (c, V)
        picked = chunk.gather(1, target[start : start + _ROWS_PER_CHUNK, None]).squeeze(1)  # (c,)
        total += (picked - torch.logsumexp(chunk, dim=1)).sum().item()
    return total


def window_logits(
    logits_fn: LogitsFn, windows: Sequence[Window], batch: Sequence[int], device: str | torch.device | None,
) -> torch.Tensor:
    """Logits (B, T, V) of the windows ``batch``, each right-padded with token 0 to the longest
    (a causal forward's logits of a window's tokens do not depend on the tokens after them)."""
    longest = max(len(windows[i].inputs) for i in batch)
    tokens = torch.tensor([windows[i].inputs + (0,) * (longest - len(windows[i].inputs)) for i in batch],
                          dtype=torch.long, device=device)  # (B, T)
    with torch.no_grad():
        logits = logits_fn(tokens)  # (B, T, V)
    if tuple(logits.shape[:2]) != tuple(tokens.shape):
        raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for tokens {tuple(tokens.shape)}; expected (B, T, V)")
    return logits


def score_windows(
    logits_fn: LogitsFn, windows: Sequence[Window], batch_size: int = 1, progress: bool = False,
    device: str | torch.device | None = None, mixed: bool = False, reference_fn: LogitsFn | None = None,
    divergence: Divergence | None = None,
) -> list[float]:
    """Log-likelihood of each window's targets, in the order of ``windows``; the tokens given to
    ``logits_fn`` are on ``device`` (None: the CPU). ``mixed``: a batch may hold windows of
    different lengths, each right-padded with token 0 to the longest.

    ``reference_fn`` and ``divergence`` (given together): the float model's logits of the same
    batch are computed right after the graphs' and each window's scored rows of both go to
    ``divergence.add``, so the two models' logits exist for one batch at a time."""
    if (reference_fn is None) != (divergence is None):
        raise ValueError("give reference_fn and divergence together")
    scores = [0.0] * len(windows)
    with tqdm(total=len(windows), desc="perplexity", unit="window", disable=not progress, leave=False) as bar:
        for batch in length_batches(windows, batch_size, mixed):
            logits = window_logits(logits_fn, windows, batch, device)
            reference = None if reference_fn is None else window_logits(reference_fn, windows, batch, device)
            for row, i in enumerate(batch):
                inputs, targets = windows[i].inputs, windows[i].targets
                scores[i] = window_loglikelihood(logits[row, : len(inputs)], targets)
                if reference is not None:
                    scored = slice(len(inputs) - len(targets), len(inputs))  # the rows that predict the targets
                    divergence.add(reference[row, scored], logits[row, scored],
                                   window_loglikelihood(reference[row, : len(inputs)], targets))
            del logits, reference  # before the next batch's forward allocates its own
            bar.update(len(batch))
    return scores


def evaluate_perplexity(
    logits_fn: LogitsFn,
    tokenizer: Any,
    documents: Sequence[Document],
    context: int,
    *,
    batch_size: int = 1,
    max_docs: int | None = None,
    max_tokens: int | None = None,
    max_context: int | None = None,
    progress: bool = False,
    device: str | torch.device | None = None,
    mixed: bool = False,
    reference_fn: LogitsFn | None = None,
) -> EvalResult:
    """Word/byte perplexity and bits per byte of ``documents`` under ``logits_fn``, which gets
    its tokens on ``device`` (None: the CPU); ``mixed``: see :func:`score_windows`.
    ``reference_fn``: the float model's logits, scored on the same windows (the same batches)
    for kld_mean, kld_p99, top1_agreement and its own perplexity (``reference``)."""
    check_context(context, max_context)
    start = time.perf_counter()
    docs = tokenize_documents(tokenizer, documents, max_docs, max_tokens)
    windows = document_windows([d.tokens for d in docs], prefix_token_id(tokenizer), context)
    divergence = None if reference_fn is None else Divergence()
    scores = score_windows(logits_fn, windows, batch_size, progress, device, mixed, reference_fn, divergence)
    per_doc = [0.0] * len(docs)
    for window, score in zip(windows, scores):
        per_doc[window.doc] += score
    totals = sum(
        (document_totals(d.page, ll, len(d.tokens)) for d, ll in zip(docs, per_doc)),
        PerplexityTotals(0.0, 0, 0, 0, 0),
    )
    compared: dict[str, Any] = {}
    if divergence is not None:
        float_totals = replace(totals, loglikelihood=divergence.reference_loglikelihood)
        compared = {**divergence.metrics(), "reference": {**perplexity_metrics(float_totals),
                                                          "loglikelihood": float_totals.loglikelihood}}
    return EvalResult(**perplexity_metrics(totals), loglikelihood=totals.loglikelihood, tokens=totals.tokens,
                      words=totals.words, bytes=totals.bytes, documents=totals.documents, windows=len(windows),
                      context=context, seconds=time.perf_counter() - start,
                      device=str(device) if device is not None else "cpu", threads=torch.get_num_threads(), **compared)


def evaluate_model(
    loaded: Any,
    documents: Sequence[Document],
    context: int = 512,
    *,
    batch_size: int = 1,
    max_docs: int | None = None,
    max_tokens: int | None = None,
    num_threads: int = 0,
    progress: bool = False,
    device: str | torch.device | None = None,
) -> EvalResult:
    """Perplexity of a loaded float model (:func:`npuq.models.load_model`) on ``documents``.

    ``num_threads``: torch threads while scoring, applied through :func:`npuq.threads.thread_scope`;
    0 leaves torch's count as it is. ``device``: where to score; the model moves there in place
    (None: where it is).
    """
    check_context(context, loaded.config.max_position_embeddings)
    model = loaded.model if device is None else loaded.model.to(device)
    device = device_of(model)
    if context > model.max_context:
        raise NpuqError(
            f"--context {context} exceeds the {model.max_context} positions the model was prepared for: "
            f"load it with load_model(..., max_context={context})"
        )

    with scope_or_keep(num_threads) as threads:
        result = evaluate_perplexity(
            lambda tokens: forward_logits(model, tokens), loaded.encoder, documents, context,
            batch_size=batch_size, max_docs=max_docs, max_tokens=max_tokens, progress=progress, device=device,
        )
    return replace(result, graphs={"model": loaded.name}, threads=threads, device=str(device))
