"""The two calibration engines: one pass over whole windows, or AR-1 decode token by token.

Both see the same windows (:func:`npuq.calibrate.split.split_windows`), each a fresh
sequence from position 0 with an empty cache, and only real tokens: with min/max observers
the row t of a full causal forward carries exactly the values decode step t computes
(docs/design.md §3), so the two give the same encodings except for tensors whose content
depends on the cache length (see tests/calibrate/test_calibrate_onepass_vs_sequential.py).
Both run where the windows are (:meth:`CalibrationWindows.to`); the graph must be there too
(:func:`npuq.device.move_graph`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.fx import GraphModule

from npuq.calibrate.split import CalibrationWindows
from npuq.models.config import ModelConfig
from npuq.quant.graph import graph_inputs
from npuq.quant.observers import check_observers
from npuq.runtime.runner import StaticRunner, step_inputs

Progress = Callable[[int], None]  # called with the number of tokens just calibrated


def empty_caches(cfg: ModelConfig, batch: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """K then V caches of zero slots: (B, KV, D, 0) and (B, KV, 0, D) per layer."""
    KV, D, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    return (tuple(torch.zeros(batch, KV, D, 0, device=device) for _ in range(L))
            + tuple(torch.zeros(batch, KV, 0, D, device=device) for _ in range(L)))


def calibrate_onepass(
    graph: GraphModule, cfg: ModelConfig, windows: CalibrationWindows, batch_size: int = 8,
    progress: Progress | None = None,
) -> None:
    """Run the observed calibrate graph (dynamic B, T) on whole windows, ``batch_size`` per
    forward, then the tail as its own shorter forward: no padded position reaches an observer.
    A graph with cache inputs (:func:`npuq.calibrate.graphs.calibration_view`) gets an empty
    cache, so each window still starts from position 0 with nothing before it."""
    # Slices rather than Tensor.split: the same views, and split's confuse torch's lazy backend,
    # which the device tests use as a second device on CPU-only machines.
    full = windows.full
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    batches += [windows.tail] if windows.tail is not None else []
    with_cache = len(graph_inputs(graph)) > 3
    with torch.no_grad():
        for tokens in batches:
            T = tokens.shape[1]
            caches = empty_caches(cfg, tokens.shape[0], tokens.device) if with_cache else ()
            graph(*step_inputs(cfg, tokens, 0, T), *caches)
            check_observers(graph)
            if progress:
                progress(tokens.numel())


def calibrate_sequential(
    graph: GraphModule, cfg: ModelConfig, windows: CalibrationWindows, context: int,
    progress: Progress | None = None,
) -> None:
    """Run the observed decode graph (AR-1, batch 1) token by token over each window, writing
    its own KV cache (teacher forcing): the published reference."""
    for row in windows.rows():
        runner = StaticRunner(cfg, {1: graph}, context, device=row.device)
        for t in row.tolist():
            runner.feed([t])
            if progress:
                progress(1)
        check_observers(graph)
