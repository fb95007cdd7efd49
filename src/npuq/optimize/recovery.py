"""Accuracy recovery for a whole model under a recipe: which layers SeqMSE/GPTQ may touch, the
options checked together, and the driver call whose scales the quantizer pins."""

from __future__ import annotations

from typing import Any

import torch

from npuq.device import is_cpu
from npuq.errors import NpuqError
from npuq.optimize.driver import INPUTS, MAX_BITS, ROUNDINGS, WeightSpec, optimize_weights
from npuq.quant.schemes import PerBlock


def resolve_recovery(
    seq_mse: int | None, weight_rounding: str, layer_inputs: str | None, act_order: bool | None
) -> tuple[str, bool]:
    """Check that the accuracy-recovery options make sense together (before any model loads)
    and fill in the defaults; returns (layer inputs, act-order).

    Unless set, SeqMSE and GPTQ fit each layer to the quantized model's own inputs and GPTQ
    uses act-order: on SmolLM2-135M at 4 bits the two together cut GPTQ's perplexity loss by
    a third or more (bench/accuracy.py, README), for ~10 s more collection and nothing at run
    time (the scales are fixed beforehand, so the column order leaves the format unchanged).
    """
    if seq_mse is not None and seq_mse < 1:
        raise NpuqError(f"--seq-mse {seq_mse}: the number of candidate scales must be at least 1 (the published default is 50)")
    if weight_rounding not in ROUNDINGS:
        raise NpuqError(f"--weight-rounding {weight_rounding!r}: choose one of {', '.join(ROUNDINGS)}")
    if layer_inputs is not None and layer_inputs not in INPUTS:
        raise NpuqError(f"--layer-inputs {layer_inputs!r}: choose one of {', '.join(INPUTS)}")
    if act_order is True and weight_rounding != "gptq":
        raise NpuqError("--act-order orders GPTQ's rounding and does nothing with nearest rounding: "
                        "add --weight-rounding gptq, or drop --act-order")
    if layer_inputs is not None and seq_mse is None and weight_rounding == "nearest":
        raise NpuqError(f"--layer-inputs {layer_inputs} chooses what SeqMSE and GPTQ fit to, and neither is on: "
                        "add --seq-mse N and/or --weight-rounding gptq, or drop --layer-inputs")
    return layer_inputs or "quantized", weight_rounding == "gptq" if act_order is None else act_order


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
    model: Any, recipe: Any, windows: Any, *, seq_mse: int | None, granularity: str, rounding: str, progress: bool,
    device: Any = None, inputs: str | None = None, act_order: bool | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """SeqMSE and/or GPTQ on every linear layer of the float ``model`` (weights rewritten in
    place on the chosen grid). Returns (module path → (O,) scales, or (O, blocks) for LPBQ, to
    pin; JSON summary).
    ``inputs``: "float" fits each layer to the float model's inputs, "quantized" to those of
    the model with every earlier layer already rounded (npuq.optimize.driver). ``act_order``:
    GPTQ rounds the columns in order of decreasing input energy. None: the defaults of
    :func:`resolve_recovery`.

    On a GPU ``device`` the model visits it for the Gram collection and the search and comes
    back to the CPU (where it is exported) with its rewritten weights."""
    inputs, act_order = resolve_recovery(seq_mse, rounding, inputs, act_order)
    specs = linear_weight_specs(model, recipe)
    if not specs:
        raise NpuqError(f"SeqMSE and GPTQ do not apply to recipe {recipe.name!r}: every linear layer has "
                        f"weights wider than {MAX_BITS} bits, whose rounding error is already negligible; drop "
                        "--seq-mse / --weight-rounding gptq, or choose a scheme with 8- or 4-bit weights")
    rows = [row.unsqueeze(0) for row in windows.rows()]
    options = {"seq_mse": seq_mse, "granularity": granularity, "rounding": rounding, "progress": progress,
               "inputs": inputs, "gptq_options": {"act_order": act_order}}
    if is_cpu(device):
        results, timings = optimize_weights(model, rows, specs, **options)
    else:
        try:
            results, timings = optimize_weights(model.to(device), rows, specs, **options)
        finally:
            model.to("cpu")
    before = sum(r.loss_minmax for r in results.values())
    after = sum(r.loss for r in results.values())
    summary = {
        "seq_mse": {"candidates": seq_mse, "granularity": granularity if seq_mse else None,
                    "seconds": timings["seq_mse_seconds"]},
        "weight_rounding": {"method": rounding, "seconds": timings["rounding_seconds"],
                            "act_order": act_order if rounding == "gptq" else None},
        "gram_seconds": timings["collect_seconds"],
        "layer_inputs": inputs,
        "layers": len(results),
        "output_error_reduction": 1 - after / before if before > 0 else 0.0,
    }
    return {name: r.scale for name, r in results.items()}, summary
