"""Accuracy recovery for a model under a recipe, whole or part by part: which layers SeqMSE/GPTQ
may touch, the driver calls (npuq.optimize.driver.RecoveryOptions, checked on construction)
whose scales the quantizer pins, and what they did (:class:`RecoverySummary`, an artifact's
"optimize" record)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from npuq.device import is_cpu
from npuq.errors import NpuqError
from npuq.models.decoder import in_part
from npuq.optimize.driver import MAX_BITS, RecoveryOptions, WeightOptimizer, WeightSpec
from npuq.quant.schemes import PerBlock
from npuq.records import optional_key


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
    # GPTQ's damping (GptqOptions.damp); None (no key): nearest rounding, or an artifact older than the field
    damp: float | None = optional_key()
    damp_down: float | None = optional_key()  # the MLP down projections' (GptqOptions.damp_down); the same None


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


class PartRecovery:
    """SeqMSE and/or GPTQ as ``options`` say on every linear layer of a float model under
    ``recipe``, part by part: ``recovery(model, first, end)``, called with the layers first …
    end - 1 (and the head, with the last) in memory, parts in order, rewrites those layers'
    weights in place on the chosen grid and returns their scales to pin (module path → (O,)
    scales, or (O, blocks) for LPBQ). npuq.quantize.pt2e.quantize_model calls it on each part
    before preparing it (``recover``), so a model streamed from disk is recovered as it is
    quantized; the parts give the whole model's scales and codes (npuq.optimize.driver).

    ``model``: the model, or the skeleton of a streamed one (module names and types only).
    On a GPU ``device`` each part visits it for the Gram collection and the search and comes
    back to the CPU (where it is exported) with its rewritten weights."""

    def __init__(self, model: Any, recipe: Any, windows: Any, options: RecoveryOptions, *, progress: bool,
                 device: Any = None) -> None:
        self.specs = linear_weight_specs(model, recipe)
        if not self.specs:
            raise NpuqError(f"SeqMSE and GPTQ do not apply to recipe {recipe.name!r}: every linear layer has "
                            f"weights wider than {MAX_BITS} bits, whose rounding error is already negligible; drop "
                            "--seq-mse / --weight-rounding gptq, or choose a scheme with 8- or 4-bit weights")
        self.options, self.device = options, device
        self.optimizer = WeightOptimizer([row.unsqueeze(0) for row in windows.rows()], options, progress=progress)

    def __call__(self, model: Any, first: int, end: int) -> dict[str, torch.Tensor]:
        L = model.config.num_layers
        specs = {name: spec for name, spec in self.specs.items() if in_part(name, first, end, L)}
        if is_cpu(self.device):
            results = self.optimizer.part(model, first, end, specs)
        else:
            try:
                results = self.optimizer.part(model.to(self.device), first, end, specs)
            finally:
                model.to("cpu")
        return {name: r.scale for name, r in results.items()}

    def summary(self) -> RecoverySummary:
        """What was done over the parts so far."""
        results, timings, o = self.optimizer.results, self.optimizer.timings, self.options
        gptq = o.gptq
        act_order, damp, damp_down = (gptq.act_order, gptq.damp, gptq.damp_down) if gptq else (None, None, None)
        before = sum(r.loss_minmax for r in results.values())
        after = sum(r.loss for r in results.values())
        return RecoverySummary(
            seq_mse=SeqMseSummary(o.seq_mse, o.seq_mse_granularity if o.seq_mse else None, timings["seq_mse_seconds"]),
            weight_rounding=RoundingSummary(o.weight_rounding, timings["rounding_seconds"], act_order, damp,
                                            damp_down),
            gram_seconds=timings["collect_seconds"],
            layer_inputs=o.layer_inputs,
            layers=len(results),
            output_error_reduction=1 - after / before if before > 0 else 0.0,
        )


def optimize_for_recipe(
    model: Any, recipe: Any, windows: Any, options: RecoveryOptions, *, progress: bool, device: Any = None,
) -> tuple[dict[str, Any], RecoverySummary]:
    """:class:`PartRecovery` over the whole float ``model`` at once: (scales to pin, what was done)."""
    recovery = PartRecovery(model, recipe, windows, options, progress=progress, device=device)
    scales = recovery(model, 0, model.config.num_layers)
    return scales, recovery.summary()
