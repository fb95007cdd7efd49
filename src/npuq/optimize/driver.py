"""Apply SeqMSE and GPTQ to every quantized linear layer of a float StaticDecoder.

The driver works on the float model before export: it runs the calibration windows once to
collect each layer's input Gram matrix XᵀX (layers that read the same tensor, q/k/v and
gate/up, share one), searches the scales and rounds the weights layer by layer, and writes the
rounded weights back as float values that lie exactly on the chosen grid. The returned scales
are what the PT2E weight observers must report, so the artifact carries exactly these
integers (per-channel or per-block int4/int8, unchanged format).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from npuq.optimize.gptq import gptq_codes
from npuq.optimize.seqmse import GramFactor, minmax_scale, quantize_codes, seq_mse_search

ROUNDINGS = ("nearest", "gptq")


@dataclass(frozen=True)
class WeightSpec:
    """How one linear layer's weight is quantized: symmetric, ``bits`` wide, per channel or block."""

    bits: int
    block_size: int | None = None


@dataclass(frozen=True)
class OptimizedWeight:
    scale: torch.Tensor  # (O,) or (O, I / block_size)
    codes: torch.Tensor  # (O, I) int8, in [-qmax, qmax]
    loss_minmax: float  # calibration output error with min/max scales and nearest rounding
    loss: float  # the same error after optimisation


def collect_grams(model: nn.Module, windows: Iterable[torch.Tensor], names: list[str]) -> tuple[dict[str, int], list[torch.Tensor]]:
    """Accumulate XᵀX (I, I) of each named linear layer's input over ``windows`` (each (B, T) tokens).

    Returns (layer → group index, Gram per group). Consecutive layers called on the very same
    tensor (q/k/v, gate/up) form one group and their input is counted once.
    """
    from npuq.runtime.runner import forward_logits

    modules = dict(model.named_modules())
    group_of: dict[str, int] = {}
    grams: list[torch.Tensor] = []
    last: dict[str, object] = {"input": None, "group": None}

    def hook(name):
        def fn(_module, args):
            x = args[0]
            shared = x is last["input"]
            if name not in group_of:
                group_of[name] = last["group"] if shared else len(grams)
                if not shared:
                    grams.append(torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64))
            if not shared:
                flat = x.detach().reshape(-1, x.shape[-1]).double()
                grams[group_of[name]].addmm_(flat.T, flat)
            last["input"], last["group"] = x, group_of[name]

        return fn

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        for tokens in windows:
            last["input"] = None
            forward_logits(model, tokens)
    finally:
        last["input"] = None
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in group_of]
    if missing:
        raise ValueError(f"layers never ran during calibration: {', '.join(missing[:3])}")
    return group_of, [g.float() for g in grams]


def optimize_weights(
    model: nn.Module,
    windows: list[torch.Tensor],
    specs: dict[str, WeightSpec],
    seq_mse: int | None = 50,
    granularity: str = "channel",
    rounding: str = "nearest",
    rank: int | None = 64,
    progress: bool = True,
) -> tuple[dict[str, OptimizedWeight], dict[str, float]]:
    """Optimise every layer in ``specs`` (module path → WeightSpec) and write its weights back.

    ``seq_mse`` None keeps min/max scales; ``rounding`` "gptq" replaces nearest rounding.
    Returns (per-layer results, {"collect_seconds", "seq_mse_seconds", "rounding_seconds"}).
    """
    from tqdm import tqdm

    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    timings = {"collect_seconds": 0.0, "seq_mse_seconds": 0.0, "rounding_seconds": 0.0}
    start = time.perf_counter()
    names = list(specs)
    group_of, grams = collect_grams(model, windows, names)
    timings["collect_seconds"] = time.perf_counter() - start
    factors: dict[int, GramFactor] = {}
    modules = dict(model.named_modules())
    results: dict[str, OptimizedWeight] = {}
    for name in tqdm(names, desc="weights", unit="layer", disable=not progress, leave=False):
        spec = specs[name]
        weight = modules[name].weight.detach().float()
        gram = grams[group_of[name]]
        t0 = time.perf_counter()
        if seq_mse:
            if spec.block_size is None:
                if group_of[name] not in factors:
                    factors[group_of[name]] = GramFactor.from_gram(gram, rank)
                source = factors[group_of[name]]
            else:
                source = gram
            found = seq_mse_search(weight, source, spec.bits, seq_mse, granularity, spec.block_size, rank)
            scale, loss_minmax = found.scale, found.loss_minmax
        else:
            scale = minmax_scale(weight, spec.bits, spec.block_size)
            loss_minmax = float("nan")
        t1 = time.perf_counter()
        if rounding == "gptq":
            codes = gptq_codes(weight, gram, scale, spec.bits)
        else:
            codes = quantize_codes(weight, scale, spec.bits).to(torch.int8)
        t2 = time.perf_counter()
        timings["seq_mse_seconds"] += t1 - t0
        timings["rounding_seconds"] += t2 - t1
        dequant = _dequantize(codes, scale)
        err = weight - dequant
        loss = torch.einsum("oi,ij,oj->", err, gram, err).item()
        if not seq_mse:
            nearest = weight - _dequantize(quantize_codes(weight, scale, spec.bits), scale)
            loss_minmax = torch.einsum("oi,ij,oj->", nearest, gram, nearest).item()
        with torch.no_grad():
            modules[name].weight.copy_(dequant)
        results[name] = OptimizedWeight(scale, codes, loss_minmax, loss)
    return results, timings


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.dim() == 2:
        O, I = codes.shape
        return (codes.float().view(O, scale.shape[1], -1) * scale.unsqueeze(-1)).view(O, I)
    return codes.float() * scale.unsqueeze(1)
