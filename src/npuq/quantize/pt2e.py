"""quantize_model: export → prepare → calibrate → convert, one graph for every mode.

The model is exported once, as the graph with cache inputs and symbolic batch, ar_len and cache
length (:func:`npuq.calibrate.graphs.export_model_graph`), and prepared once. Calibration runs
that prepared graph's own observers:

    onepass     through :func:`npuq.calibrate.graphs.calibration_view` (T = L, no cache) on whole
                windows, many per forward, and the tail as a forward of its own length
    sequential  the graph itself as the decode graph, token by token with its own KV cache

It is converted once, and the converted graph is specialised to the two static programs a
device runs, decode (AR-1) and prefill (AR-N) at batch 1 (:func:`specialize`), and to the
prefill program at batch SCORING_BATCH that scores text, all sharing the converted weights.
Decode and prefill therefore have identical encodings by construction, and each KV-cache input
shares its observer with the matching K/V output (see
npuq.quant.quantizer), so the encoding of a cache input equals that of the cache output the
runner copies into it. The result is the one the three-graph flow gave (a graph per mode,
observer state copied node by node from the calibrate graph into decode and prefill), bit for
bit: the same encodings.json and the same logits (``tests/quant/test_quant_onegraph.py``), at
the cost of one export, one prepare and one convert instead of three, two and two.

Export, prepare and convert run on the CPU; only the observed graph visits ``device`` for the
calibration forwards (observers included) and comes back before convert, so the programs and
encodings hold CPU tensors whatever device calibrated them.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torchao.utils
from torch.ao.quantization.fx import utils as fx_utils
from torch.fx import GraphModule
from torch.fx.experimental import proxy_tensor
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
from tqdm import tqdm

from npuq.calibrate.encodings import collect_encodings
from npuq.calibrate.engines import calibrate_onepass, calibrate_sequential
from npuq.calibrate.graphs import calibration_view, export_graph, export_model_graph
from npuq.calibrate.split import CalibrationWindows, split_windows
from npuq.device import device_of, is_cpu, move_graph
from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.quant.bias import fit_biases
from npuq.quant.observers import name_observers, pin_weight_scales
from npuq.quant.quantizer import HtpQuantizer
from npuq.quant.recipe import Recipe, RecipePlan
from npuq.quantize.passes import convert, specialize
from npuq.resources import available_memory, guard_calibration_batch
from npuq.runtime.runner import example_inputs, run_programs
from npuq.threads.scope import scope_or_keep

CALIBRATION_MODES = ("onepass", "sequential")
DEFAULT_PREFILL_LEN = 32
SCORING_BATCH = 4  # windows per call of the scoring program (npuq eval of an artifact)


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
    # The prefill program at batch SCORING_BATCH, for scoring text only (never exported): each
    # row takes the prefill chunks a device runs, and one call reads every weight once for
    # SCORING_BATCH rows instead of one (:func:`npuq.runtime.runner.run_programs`).
    scoring: GraphModule | None = None

    def graphs(self) -> dict[int, GraphModule]:
        """The device's programs by ar_len: decode (1) and prefill, at batch 1."""
        return {1: self.decode, self.prefill_len: self.prefill}

    def to(self, device: str | torch.device) -> QuantizedModel:
        """Move the programs to ``device`` in place (:func:`npuq.device.move_graph`); returns self."""
        for gm in (self.decode, self.prefill, self.scoring):
            if gm is not None:
                move_graph(gm, device)
        return self

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """LogitsFn: (B, T) → (B, T, V) from an empty cache, each row through prefill chunks and
        decode steps as a device runs the programs; rows go ``scoring``'s batch at a time where
        their calls are all prefill chunks. Runs where ``tokens`` are; the programs must be
        there too (:meth:`to`)."""
        return run_programs(self.config, self.graphs(), self.context, tokens, self.scoring)


@contextlib.contextmanager
def _observer_names_in_linear_time() -> Iterator[None]:
    """During ``prepare_pt2e``, name observers the way torch does, without its quadratic search.

    torch's ``get_new_attr_name_with_prefix`` names the n-th observer by trying
    ``activation_post_process_0``, ``_1``, ... until one is free: n ``hasattr`` calls each, about
    two million for SmolLM2's 2,000 observers, most of a prepare. Within a prepare observers are
    only ever added, so the first free index never goes down: the stand-in starts each search
    where the last one ended (and still checks each name), which gives the same names. It is
    swapped in for the block only, and only where torch has the function. (The module is looked
    up by name: ``import torch.ao.quantization.fx.prepare as m`` binds the package's function
    ``prepare``, which shadows its submodule.)"""
    fx_prepare = importlib.import_module("torch.ao.quantization.fx.prepare")
    original = getattr(fx_prepare, "get_new_attr_name_with_prefix", None)
    if original is None:
        yield
        return
    start: dict[tuple[int, str], int] = {}

    def get_new_attr_name_with_prefix(prefix: str):
        prefix = prefix.replace(".", "_")

        def get_new_attr_name(module: torch.nn.Module) -> str:
            key = (id(module), prefix)
            i = start.get(key, 0)
            while hasattr(module, prefix + str(i)):
                i += 1
            start[key] = i
            return prefix + str(i)

        return get_new_attr_name

    fx_prepare.get_new_attr_name_with_prefix = get_new_attr_name_with_prefix
    try:
        yield
    finally:
        fx_prepare.get_new_attr_name_with_prefix = original


def _prepare(graph: GraphModule, recipe: Recipe, num_layers: int,
             weight_scales: dict[str, torch.Tensor] | None) -> tuple[GraphModule, HtpQuantizer]:
    quantizer = HtpQuantizer(recipe, num_layers)
    with _observer_names_in_linear_time():
        prepared = prepare_pt2e(graph, quantizer)
    name_observers(prepared)
    if weight_scales:
        pin_weight_scales(prepared, weight_scales)
    return prepared, quantizer


def prepare_graph(
    model: torch.nn.Module, recipe: Recipe, mode: str, context: int, ar_len: int | None = None,
    weight_scales: dict[str, torch.Tensor] | None = None,
) -> tuple[GraphModule, HtpQuantizer]:
    """Export the graph of one mode by itself (:func:`npuq.calibrate.graphs.export_graph`) and
    insert observers (and record which tensors each observer watches). The quantize flow
    prepares one graph for every mode instead (:func:`prepare_model_graph`); this one is the
    per-mode reference the tests compare it with.

    ``weight_scales`` (linear module path → (O,) scales from SeqMSE/GPTQ) pin those weight
    encodings instead of observing min/max.
    """
    return _prepare(export_graph(model, mode, context, ar_len), recipe, model.config.num_layers, weight_scales)


def prepare_model_graph(
    model: torch.nn.Module, recipe: Recipe, weight_scales: dict[str, torch.Tensor] | None = None,
) -> tuple[GraphModule, HtpQuantizer]:
    """The model's one graph (:func:`npuq.calibrate.graphs.export_model_graph`), prepared:
    decode and prefill as it is, calibrate through :func:`npuq.calibrate.graphs.calibration_view`."""
    return _prepare(export_model_graph(model), recipe, model.config.num_layers, weight_scales)


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
    is exported. ``stats`` of the result holds the timings and counts the CLI reports
    (``prepare_seconds`` includes ``export_seconds``; ``convert_seconds`` the specialisation).
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
    if num_threads < 0:
        raise NpuqError(f"thread count {num_threads} is negative: give 0 for the current count or a positive number")
    windows = tokens if isinstance(tokens, CalibrationWindows) else split_windows(tokens, context)
    cfg = model.config
    start = time.perf_counter()

    graph = export_model_graph(model)
    exported_at = time.perf_counter()
    prepared, quantizer = _prepare(graph, recipe, cfg.num_layers, weight_scales)
    observed = calibration_view(prepared) if mode == "onepass" else prepared
    prepared_at = time.perf_counter()

    bar = _progress_bar(windows.tokens, f"calibrating ({mode})") if progress else None
    update = bar.update if bar is not None else None
    with scope_or_keep(num_threads) as threads:
        try:
            if not is_cpu(device):
                move_graph(observed, device)
            data = windows.to(device)  # the same tensors on the CPU
            if mode == "onepass":  # fewer windows per forward if the memory estimate says so
                batch_size = guard_calibration_batch(cfg, context, batch_size, available_memory(device)).batch
                calibrate_onepass(observed, cfg, data, batch_size, update)
            else:
                calibrate_sequential(observed, cfg, data, context, update)
        finally:
            if not is_cpu(device):
                move_graph(observed, "cpu")
            if bar is not None:
                bar.close()
    del observed
    calibrated_at = time.perf_counter()

    widened = fit_biases(prepared)  # int32 biases that would be clipped: coarser weight grid instead
    if widened and progress:
        print(f"raised the weight scales of {len(widened)} layer(s) so that their int32 biases fit: "
              + ", ".join(f"{w.layer} ({w.channels} channels, up to {w.max_ratio:.2f}x)" for w in widened[:4]),
              file=sys.stderr, flush=True)
    encodings = collect_encodings(prepared)
    converted = convert(prepared)
    decode = specialize(converted, example_inputs(cfg, "decode", context))
    prefill = specialize(converted, example_inputs(cfg, "prefill", context, prefill_len))
    scoring = specialize(converted, example_inputs(cfg, "prefill", context, prefill_len, batch=SCORING_BATCH))
    del graph, prepared, converted
    forget_graphs()
    done = time.perf_counter()
    stats = {
        "scheme": recipe.default,
        "recipe": recipe.name,
        "calibration_mode": mode,
        "calibration_tokens": windows.tokens,
        "calibration_windows": len(windows.rows()),
        "context": context,
        "prefill_len": prefill_len,
        "export_seconds": exported_at - start,
        "prepare_seconds": prepared_at - start,
        "calibration_seconds": calibrated_at - prepared_at,
        "convert_seconds": done - calibrated_at,
        "threads": threads,
        "device": str(device),
        "batch_size": batch_size if mode == "onepass" else 1,
        "bias_fit": [w.to_dict() for w in widened],
    }
    return QuantizedModel(cfg, context, prefill_len, decode, prefill, encodings, recipe, quantizer.plan, stats, scoring)


def forget_graphs() -> None:
    """Drop the references that torch and torchao keep, at module level, to the graphs of the
    last export and prepare: ``assert_and_get_unique_device`` is an unbounded lru_cache keyed by
    the module it was asked about, and torch.export keeps a map to the nodes of its last trace.
    Without this the exported and prepared graphs, and the weights they hold, outlive the
    quantize stage (found on Qwen2.5-Coder-0.5B: `npuq run` kept about one fp32 copy of the model
    after quantize; three GraphModules reachable only from these caches)."""
    for cached in (getattr(torchao.utils, "_assert_and_get_unique_device", None),
                   getattr(fx_utils, "assert_and_get_unique_device", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()


def _progress_bar(total: int, desc: str):
    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False)
