"""The eval stage: perplexity of a float model or of quantized graphs on a corpus, and with a
float reference the graphs' divergence from it. ``npuq eval`` (without --tasks) and the
eval-float, eval-quantized and eval-exported stages of ``npuq run`` are all :func:`run_eval`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from npuq.data.corpora import Document, replaced_characters
from npuq.eval.perplexity import EvalOptions, EvalResult, evaluate_model
from npuq.runtime.context import ExecutionContext
from npuq.runtime.runner import forward_logits


@dataclass(frozen=True)
class EvalInputs:
    """What is scored. Without ``graphs``: the float ``model`` itself (a loaded or streamed
    model), whole windows in the calibrate phase's shape. With ``graphs`` (an object with
    ``evaluate(encoder, documents, context, **options)``, npuq.pipeline.programs.Programs):
    those graphs in prefill chunks from an empty cache, encoding with ``encoder``; a ``model``
    beside them is the float reference scored on the same windows (kld_mean, kld_p99, top-1)."""

    documents: Sequence[Document]
    model: Any = None
    graphs: Any = None
    encoder: Any = None


def run_eval(options: EvalOptions, inputs: EvalInputs, ctx: ExecutionContext) -> EvalResult:
    """Score ``inputs`` as ``options`` say on ``ctx``'s device and planned threads (calibrate
    for a float model, prefill for graphs); models moved to a GPU come back to the CPU."""
    o = options
    if inputs.graphs is None:
        try:
            with ctx.scope("calibrate") as threads:
                result = evaluate_model(inputs.model, inputs.documents, o.context, batch_size=o.batch_size,
                                        max_docs=o.max_docs, max_tokens=o.max_tokens, num_threads=threads,
                                        progress=ctx.progress, device=None if ctx.on_cpu else ctx.device)
        finally:
            if not ctx.on_cpu:
                inputs.model.model.to("cpu")  # later work runs it on the CPU
    else:
        reference = None if inputs.model is None else inputs.model.model.to(ctx.device)
        try:
            with ctx.scope("prefill") as threads:
                result = inputs.graphs.evaluate(
                    inputs.encoder, inputs.documents, o.context, max_docs=o.max_docs, max_tokens=o.max_tokens,
                    progress=ctx.progress, device=ctx.device,
                    reference_fn=None if reference is None else (lambda tokens: forward_logits(reference, tokens)))
        finally:
            if reference is not None:
                reference.to("cpu")
        result = replace(result, threads=threads)
        if result.reference is not None:
            result = replace(result, reference={"model": inputs.model.name, **result.reference})
    return replace(result, corpus=o.corpus, split=None if o.corpus.startswith("file:") else o.split,
                   replacement_characters=replaced_characters(inputs.documents))  # non-UTF-8 bytes read as U+FFFD
