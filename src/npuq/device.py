"""Where calibration and evaluation run: ``--device auto|cpu|cuda[:N]``.

The rule everywhere else in npuq is "follow the input": the runner, the mask builders, the
calibration engines, the scorer and SeqMSE/GPTQ create their tensors on the device of the
tokens, model or weights they are given, so only the drivers (CLI and ``quantize_to_artifact``)
decide where things live. Export, PT2E prepare/convert and saving always happen on the CPU:
an artifact holds CPU tensors and loads anywhere.

``auto`` (the CLI default) is CUDA when torch sees a GPU, else the CPU, so a GPU is used where
one exists and a CPU-only machine needs no flag; ``--device cpu`` forces the CPU (and its
thread tuning) on a GPU machine. Results record the device they ran on.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from npuq.errors import NpuqError


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` → ``cuda:0``-style device if torch sees a GPU, else ``cpu``; a CUDA device that is
    not there → NpuqError naming why and the fix. CUDA devices come back with their index, the
    form a tensor's ``.device`` has."""
    if str(name) == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        build = (f"torch {torch.__version__} built with CUDA {torch.version.cuda}, but no GPU is visible: check the "
                 "driver and CUDA_VISIBLE_DEVICES" if torch.version.cuda else f"torch {torch.__version__} built for CPU")
        raise NpuqError(f"--device {name}: CUDA is not available ({build}): use --device cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise NpuqError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}: "
                        f"use one of those")
    return torch.device("cuda", index)


def is_cpu(device: str | torch.device | None) -> bool:
    return device is None or torch.device(device).type == "cpu"


def device_of(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter or buffer (CPU for a module without either)."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def move_graph(gm: GraphModule, device: str | torch.device) -> GraphModule:
    """Move an exported (or prepared / converted) graph's weights, buffers and observers to
    ``device`` in place, and retarget the device its nodes record.

    torch.export bakes the export device into an ``aten._assert_tensor_metadata`` check before
    every dtype cast (``.float()``, ``.to(dtype)``); left alone, a graph exported on the CPU
    refuses CUDA tensors. Moving back to the CPU restores the graph exactly.
    """
    device = torch.empty(0, device=device).device  # "cuda" → "cuda:0": the checks compare the index too
    changed = False
    for node in gm.graph.nodes:
        recorded = node.kwargs.get("device")
        if isinstance(recorded, torch.device) and recorded != device:
            node.update_kwarg("device", device)
            changed = True
    if changed:
        gm.recompile()
    return gm.to(device)
