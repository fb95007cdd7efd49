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


def empty_caches(cfg: ModelConfig, batch: int, device: torch.device | str,
                 layers: int | None = None) -> tuple[torch.Tensor, ...]:
    """K then V caches of zero slots: (B, KV, D, 0) and (B, KV, 0, D) per layer (``layers``
    of them; default all of the model's)."""
    KV, D = cfg.num_kv_heads, cfg.head_dim
    L = cfg.num_layers if layers is None else layers
    return (tuple(torch.zeros(batch, KV, D, 0, device=device) for _ in range(L))
            + tuple(torch.zeros(batch, KV, 0, D, device=device) for _ in range(L)))


def onepass_batches(windows: CalibrationWindows, batch_size: int) -> list[torch.Tensor]:
    """The token ids of each one-pass forward: whole windows ``batch_size`` at a time, then the
    tail on its own."""
    # Slices rather than Tensor.split: the same views, and split's confuse torch's lazy backend,
    # which the device tests use as a second device on CPU-only machines.
    full = windows.full
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    return batches + ([windows.tail] if windows.tail is not None else [])


def calibrate_onepass(
    graph: GraphModule, cfg: ModelConfig, windows: CalibrationWindows, batch_size: int = 8,
    progress: Progress | None = None, *, hidden: list[torch.Tensor] | None = None, keep: bool = False,
    rows: int | None = None,
) -> list[torch.Tensor] | None:
    """Run the observed calibrate graph (dynamic B, T) on whole windows, ``batch_size`` per
    forward, then the tail as its own shorter forward: no padded position reaches an observer.
    A graph with cache inputs (:func:`npuq.calibrate.graphs.calibration_view`) gets an empty
    cache, so each window still starts from position 0 with nothing before it.

    A part of the model (:func:`npuq.calibrate.graphs.part_graph`) takes ``hidden``, the hidden
    states of each forward (:func:`onepass_batches`) that the part before it returned, instead
    of the token ids, and caches for its own layers; ``keep``: return what each forward
    returned first (the hidden states the next part takes).

    ``rows``: run each forward as calls of at most that many windows (the part that holds the
    head, whose logits are windows × context × vocabulary floats: 0.31 GB a window at 512
    tokens of a 152k vocabulary). Every op of the graph computes each window on its own and the
    observers keep a running min/max, so the encodings are the same; what a forward returns
    (``keep``) is its calls' results joined."""
    batches = onepass_batches(windows, batch_size)
    if hidden is not None and len(hidden) != len(batches):
        raise ValueError(f"{len(hidden)} hidden-state batches for {len(batches)} forwards")
    if rows is not None and rows < 1:
        raise ValueError(f"rows {rows}: a call takes at least one window")
    n_caches = len(graph_inputs(graph)) - 3
    kept = []
    with torch.no_grad():
        for j, tokens in enumerate(batches):
            T = tokens.shape[1]
            x = tokens if hidden is None else hidden[j]
            step = len(tokens) if rows is None else rows
            outs = []
            for i in range(0, len(tokens), step):
                chunk = tokens[i : i + step]
                caches = empty_caches(cfg, chunk.shape[0], chunk.device, n_caches // 2) if n_caches else ()
                _, mask, positions = step_inputs(cfg, chunk, 0, T)
                out = graph(x[i : i + step], mask, positions, *caches)
                check_observers(graph)
                if keep:
                    outs.append(out[0])
                del out
            if keep:
                kept.append(outs[0] if len(outs) == 1 else torch.cat(outs))
            if progress:
                progress(tokens.numel())
    return kept if keep else None


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
