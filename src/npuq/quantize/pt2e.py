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
import gc
import importlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torchao.utils
from torch.ao.quantization.fx import utils as fx_utils
from torch.fx import GraphModule
from torch.fx.experimental import proxy_tensor
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e
from tqdm import tqdm

from npuq.calibrate.encodings import collect_encodings
from npuq.calibrate.engines import calibrate_onepass, calibrate_sequential
from npuq.calibrate.graphs import HIDDEN, calibration_view, export_graph, export_model_graph, meta_model_graph, part_graph
from npuq.calibrate.split import CalibrationWindows, split_windows
from npuq.device import device_of, is_cpu, move_graph
from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.models.stream import StreamedDecoder
from npuq.quant.bias import fit_biases
from npuq.quant.observers import name_observers, pin_weight_scales
from npuq.quant.quantizer import HtpQuantizer, model_layers
from npuq.quant.recipe import Recipe, RecipePlan
from npuq.quantize.passes import convert, specialize
from npuq.resources import available_memory, guard_calibration_batch, release_freed_memory
from npuq.runtime.runner import PartChain, example_inputs, run_programs
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
    # A model quantized in parts: each part's (first, end) layers; decode, prefill and scoring
    # are then PartChains (None where the parts went to an artifact as they were made).
    parts: tuple[tuple[int, int], ...] | None = None

    def graphs(self) -> dict[int, GraphModule]:
        """The device's programs by ar_len: decode (1) and prefill, at batch 1."""
        return {1: self.decode, self.prefill_len: self.prefill}

    def to(self, device: str | torch.device) -> QuantizedModel:
        """Move the programs to ``device`` in place (:func:`npuq.device.move_graph`); returns self."""
        for gm in (self.decode, self.prefill, self.scoring):
            for program in gm.programs if isinstance(gm, PartChain) else [gm] if gm is not None else []:
                move_graph(program, device)
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
             weight_scales: dict[str, torch.Tensor] | None, plan: RecipePlan | None = None,
             ) -> tuple[GraphModule, HtpQuantizer]:
    quantizer = HtpQuantizer(recipe, num_layers, plan)
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


@dataclass
class QuantizedPart:
    """Layers ``first`` … ``end - 1`` of a model quantized in parts (:func:`quantize_model`):
    their programs (None once handed to ``store``) and encodings."""

    layers: tuple[int, int]
    encodings: dict[str, Any]
    decode: GraphModule | None = None
    prefill: GraphModule | None = None
    scoring: GraphModule | None = None

    def programs(self) -> dict[str, GraphModule]:
        """decode, prefill and (if made) scoring, by kind."""
        made = {"decode": self.decode, "prefill": self.prefill, "scoring": self.scoring}
        return {kind: gm for kind, gm in made.items() if gm is not None}


def even_parts(num_layers: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``parts`` runs of consecutive layers, their sizes differing by at most one (the first
    ones one layer shorter: the first part also holds the embedding, the last the head)."""
    if not 1 <= parts <= num_layers:
        raise NpuqError(f"--parts {parts}: a model of {num_layers} layers splits into 1 to {num_layers} parts")
    small, extra = divmod(num_layers, parts)
    sizes = [small] * (parts - extra) + [small + 1] * extra
    bounds = [sum(sizes[:k]) for k in range(parts + 1)]
    return tuple((bounds[k], bounds[k + 1]) for k in range(parts))


def part_inputs(cfg: ModelConfig, layers: tuple[int, int], mode: str, context: int, ar_len: int | None = None,
                batch: int = 1) -> tuple[torch.Tensor, ...]:
    """:func:`npuq.runtime.runner.example_inputs` for the part of ``layers`` (first, end): hidden
    states instead of token ids after layer 0, and the part's caches only."""
    first, end = layers
    L = cfg.num_layers
    tokens, mask, positions, *caches = example_inputs(cfg, mode, context, ar_len, batch)
    x = tokens if first == 0 else torch.zeros(*tokens.shape, cfg.hidden_size)
    return (x, mask, positions, *caches[first:end], *caches[L + first : L + end])


def merge_encodings(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The encodings of the whole model from its parts': each tensor once, in order. The hidden
    states a part takes in are the ones the part before it gave out, whose encoding that part
    holds under the producing node's name; the part's own observation of its input is left out."""
    merged: dict[str, Any] = {"version": parts[0]["version"], "activation_encodings": [], "param_encodings": []}
    for key in ("activation_encodings", "param_encodings"):
        seen: set[str] = set()
        for enc in parts:
            for e in enc[key]:
                if e["name"] == HIDDEN or e["name"].startswith(HIDDEN + "->") or e["name"] in seen:
                    continue
                seen.add(e["name"])
                merged[key].append(e)
    return merged


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
    parts: Sequence[tuple[int, int]] | None = None,
    store: Callable[[int, QuantizedPart], None] | None = None,
    recover: Callable[[torch.nn.Module, int, int], dict[str, torch.Tensor]] | None = None,
) -> QuantizedModel:
    """Quantize a StaticDecoder with ``recipe``, calibrated on ``tokens`` (see module docstring).

    ``num_threads`` > 0 runs calibration at that many torch threads (restored afterwards);
    0 keeps the current count. ``weight_scales``: see :func:`prepare_graph`. ``device``: where
    the calibration forwards run (None: the CPU); the model itself must be on the CPU, where it
    is exported. ``stats`` of the result holds the timings and counts the CLI reports
    (``prepare_seconds`` includes ``export_seconds``; ``convert_seconds`` the specialisation).

    ``parts`` (first, end) runs of layers (:func:`even_parts`; None: one, the whole model):
    the model graph is cut into one graph per run (:func:`npuq.calibrate.graphs.part_graph`),
    and each is prepared, calibrated on the hidden states the part before it returned, and
    converted on its own, in order (one-pass calibration only). Observers only watch, so each
    part sees the float model's activations, as the whole graph's observers do: the encodings
    and programs are the whole graph's, cut (``tests/quant/test_quant_parts.py``). ``model`` may
    be a :class:`npuq.models.stream.StreamedDecoder`, whose weights are read one part at a time.
    ``store(k, part)``: called with each part once converted, after which the result keeps only
    its encodings (so only one part's programs are ever in memory; the result then has no
    programs to run). Without ``store`` a model of several parts runs as a
    :class:`npuq.runtime.runner.PartChain` of them.

    ``recover(module, first, end)`` (npuq.optimize.recovery.PartRecovery: SeqMSE/GPTQ): called
    on each part's float module, weights in memory, before the part is prepared; it rounds those
    weights in place and returns the scales to pin (``weight_scales`` of that part). A model of
    one part, not streamed, is recovered whole before its graph is exported.
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
    layers = check_parts(parts, cfg.num_layers)
    streamed = isinstance(model, StreamedDecoder)
    if mode != "onepass" and (len(layers) > 1 or streamed):
        raise NpuqError("sequential calibration runs the whole model token by token: use --calibration-mode onepass "
                        "to quantize in parts or streamed")
    if weight_scales and (recover is not None or len(layers) > 1 or streamed):
        raise ValueError("weight_scales are the whole model's: quantizing in parts or streamed, pass recover")
    parted = len(layers) > 1 or streamed
    if recover is not None and not parted:  # before the export: the graph binds the rounded weights
        with scope_or_keep(num_threads):
            weight_scales = recover(model, 0, cfg.num_layers)
    timings = dict.fromkeys(("export", "prepare", "calibration", "convert", "read"), 0.0)
    start = time.perf_counter()

    whole = meta_model_graph(cfg, model.max_context) if streamed else export_model_graph(model)
    plan = recipe.plan(model_layers(whole)) if len(layers) > 1 or streamed else None  # every rule must match somewhere
    timings["export"] = timings["prepare"] = time.perf_counter() - start

    total = windows.tokens * len(layers)
    bar = _progress_bar(total, f"calibrating ({mode})" if len(layers) == 1 else f"calibrating ({mode}, {len(layers)} parts)") if progress else None
    update = bar.update if bar is not None else None
    done_parts: list[QuantizedPart] = []
    widened_all: list[Any] = []
    hidden: list[torch.Tensor] | None = None
    quantizer = None
    with scope_or_keep(num_threads) as threads:
        try:
            for k, (first, end) in enumerate(layers):
                reading = time.perf_counter()
                with _weights(model, first, end) as weights:
                    t0 = time.perf_counter()
                    timings["read"] += t0 - reading
                    scales = weight_scales
                    if recover is not None and parted:  # timed by its own summary
                        scales = recover(weights, first, end)
                        t0 = time.perf_counter()
                    graph = whole if weights is None else part_graph(whole, first, end, weights)
                    prepared, quantizer = _prepare(graph, recipe, end - first, scales, plan)
                    del graph
                    observed = calibration_view(prepared) if mode == "onepass" else prepared
                    t1 = time.perf_counter()
                    timings["prepare"] += t1 - t0
                    try:
                        if not is_cpu(device):
                            move_graph(observed, device)
                        data = windows.to(device)  # the same tensors on the CPU
                        if mode == "onepass":  # fewer windows per forward if the memory estimate says so
                            if k == 0:
                                batch_size = guard_calibration_batch(cfg, context, batch_size,
                                                                     available_memory(device)).batch
                            rows = head_rows(cfg, context) if end == cfg.num_layers and parted else None
                            hidden = calibrate_onepass(observed, cfg, data, batch_size, update, hidden=hidden,
                                                       keep=end < cfg.num_layers, rows=rows)
                        else:
                            calibrate_sequential(observed, cfg, data, context, update)
                    finally:
                        if not is_cpu(device):
                            move_graph(observed, "cpu")
                    del observed
                    t2 = time.perf_counter()
                    timings["calibration"] += t2 - t1
                    part = _convert_part(prepared, cfg, (first, end), context, prefill_len, widened_all)
                    del prepared
                if store is not None:
                    if len(layers) > 1:  # the float weights, held by torch's caches and the prepared graph's
                        forget_graphs()  # cycles, go before the programs are written (0.47 GB of uint16
                        gc.collect()  # copies of Qwen2.5-1.5B's 16-bit table): the part's peak is its convert
                    store(k, part)
                    part = QuantizedPart(part.layers, part.encodings)  # its programs are written: let them go
                done_parts.append(part)
                forget_graphs()
                if len(layers) > 1:  # graphs hold cycles: without a collection their weights outlive the part
                    release_freed_memory()
                timings["convert"] += time.perf_counter() - t2
        finally:
            if bar is not None:
                bar.close()
    del whole, hidden
    if widened_all and progress:
        print(f"raised the weight scales of {len(widened_all)} layer(s) so that their int32 biases fit: "
              + ", ".join(f"{w.layer} ({w.channels} channels, up to {w.max_ratio:.2f}x)" for w in widened_all[:4]),
              file=sys.stderr, flush=True)
    stats = {
        "scheme": recipe.default,
        "recipe": recipe.name,
        "calibration_mode": mode,
        "calibration_tokens": windows.tokens,
        "calibration_windows": len(windows.rows()),
        "context": context,
        "prefill_len": prefill_len,
        "export_seconds": timings["export"],
        "prepare_seconds": timings["prepare"],
        "calibration_seconds": timings["calibration"],
        "convert_seconds": timings["convert"],
        "threads": threads,
        "device": str(device),
        "batch_size": batch_size if mode == "onepass" else 1,
        "bias_fit": [w.to_dict() for w in widened_all],
    }
    if len(layers) > 1 or streamed:
        stats["parts"] = [list(p.layers) for p in done_parts]
        stats["read_seconds"] = timings["read"]  # reading (and rotating) each part's weights
    plan = plan if plan is not None else quantizer.plan
    if len(done_parts) == 1 and not streamed:
        (p,) = done_parts
        return QuantizedModel(cfg, context, prefill_len, p.decode, p.prefill, p.encodings, recipe, plan, stats,
                              p.scoring)
    encodings = merge_encodings([p.encodings for p in done_parts])
    programs = {kind: None if store is not None else PartChain([p.layers for p in done_parts],
                                                                [getattr(p, kind) for p in done_parts])
                for kind in ("decode", "prefill", "scoring")}
    return QuantizedModel(cfg, context, prefill_len, programs["decode"], programs["prefill"], encodings, recipe, plan,
                          stats, programs["scoring"], parts=tuple(p.layers for p in done_parts))


HEAD_CALL_BYTES = 1 << 29  # the most the logits of one calibration call take, quantizing in parts


def head_rows(cfg: ModelConfig, context: int) -> int:
    """Windows per calibration call of the part that holds the head, when quantizing in parts:
    as many as keep their float32 logits (context × vocabulary × 4 bytes a window) within
    HEAD_CALL_BYTES, one at least. A batch of 8 windows of Qwen2.5's 152k vocabulary is 2.5 GB
    of logits, which set the peak of a 1.5B model quantized in parts (docs/design.md §13)."""
    return max(1, HEAD_CALL_BYTES // (4 * context * cfg.vocab_size))


def check_parts(parts: Sequence[tuple[int, int]] | None, num_layers: int) -> tuple[tuple[int, int], ...]:
    """``parts`` as (first, end) tuples after checking that they cover layers 0 … num_layers - 1
    in order, each at least one layer; None: one part, the whole model."""
    if parts is None:
        return ((0, num_layers),)
    layers = tuple((int(a), int(b)) for a, b in parts)
    expected = 0
    for first, end in layers:
        if first != expected or end <= first:
            raise NpuqError(f"parts {list(layers)} do not cover layers 0..{num_layers - 1} in order, "
                            "each part at least one layer")
        expected = end
    if expected != num_layers:
        raise NpuqError(f"parts {list(layers)} end at layer {expected - 1}, not at the model's last, {num_layers - 1}")
    return layers


@contextlib.contextmanager
def _weights(model: torch.nn.Module, first: int, end: int) -> Iterator[torch.nn.Module | None]:
    """The module whose tensors the part of layers first … end - 1 binds: the model itself, or
    for a streamed model its skeleton with just that part's weights read in (freed on leaving).
    None: the model is one part and not streamed, so its own graph serves as it is."""
    L = model.config.num_layers
    if not isinstance(model, StreamedDecoder):
        yield None if (first, end) == (0, L) else model
        return
    with model.resident_part(first, end):
        yield model.skeleton


def _convert_part(prepared: GraphModule, cfg: ModelConfig, layers: tuple[int, int], context: int,
                  prefill_len: int, widened_all: list[Any]) -> QuantizedPart:
    """Fit the int32 biases, collect the encodings, convert and specialise a calibrated part."""
    widened_all += fit_biases(prepared)  # int32 biases that would be clipped: coarser weight grid instead
    encodings = collect_encodings(prepared)
    converted = convert(prepared)
    decode = specialize(converted, part_inputs(cfg, layers, "decode", context))
    prefill = specialize(converted, part_inputs(cfg, layers, "prefill", context, prefill_len))
    scoring = specialize(converted, part_inputs(cfg, layers, "prefill", context, prefill_len, batch=SCORING_BATCH))
    return QuantizedPart(layers, encodings, decode, prefill, scoring)


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
