"""Greedy generation through the static prefill (AR-N) and decode (AR-1) graphs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from npuq.errors import NpuqError
from npuq.models.stream import StreamedDecoder
from npuq.runtime.context import ExecutionContext
from npuq.runtime.runner import StaticRunner, forward_logits


@dataclass(frozen=True)
class GenerateResult:
    text: str  # the continuation only
    token_ids: tuple[int, ...]  # generated tokens
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    tokens_per_second: float  # decode steps per second
    threads: int  # of the decode phase
    thread_plan: dict[str, Any]  # phase → threads and their source
    device: str

    def describe(self) -> str:
        return (f"{len(self.token_ids)} tokens, prefill {self.prefill_seconds:.2f} s, {self.tokens_per_second:.1f} "
                f"tokens/s decode, {self.threads} threads, {self.device}")


def generate(
    loaded: Any,
    prompt: str,
    max_new_tokens: int = 32,
    context: int = 512,
    prefill_len: int = 32,
    graphs: dict[int, Any] | None = None,
    ctx: ExecutionContext | None = None,
) -> GenerateResult:
    """Greedy continuation of ``prompt``; stops at EOS or after ``max_new_tokens``.

    ``graphs`` (ar_len → callable, e.g. quantized programs or ONNX sessions built for exactly
    ``context``) replace the float model; threads are planned on the float model's workloads
    of the same shapes. ``ctx`` (default: the CPU, automatic threads): the device where the
    runner keeps its cache and inputs (without ``graphs`` the float model moves there in
    place; given ``graphs`` must already be there) and the prefill and decode thread counts.

    A streamed float model (:class:`npuq.models.stream.StreamedDecoder`, a model that does not
    fit memory) has no KV cache: without ``graphs`` each step runs the whole sequence so far
    through it, one block resident at a time (the cached run's logits within fp32 rounding);
    with ``graphs`` it gives only its tokenizer and config. Its threads are not timed.
    """
    cfg, model = loaded.config, loaded.model
    streamed = isinstance(model, StreamedDecoder)
    if context > model.max_context:
        raise NpuqError(f"--context {context} exceeds what the model was prepared for ({model.max_context})")
    if prefill_len > context:
        raise NpuqError(f"--prefill-len {prefill_len} exceeds --context {context}")
    tokenizer = loaded.tokenizer
    prompt_ids = list(tokenizer(prompt)["input_ids"])
    if not prompt_ids:
        raise NpuqError("the prompt is empty after tokenization: give some text with --prompt")
    if len(prompt_ids) + max_new_tokens > context:
        raise NpuqError(
            f"the prompt has {len(prompt_ids)} tokens; with {max_new_tokens} new tokens that exceeds the "
            f"context of {context}: raise --context or shorten the prompt / --max-new-tokens"
        )
    ctx = ctx or ExecutionContext.create("cpu")
    if graphs is None and streamed:
        runner = _WholeSequence(model.to(ctx.device))
    else:
        if graphs is None:
            graphs = {1: model.to(ctx.device), prefill_len: model}
        prefill_len = max(graphs)
        runner = StaticRunner(cfg, graphs, context, device=ctx.device)
    eos = cfg.eos_token_id
    plan = ctx.plan_model(None if streamed else model, ("prefill", "decode"), context, prefill_len)

    start = time.perf_counter()
    with ctx.scope("prefill"):
        logits = runner.feed(prompt_ids)
    prefill_seconds = time.perf_counter() - start
    generated = [int(logits[0, -1].argmax())]
    start = time.perf_counter()
    with ctx.scope("decode"):
        while len(generated) < max_new_tokens and generated[-1] != eos:
            logits = runner.feed([generated[-1]])
            generated.append(int(logits[0, -1].argmax()))
    decode_seconds = time.perf_counter() - start
    steps = len(generated) - 1
    return GenerateResult(
        text=tokenizer.decode(generated, skip_special_tokens=True), token_ids=tuple(generated),
        prompt_tokens=len(prompt_ids), prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
        tokens_per_second=steps / decode_seconds if steps and decode_seconds > 0 else 0.0,
        threads=plan.threads["decode"], thread_plan=plan.to_dict(), device=str(runner.device),
    )


class _WholeSequence:
    """A streamed model fed like a :class:`StaticRunner`: each feed runs every token so far
    from an empty cache (the model has none) and returns the logits of the new ones."""

    def __init__(self, model: StreamedDecoder):
        self.model, self.ids, self.device = model, [], torch.device("cpu")

    def feed(self, token_ids: Sequence[int]) -> torch.Tensor:
        self.ids += list(token_ids)
        logits = forward_logits(self.model, torch.tensor([self.ids]))
        return logits[:, len(self.ids) - len(token_ids):]


@dataclass(frozen=True)
class GenerationsOptions:
    """The prompts the generations stage of ``npuq run`` continues, float and quantized."""

    prompts: tuple[str, ...]
    tokens: int = 16  # new tokens per prompt


@dataclass(frozen=True)
class GenerationsInputs:
    loaded: Any  # the float model (npuq.models.LoadedModel)
    graphs: dict[int, Any]  # ar_len → quantized program
    context: int


@dataclass(frozen=True)
class Generation:
    prompt: str
    float: str
    quantized: str
    same_tokens: int  # leading tokens the two continuations share
    tokens: int  # of the float continuation
    float_tokens_per_second: float
    quantized_tokens_per_second: float


@dataclass(frozen=True)
class GenerationsResult:
    generations: tuple[Generation, ...]


def run_generations(options: GenerationsOptions, inputs: GenerationsInputs, ctx: ExecutionContext) -> GenerationsResult:
    """Each prompt continued greedily by the float model and by the quantized graphs."""
    rows = []
    for prompt in options.prompts:
        kwargs = {"max_new_tokens": options.tokens, "context": inputs.context, "prefill_len": max(inputs.graphs),
                  "ctx": ctx}
        ref = generate(inputs.loaded, prompt, **kwargs)
        quant = generate(inputs.loaded, prompt, graphs=inputs.graphs, **kwargs)
        rows.append(Generation(prompt, ref.text, quant.text, common_prefix(ref.token_ids, quant.token_ids),
                               len(ref.token_ids), ref.tokens_per_second, quant.tokens_per_second))
    return GenerationsResult(tuple(rows))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
