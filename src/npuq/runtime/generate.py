"""Greedy generation through the static prefill (AR-N) and decode (AR-1) graphs."""

from __future__ import annotations

import time
from typing import Any

import torch

from npuq.device import is_cpu
from npuq.errors import NpuqError
from npuq.runtime.runner import StaticRunner
from npuq.threads import ThreadPlan, plan_threads
from npuq.runtime.workloads import phase_workloads


def generate(
    loaded: Any,
    prompt: str,
    max_new_tokens: int = 32,
    context: int = 512,
    prefill_len: int = 32,
    num_threads: int = 0,
    graphs: dict[int, Any] | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """Greedy continuation of ``prompt``; stops at EOS or after ``max_new_tokens``.

    ``graphs`` (ar_len → callable, e.g. quantized programs or ONNX sessions built for exactly
    ``context``) replace the float model; their thread plan is tuned on the float model's
    workloads of the same shapes.

    Result: text, token_ids (generated only), prefill_seconds, decode_seconds,
    tokens_per_second (decode steps per second), threads (of decode), thread_plan (per phase:
    threads and source), device. ``num_threads`` > 0 runs both phases with that many; 0 tunes
    them on the CPU and keeps torch's count elsewhere.

    ``device``: where the runner keeps its cache and inputs; without ``graphs`` the float model
    moves there in place, given ``graphs`` must already be there.
    """
    cfg, model = loaded.config, loaded.model
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
    if graphs is None:
        graphs = {1: model.to(device), prefill_len: model}
    prefill_len = max(graphs)
    runner = StaticRunner(cfg, graphs, context, device=device)
    eos = cfg.eos_token_id
    if is_cpu(device):
        # num_threads 0: each phase's count is tuned once per host and cached (npuq.threads).
        plan, _ = plan_threads(phase_workloads(model, ("prefill", "decode"), context, prefill_len), num_threads)
    else:  # the GPU does the work: no CPU tuning, and the float model may not be on the CPU to time
        plan = ThreadPlan.untuned(("prefill", "decode"), num_threads)

    start = time.perf_counter()
    with plan.scope("prefill"):
        logits = runner.feed(prompt_ids)
    prefill_seconds = time.perf_counter() - start
    generated = [int(logits[0, -1].argmax())]
    start = time.perf_counter()
    with plan.scope("decode"):
        while len(generated) < max_new_tokens and generated[-1] != eos:
            logits = runner.feed([generated[-1]])
            generated.append(int(logits[0, -1].argmax()))
    decode_seconds = time.perf_counter() - start
    steps = len(generated) - 1
    return {
        "text": tokenizer.decode(generated, skip_special_tokens=True),
        "token_ids": generated,
        "prompt_tokens": len(prompt_ids),
        "prefill_seconds": prefill_seconds,
        "decode_seconds": decode_seconds,
        "tokens_per_second": steps / decode_seconds if steps and decode_seconds > 0 else 0.0,
        "threads": plan.threads["decode"],
        "thread_plan": plan.to_dict(),
        "device": str(runner.device),
    }
