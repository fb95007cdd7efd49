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


def phase_workload(model: torch.nn.Module, phase: str, context: int = 512, ar_len: int | None = None,
                   batch: int = 1) -> Workload:
    """One forward of ``model`` (a float StaticDecoder) in ``phase`` mode; ar_len for prefill (default 32)."""
    from npuq.runtime.runner import example_inputs

    if phase not in PHASES:
        raise NpuqError(f"unknown phase {phase!r}; choose one of {', '.join(PHASES)}")
    if context > model.max_context:
        raise NpuqError(f"--context {context} exceeds what the model was prepared for ({model.max_context})")
    cfg = model.config
    inputs = example_inputs(cfg, phase, context, ar_len, batch)
    steps = inputs[0].shape[1]  # tokens per call: 1, ar_len or context

    def run() -> None:
        with torch.no_grad():
            model(*inputs)

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    signature = f"{cfg.arch}-{model_fingerprint(cfg)}|{phase}|context={context}|ar_len={steps}|batch={batch}|{dtype}"
    return Workload(run, signature, tokens_per_step=steps * batch)

