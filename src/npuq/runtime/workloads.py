"""The real float workload of each phase, to tune thread counts on.

A phase's workload is one forward of the static decoder in that mode on its example inputs
(runtime.runner.example_inputs): decode = AR-1 step over a full cache, prefill = AR-N chunk,
calibrate = the whole context with no cache. It runs before any observer exists, so the
repeated benchmark calls never touch calibration statistics.

The eager module is timed rather than the exported graph the published version uses: both run
the same aten kernels on the same shapes, which is what the thread count acts on, and eager
timing skips an export of several seconds per phase.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from npuq.errors import NpuqError
from npuq.threads.tuner import Workload

PHASES = ("decode", "prefill", "calibrate")


def model_fingerprint(config: Any) -> str:
    """A short hash of the architecture facts that decide a forward's cost (not the weights)."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:12]


def windows_per_forward(tokens: int | None, context: int, batch_size: int) -> int:
    """Windows of ``context`` tokens one calibrate-phase forward holds in a job of ``tokens``
    tokens (None: no limit): ``batch_size``, or fewer when the job has fewer windows. The
    workload that plans the threads must have the shape that runs: a forward of 8 windows for
    a job of 2 costs four times any call the job makes, five times over while tuning."""
    if tokens is None:
        return batch_size
    return max(1, min(batch_size, -(-tokens // context)))


def phase_workload(model: torch.nn.Module, phase: str, context: int = 512, ar_len: int | None = None,
                   batch: int = 1) -> Workload:
    """One forward of ``model`` (a float StaticDecoder) in ``phase`` mode; ar_len for prefill (default 32).

    A decode step is timed as the runner drives the eager float decoder (npuq.runtime.runner):
    over the filled slots only (half the context) with fused attention, the step generation runs.
    """
    from npuq.runtime.runner import example_inputs, step_inputs

    if phase not in PHASES:
        raise NpuqError(f"unknown phase {phase!r}; choose one of {', '.join(PHASES)}")
    if context > model.max_context:
        raise NpuqError(f"--context {context} exceeds what the model was prepared for ({model.max_context})")
    cfg = model.config
    inputs = example_inputs(cfg, phase, context, ar_len, batch)
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
    signature = (f"{cfg.arch}-{model_fingerprint(cfg)}|{phase}|context={context}|ar_len={steps}|batch={batch}|{dtype}"
                 f"{path}")
    return Workload(run, signature, tokens_per_step=steps * batch)

