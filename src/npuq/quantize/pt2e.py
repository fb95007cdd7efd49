"""quantize_model: export → prepare → calibrate → carry encodings → convert.

    onepass     calibrate graph (T = L, dynamic batch/length) on whole windows; its observer
                state is copied node by node into the decode and prefill graphs
    sequential  the decode graph itself, token by token with its own KV cache; its state is
                copied into the prefill graph

Either way decode and prefill end with identical encodings, and each KV-cache input shares
its observer with the matching K/V output (see npuq.quant.quantizer), so the encoding of a
cache input equals that of the cache output the runner copies into it.

Export, prepare and convert run on the CPU; only the observed graph visits ``device`` for the
calibration forwards (observers included) and comes back before its state is copied, so the
programs and encodings hold CPU tensors whatever device calibrated them.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.fx import GraphModule
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from npuq.calibrate.encodings import collect_encodings
from npuq.calibrate.engines import calibrate_onepass, calibrate_sequential
from npuq.calibrate.graphs import export_graph
from npuq.calibrate.transfer import copy_observer_state
from npuq.calibrate.split import CalibrationWindows, split_windows
from npuq.device import device_of, is_cpu, move_graph
from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.quant.observers import name_observers, pin_weight_scales
from npuq.quant.quantizer import HtpQuantizer
from npuq.quant.recipe import Recipe, RecipePlan
from npuq.resources import available_memory, guard_calibration_batch
from npuq.runtime.runner import run_programs
from npuq.threads.scope import scope_or_keep

CALIBRATION_MODES = ("onepass", "sequential")
DEFAULT_PREFILL_LEN = 32


def default_prefill_len(context: int) -> int:
    return max(1, min(DEFAULT_PREFILL_LEN, context // 2))


@dataclass
class QuantizedModel:
    """Converted decode and prefill programs with their encodings (and how they were made)."""

    config: ModelConfig
    context: int
    prefill_len: int
    decode: GraphModule
    prefill: GraphModule
    encodings: dict[str, Any]
    recipe: Recipe
    plan: RecipePlan | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def graphs(self) -> dict[int, GraphModule]:
        return {1: self.decode, self.prefill_len: self.prefill}

    def to(self, device: str | torch.device) -> QuantizedModel:
        """Move both programs to ``device`` in place (:func:`npuq.device.move_graph`); returns self."""
        for gm in (self.decode, self.prefill):
            move_graph(gm, device)
        return self

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """LogitsFn: (B, T) → (B, T, V) from an empty cache, through prefill chunks and decode
        steps exactly as a device runs the two programs (one sequence at a time: batch 1).
        Runs where ``tokens`` are; the programs must be there too (:meth:`to`)."""
        return run_programs(self.config, self.graphs(), self.context, tokens)


def prepare_graph(
    model: torch.nn.Module, recipe: Recipe, mode: str, context: int, ar_len: int | None = None,
    weight_scales: dict[str, torch.Tensor] | None = None,
) -> tuple[GraphModule, HtpQuantizer]:
    """Export one graph and insert observers (and record which tensors each observer watches).

    ``weight_scales`` (linear module path → (O,) scales from SeqMSE/GPTQ) pin those weight
    encodings instead of observing min/max.
    """
    quantizer = HtpQuantizer(recipe, model.config.num_layers)
    prepared = prepare_pt2e(export_graph(model, mode, context, ar_len), quantizer)
    name_observers(prepared)
    if weight_scales:
        pin_weight_scales(prepared, weight_scales)
    return prepared, quantizer


def quantize_model(
    model: torch.nn.Module,
    recipe: Recipe,
    tokens: Sequence[int] | torch.Tensor | CalibrationWindows,
    *,
    context: int,
    mode: str = "onepass",
    prefill_len: int | None = None,
    batch_size: int = 8,
    num_threads: int = 0,
    progress: bool = False,
    weight_scales: dict[str, torch.Tensor] | None = None,
    device: str | torch.device | None = None,
) -> QuantizedModel:
    """Quantize a StaticDecoder with ``recipe``, calibrated on ``tokens`` (see module docstring).

    ``num_threads`` > 0 runs calibration at that many torch threads (restored afterwards);
    0 keeps the current count. ``weight_scales``: see :func:`prepare_graph`. ``device``: where
    the calibration forwards run (None: the CPU); the model itself must be on the CPU, where it
    is exported. ``stats`` of the result holds the timings and counts the CLI reports.
    """
    if mode not in CALIBRATION_MODES:
        raise NpuqError(f"unknown calibration mode {mode!r}; choose one of {', '.join(CALIBRATION_MODES)}")
    if not is_cpu(device_of(model)):
        raise ValueError(f"the model is on {device_of(model)}: it is exported on the CPU, pass device= for calibration")
    device = torch.device("cpu") if device is None else torch.device(device)
    if context > model.max_context:
        raise NpuqError(f"--context {context} exceeds the {model.max_context} positions the model was prepared for")
    prefill_len = prefill_len or default_prefill_len(context)
    if not 1 <= prefill_len < context:
        raise NpuqError(f"prefill length {prefill_len} must be at least 1 and below the context {context}")
    windows = tokens if isinstance(tokens, CalibrationWindows) else split_windows(tokens, context)
    cfg = model.config
    start = time.perf_counter()

    decode, quantizer = prepare_graph(model, recipe, "decode", context, weight_scales=weight_scales)
    prefill, _ = prepare_graph(model, recipe, "prefill", context, prefill_len, weight_scales)
    calib = prepare_graph(model, recipe, "calibrate", context, weight_scales=weight_scales)[0] if mode == "onepass" else None
    prepared_at = time.perf_counter()

    bar = _progress_bar(windows.tokens, f"calibrating ({mode})") if progress else None
    update = bar.update if bar is not None else None
    if num_threads < 0:
        raise NpuqError(f"thread count {num_threads} is negative: give 0 for the current count or a positive number")
    observed = calib if calib is not None else decode
    with scope_or_keep(num_threads) as threads:
        try:
            if not is_cpu(device):
                move_graph(observed, device)
            data = windows.to(device)  # the same tensors on the CPU
            if calib is not None:  # fewer windows per forward if the memory estimate says so
                batch_size = guard_calibration_batch(cfg, context, batch_size, available_memory(device)).batch
                calibrate_onepass(calib, cfg, data, batch_size, update)
            else:
                calibrate_sequential(decode, cfg, data, context, update)
        finally:
            if not is_cpu(device):
                move_graph(observed, "cpu")
            if bar is not None:
                bar.close()
        if calib is not None:
            copy_observer_state(calib, decode)
        copy_observer_state(decode, prefill)
    calibrated_at = time.perf_counter()

    encodings = collect_encodings(decode)
    decode_q, prefill_q = (drop_unused_tensors(convert_pt2e(gm)) for gm in (decode, prefill))
    done = time.perf_counter()
    stats = {
        "scheme": recipe.default,
        "recipe": recipe.name,
        "calibration_mode": mode,
        "calibration_tokens": windows.tokens,
        "calibration_windows": len(windows.rows()),
        "context": context,
        "prefill_len": prefill_len,
        "prepare_seconds": prepared_at - start,
        "calibration_seconds": calibrated_at - prepared_at,
        "convert_seconds": done - calibrated_at,
        "threads": threads,
        "device": str(device),
        "batch_size": batch_size if calib is not None else 1,
    }
    return QuantizedModel(cfg, context, prefill_len, decode_q, prefill_q, encodings, recipe, quantizer.plan, stats)


def fold_constant_dequant(gm: GraphModule) -> GraphModule:
    """Replace every dequantize op whose inputs are all constants (integer weights and their
    scales) by its float result, computed once. The numbers are unchanged; a CPU simulation
    then skips dequantizing every weight at every call (most of a prefill call's time)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or "dequantize" not in str(node.target):
            continue
        if not node.all_input_nodes or any(a.op != "get_attr" for a in node.all_input_nodes):
            continue

        def value(arg):
            if isinstance(arg, torch.fx.Node):
                obj = gm
                for part in arg.target.split("."):
                    obj = getattr(obj, part)
                return obj
            if isinstance(arg, (list, tuple)):
                return type(arg)(value(a) for a in arg)
            return arg

        with torch.no_grad():
            result = node.target(*value(node.args), **{k: value(v) for k, v in node.kwargs.items()})
        name = f"_folded_{node.name}"
        gm.register_buffer(name, result.detach().contiguous())
        with graph.inserting_before(node):
            const = graph.get_attr(name)
        node.replace_all_uses_with(const)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()
    return drop_unused_tensors(gm)


def drop_unused_tensors(gm: GraphModule) -> GraphModule:
    """Delete parameters and buffers no get_attr reads: after convert the float weights are
    replaced by folded integer constants but stay attached, and an export would save both."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, _ in named:
        if name in used:
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if hasattr(owner, attr):
            delattr(owner, attr)
    return gm


def _progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False)
