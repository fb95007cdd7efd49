"""Export the three graphs of one model (docs/design.md §2) as PT2E-ready GraphModules.

- calibrate: T = L tokens, no cache; exported with dynamic batch and length, so one observed
  graph takes whole windows many per batch and a short tail as its own smaller forward (no
  padding ever reaches an observer);
- prefill (AR-N) and decode (AR-1): static shapes, batch 1, cache of L - T slots, as a
  device runs them.
"""

from __future__ import annotations

import torch
from torch.export import Dim
from torch.fx import GraphModule

from npuq.runtime.runner import example_inputs


def export_graph(model: torch.nn.Module, mode: str, context: int, ar_len: int | None = None) -> GraphModule:
    """The unlifted graph of ``mode`` (calibrate / prefill / decode) at context ``context``.

    calibrate graphs have symbolic batch and length (one graph for any T ≤ context); prefill
    and decode graphs are static with batch 1.
    """
    if mode == "calibrate":
        inputs = example_inputs(model.config, "calibrate", context, batch=2)  # batch 2: not specialised to 1
        B, T = Dim.DYNAMIC, Dim.DYNAMIC
        dynamic = ({0: B, 1: T}, {0: B, 2: T, 3: T}, {0: B, 1: T})
        program = torch.export.export(model, inputs, dynamic_shapes=dynamic)
    else:
        program = torch.export.export(model, example_inputs(model.config, mode, context, ar_len))
    return program.module()
