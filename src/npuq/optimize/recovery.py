"""Accuracy recovery for a whole model under a recipe: which layers SeqMSE/GPTQ may touch, the
driver call (npuq.optimize.driver.RecoveryOptions, checked on construction) whose scales the
quantizer pins, and what it did (:class:`RecoverySummary`, an artifact's "optimize" record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from npuq.device import is_cpu
from npuq.errors import NpuqError
from npuq.optimize.driver import MAX_BITS, RecoveryOptions, WeightSpec, optimize_weights
from npuq.quant.schemes import PerBlock


@dataclass(frozen=True)
class SeqMseSummary:
    candidates: int | None  # candidate scales per weight; None: min/max scales
    granularity: str | None  # None without SeqMSE
    seconds: float


@dataclass(frozen=True)
class RoundingSummary:
    method: str  # npuq.optimize.driver.ROUNDINGS
    seconds: float
    act_order: bool | None  # GPTQ's column order; None: nearest rounding


@dataclass(frozen=True)
class RecoverySummary:
    """What SeqMSE and GPTQ did to a model: config.json's "optimize" and the quantize result's
    ``seq_mse`` / ``weight_rounding`` (written with npuq.records.to_json, in this field order)."""

    seq_mse: SeqMseSummary
    weight_rounding: RoundingSummary
    gram_seconds: float  # collecting the layers' input Gram matrices
    layer_inputs: str  # npuq.optimize.driver.INPUTS
    layers: int  # linear layers optimised
    output_error_reduction: float  # 1 - the layers' summed output error after / with min/max scales


def linear_weight_specs(model: Any, recipe: Any) -> dict[str, Any]:
    """WeightSpec of every linear layer under ``recipe`` whose weights the driver can optimise
    (at most its MAX_BITS): module path → bits, block size; LPBQ layers of 16a4w_block keep the
    backend's block-scale rule (npuq.optimize.driver)."""
    specs = {}
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        scheme = recipe.resolve(path, "linear")[0]
        if scheme.weight.bits > MAX_BITS:
            continue
        g = scheme.weight.granularity
        if isinstance(g, PerBlock):
            specs[path] = WeightSpec(bits=scheme.weight.bits, block_size=g.size, scale_bits=g.scale_bits,
                                     eps=scheme.weight.eps)
        else:
            specs[path] = WeightSpec(bits=scheme.weight.bits)
    return specs


def optimize_for_recipe(
    model: Any, recipe: Any, windows: Any, options: RecoveryOptions, *, progress: bool, device: Any = None,
) -> tuple[dict[str, Any], RecoverySummary]:
    """SeqMSE and/or GPTQ as ``options`` say on every linear layer of the float ``model``
    (weights rewritten in place on the chosen grid). Returns (module path → (O,) scales, or
    (O, blocks) for LPBQ, to pin; what was done).

    On a GPU ``device`` the model visits it for the Gram collection and the search and comes
    back to the CPU (where it is exported) with its rewritten weights."""
    specs = linear_weight_specs(model, recipe)
    if not specs:
        raise NpuqError(f"SeqMSE and GPTQ do not apply to recipe {recipe.name!r}: every linear layer has "
                        f"weights wider than {MAX_BITS} bits, whose rounding error is already negligible; drop "
                        "--seq-mse / --weight-rounding gptq, or choose a scheme with 8- or 4-bit weights")
    rows = [row.unsqueeze(0) for row in windows.rows()]
    if is_cpu(device):
        results, timings = optimize_weights(model, rows, specs, options, progress=progress)
    else:
        try:
            results, timings = optimize_weights(model.to(device), rows, specs, options, progress=progress)
        finally:
            model.to("cpu")
    before = sum(r.loss_minmax for r in results.values())
    after = sum(r.loss for r in results.values())
    o = options
    summary = RecoverySummary(
        seq_mse=SeqMseSummary(o.seq_mse, o.seq_mse_granularity if o.seq_mse else None, timings["seq_mse_seconds"]),
        weight_rounding=RoundingSummary(o.weight_rounding, timings["rounding_seconds"],
                                        o.gptq.act_order if o.gptq is not None else None),
        gram_seconds=timings["collect_seconds"],
        layer_inputs=o.layer_inputs,
        layers=len(results),
        output_error_reduction=1 - after / before if before > 0 else 0.0,
    )
    return {name: r.scale for name, r in results.items()}, summary
