"""The real float workload of each phase, to tune thread counts on.

A phase's workload is one forward of the static decoder in that mode on its example inputs
(runtime.runner.example_inputs): decode = AR-1 step over a full cache, prefill = AR-N chunk,
calibrate = one window of the whole context with no cache. It runs before any observer
exists, so the repeated benchmark calls never touch calibration statistics.

Calibration and scoring run several windows per forward, but the calibrate workload is one
window: its matrix products already have ``context`` rows (compute-bound, like those of 8
windows), so the thread counts compare alike, and tuning at the job's batch cost more than the
work it tuned. On SmolLM2-135M (2 vCPUs) two threads were 1.69x / 1.86x / 1.81x faster than
one at 1 / 2 / 8 windows of 256 tokens, 1.83x / 1.77x / 1.81x at 512; tuning at 8 windows of
256 took 17.3 s in `make demo`, whose calibration is one 2.2 s forward.

The eager module is timed rather than the exported graph the published version uses: both run
the same aten kernels on the same shapes, which is what the thread count acts on, and eager
timing skips an export of several seconds per phase.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from npuq.errors import NpuqError
from npuq.runtime.runner import example_inputs, step_inputs
from npuq.threads.tuner import Workload

PHASES = ("decode", "prefill", "calibrate")


def model_fingerprint(config: Any) -> str:
    """A short hash of the architecture facts that decide a forward's cost (not the weights)."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:12]


def phase_workload(model: torch.nn.Module, phase: str, context: int = 512, ar_len: int | None = None) -> Workload:
    """One forward of ``model`` (a float StaticDecoder) in ``phase`` mode; ar_len for prefill (default 32).

    A decode step is timed as the runner drives the eager float decoder (npuq.runtime.runner):
    over the filled slots only (half the context) with fused attention, the step generation runs.
    """
    if phase not in PHASES:
        raise NpuqError(f"unknown phase {phase!r}; choose one of {', '.join(PHASES)}")
    if context > model.max_context:
        raise NpuqError(f"--context {context} exceeds what the model was prepared for ({model.max_context})")
    cfg = model.config
    inputs = example_inputs(cfg, phase, context, ar_len)
    steps = inputs[0].shape[1]  # tokens per call: 1, ar_len or context
    kwargs, path = {}, ""
    if phase == "decode":
        n_past, L = context // 2, cfg.num_layers
        caches = [k[..., :n_past] for k in inputs[3 : 3 + L]] + [v[:, :, :n_past] for v in inputs[3 + L :]]
        inputs = (*step_inputs(cfg, inputs[0], n_past, n_past + 1), *caches)
        kwargs, path = {"fused_attention": True}, f"|filled={n_past}|fused"

    def run() -> None:
        with torch.no_grad():
            model(*inputs, **kwargs)

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    signature = f"{cfg.arch}-{model_fingerprint(cfg)}|{phase}|context={context}|ar_len={steps}|batch=1|{dtype}{path}"
    return Workload(run, signature, tokens_per_step=steps)

