"""An onnxruntime-genai model folder around an export's graphs (``npuq export --genai windowed|shared``,
docs/design.md §10, §11).

onnxruntime-genai's ``decoder-pipeline`` model type runs a list of ONNX graphs ("stages") in
order, passing each stage's outputs to the later stages by name; the tokens, positions,
attention mask, KV cache and logits are the runtime's own ("managed") tensors. npuq's prefill
and decode graphs become two stages (prompt and token generation) as they are written, and
small graphs of a few ops, on the CPU, turn the runtime's tensors into npuq's (windowed:
attention_mask [1, ctx] int64, 1 for a real token with the current window in the last T
columns, and positions [1, T] → mask [1, M, T, ctx], npuq's additive mask of 0 / MASK_VALUE).

Two cache contracts (the value of ``--genai``):

- ``windowed``: the runtime keeps the cache itself, right-aligned, one input [KV, 1, D, ctx-T]
  and one output [KV, 1, D, T] per layer for K (V: [KV, 1, ctx-T, D] / [KV, 1, T, D]), uint8
  only, padded with ``pad_value``, and copies each window's outputs in; this is the path it
  takes on a Qualcomm NPU (QNN HTP device). npuq's graphs take that layout directly: with
  batch 1, [KV, 1, ...] and npuq's [1, KV, ...] are the same bytes, so the export declares the
  cache I/O as [KV, 1, ...] and reshapes at the graph's edge (free). genai_config.json puts
  the graphs on the QNN HTP provider (their compiled contexts when exported with --compile);
  only the mask stages run beside them, on the CPU.
- ``shared``: what the runtime does with the same model type on the CPU provider: one buffer
  [1, KV, ctx, D] per layer for K and for V, passed as input and written back as output, which
  the graphs must shift themselves. The runtime hands every prompt call the whole append,
  unpadded, with its positions (``slide_inputs`` false; ceil(n / window) calls), and stages
  ``genai_in_<graph>`` / ``genai_out_<graph>`` around npuq's unchanged graphs make each call the
  one npuq's runner makes (runtime.runner.feed_schedule): the next chunk, right-padded, npuq's
  mask and positions, the cache in npuq's slots; then the buffers shift by the real tokens only.
  One more cache "layer" holds the stages' bookkeeping (which slots are real, their positions),
  so turn after turn (continuous decoding) the runtime computes npuq's runner's logits bit for
  bit. This contract runs on any ONNX Runtime, which is how npuq's tests prove the folder with
  onnxruntime-genai itself (docs/design.md §11).

A sharded export (``--shards``, docs/design.md §13) is one pipeline too: each kind's shard graphs
run in order between the same stages, each taking the ``hidden_<L>`` codes the one before it
returned (the pipeline passes them by name like every other output) and its own layers' caches;
the stages see the chain as one graph (:func:`chain_entry`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuq.errors import NpuqError
from npuq.lower.manifest import KV_PREFIXES, GenaiFolder, GraphEntry, IOEntry, shard_tag
from npuq.models.config import ModelConfig
from npuq.models.decoder import MASK_VALUE
from npuq.quant.recipe import kv_cache_advice

RUNTIME = "onnxruntime-genai 0.18"
VERIFIED = {"shared": "onnxruntime-genai 0.18 on the CPU provider (npuq's tests)",
            "windowed": "reference driver of the windowed cache on ONNX Runtime (CPU, and the QNN HTP emulator for "
                        "compiled contexts); onnxruntime-genai selects this cache on a QNN HTP device only"}
CONFIG_FILE = "genai_config.json"
OPSET = 21
ATTENTION_MASK = "attention_mask"
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"  # shared contract: the runtime's buffers
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
# shared contract: the runtime's names for the tokens, their positions and the logits it samples from
# (not npuq's ``tokens`` / ``positions`` / ``logits``, which the stages make and read)
INPUT_IDS, POSITION_IDS, LOGITS = "input_ids", "position_ids", "genai_logits"
NO_TOKEN = -1  # shared contract's pad_token_id: no token has it (pipeline_config)
# The QDQ graphs computed exactly, as npuq's own CPU sessions run them (docs/design.md §9).
EXACT = {"graph_optimization_level": "ORT_DISABLE_ALL"}
_ONNX_TYPE = {"uint8": TensorProto.UINT8, "uint16": TensorProto.UINT16, "int8": TensorProto.INT8,
              "int16": TensorProto.INT16, "float32": TensorProto.FLOAT, "int32": TensorProto.INT32,
              "int64": TensorProto.INT64}


def _io(entry: GraphEntry) -> tuple[dict[str, IOEntry], dict[str, IOEntry]]:
    return {s.name: s for s in entry.inputs}, {s.name: s for s in entry.outputs}


def chain_entry(entries: Sequence[GraphEntry]) -> GraphEntry:
    """A kind's shard graphs, in order, as one graph: the first one's tokens, the mask and
    positions, every shard's caches in and news out, the last one's logits (the ``hidden_<L>``
    codes between them stay inside the chain). One graph is itself."""
    if len(entries) == 1:
        return entries[0]

    def outer(specs: Any) -> tuple[IOEntry, ...]:
        return tuple({s.name: s for s in specs if not s.name.startswith("hidden_")}.values())

    return dataclasses.replace(entries[0], file="", external_data=None, sha256="", parts=None,
                               inputs=outer(s for e in entries for s in e.inputs),
                               outputs=outer(s for e in entries for s in e.outputs))


def check_window(context: int, window: int) -> None:
    """Refuse a context and prompt window the runtime cannot run, before any lowering."""
    if window < 2:
        raise NpuqError(f"--genai: the prefill graph takes {window} token; onnxruntime-genai's prompt window must "
                        "be at least 2 tokens: quantize again with --prefill-len 2 or more")
    if context < 2 * window:
        raise NpuqError(f"--genai: the context {context} is less than twice the prompt window {window} "
                        "(onnxruntime-genai requires context_length >= 2 x window_size): quantize again with "
                        f"--prefill-len {context // 2} or less")


def check_io(cfg: ModelConfig, kind: str, specs: Sequence[IOEntry], cache: str) -> None:
    """Refuse a graph whose inputs and outputs the cache contract (one of
    manifest.GENAI_CACHES, checked by ExportOptions) cannot feed (names the fix)."""
    names = {s.name: s for s in specs}
    shard = any(name.startswith("hidden_") for name in names)  # takes or returns hidden states instead
    missing = [n for n in ("tokens", "logits") if n not in names and not shard] + \
              [n for n in ("mask", "positions") if n not in names] + \
              [p for p in KV_PREFIXES if not any(n.startswith(p) for n in names)]
    if missing:
        raise NpuqError(f"--genai: the {kind} graph has no tensor {missing[0]!r}; export again with this npuq")
    if names["mask"].shape[1] != (2 if cfg.has_sliding_layers else 1) or \
            ("logits" in names and names["logits"].dtype != "float32"):
        raise NpuqError(f"--genai: the {kind} graph's mask or logits are not npuq's; export again with this npuq")
    kv = [s for s in specs if s.name.startswith(KV_PREFIXES)]
    if cache == "windowed":
        wrong = sorted({s.dtype for s in kv if s.dtype != "uint8"})
        if wrong:
            raise NpuqError(
                f"--genai windowed: onnxruntime-genai's NPU cache holds uint8 KV codes, but this artifact's KV cache "
                f"is {', '.join(wrong)}: quantize again with {kv_cache_advice(8)}, or use --genai shared (the CPU "
                "provider's contract, any KV type)")
        if any(s.encoding is None or isinstance(s.encoding.scale, tuple) or isinstance(s.encoding.zero_point, tuple)
               for s in kv):
            raise NpuqError("--genai windowed: the KV cache must be quantized per tensor; quantize again")
    elif any(s.dtype not in _ONNX_TYPE for s in kv):
        raise NpuqError("--genai shared: a KV cache type this npuq cannot wrap; export again with this npuq")


def pad_value(graphs: Iterable[GraphEntry]) -> int:
    """The one value the windowed runtime fills empty slots with: the caches' common zero point
    (uint8 symmetric KV: 128); when the caches' zero points differ, the most common one."""
    points = [int(s.encoding.zero_point) for g in graphs for s in g.inputs
              if s.name.startswith(("k_cache_", "v_cache_")) and s.encoding is not None]
    if not points:
        raise NpuqError("--genai windowed: the KV cache inputs carry no encoding; quantize again")
    values, counts = np.unique(points, return_counts=True)
    return int(values[np.argmax(counts)])


# --------------------------------------------------------------------------- graph edits
def heads_first(model: onnx.ModelProto, specs: Sequence[IOEntry]) -> None:
    """Declare the KV-cache inputs and outputs [KV, 1, ...] (the windowed runtime's layout), in
    place. With batch 1 that is the same bytes as npuq's [1, KV, ...]: the graph reshapes at its
    edge, in the QDQ form the QNN HTP backend takes as one quantized op (DequantizeLinear →
    Reshape → QuantizeLinear, with the cache's own encoding). ``specs`` passed :func:`check_io`
    for the windowed contract: every KV tensor is quantized per tensor."""
    g = model.graph
    specs = {s.name: s for s in specs if s.name.startswith(KV_PREFIXES)}
    graph_inputs = {v.name for v in g.input}
    head, tail = [], []
    for value in list(g.input) + list(g.output):
        spec = specs.get(value.name)
        if spec is None:
            continue
        enc = spec.encoding
        dims = value.type.tensor_type.shape.dim
        shape = [d.dim_value for d in dims]
        if shape[0] != 1:
            raise NpuqError(f"{value.name}: batch {shape[0]}; --genai windowed needs batch 1")
        flipped = [shape[1], 1, *shape[2:]]
        inner = f"{value.name}/npuq_layout"
        for n in g.node:  # every reader (and the writer) of the tensor inside the graph keeps npuq's layout
            for names in (n.input, n.output):
                for j, x in enumerate(names):
                    if x == value.name:
                        names[j] = inner
        p = value.name
        np_type = helper.tensor_dtype_to_np_dtype(_ONNX_TYPE[spec.dtype])
        g.initializer.extend([_const(f"{p}/scale", enc.scale, np.float32), _const(f"{p}/zero_point", enc.zero_point, np_type),
                              _const(f"{p}/shape", shape if value.name in graph_inputs else flipped, np.int64)])
        src, dst = (value.name, inner) if value.name in graph_inputs else (inner, value.name)
        nodes = [helper.make_node("DequantizeLinear", [src, f"{p}/scale", f"{p}/zero_point"], [f"{p}/dq"], name=f"{p}/dq"),
                 helper.make_node("Reshape", [f"{p}/dq", f"{p}/shape"], [f"{p}/reshaped"], name=f"{p}/reshape"),
                 helper.make_node("QuantizeLinear", [f"{p}/reshaped", f"{p}/scale", f"{p}/zero_point"], [dst],
                                  name=f"{p}/q")]
        (head if value.name in graph_inputs else tail).extend(nodes)
        dims[0].dim_value, dims[1].dim_value = shape[1], 1
    body = list(g.node)
    del g.node[:]
    g.node.extend(head + body + tail)  # still in topological order


def heads_first_specs(specs: list) -> list:
    """The writer's I/O specs as :func:`heads_first` declares them: KV caches [KV, 1, ...]."""
    return [dataclasses.replace(s, shape=(s.shape[1], s.shape[0], *s.shape[2:])) if s.name.startswith(KV_PREFIXES)
            else s for s in specs]


# --------------------------------------------------------------------------- stage graphs
def _const(name: str, value: Any, dtype: Any) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _mask_nodes(cfg: ModelConfig, context: int, T: int) -> tuple[list, list]:
    """Nodes (and initializers) computing npuq's ``mask`` [1, M, T, ctx] from ``attention_mask``
    [1, ctx] (1 real, 0 not; the current T tokens last) and ``positions`` [1, T]: query t sees key
    s when s holds a real token and lies before the current tokens or at most t among them; the
    sliding-window channel also needs q - k < window, with key positions counted back from the
    first query (the runtime's cache is contiguous and right-aligned)."""
    C = context - T
    s = np.arange(context)[None, :]
    t = np.arange(T)[:, None]
    causal = (s < C) | (s - C <= t)  # (T, ctx)
    inits = [_const("genai/causal", causal[None, None], np.bool_), _const("genai/zero", 0.0, np.float32),
             _const("genai/masked", MASK_VALUE, np.float32), _const("genai/key_shape", [1, 1, 1, context], np.int64)]
    nodes = [
        helper.make_node("Cast", [ATTENTION_MASK], ["genai/valid"], to=TensorProto.BOOL),
        helper.make_node("Reshape", ["genai/valid", "genai/key_shape"], ["genai/valid4"]),
        helper.make_node("And", ["genai/valid4", "genai/causal"], ["genai/allowed"]),  # (1, 1, T, ctx)
    ]
    if not cfg.has_sliding_layers:
        nodes.append(helper.make_node("Where", ["genai/allowed", "genai/zero", "genai/masked"], ["mask"]))
        return nodes, inits
    inits += [_const("genai/back", np.arange(C, 0, -1)[None, :], np.int64), _const("genai/first", [0], np.int64),
              _const("genai/one", [1], np.int64), _const("genai/axis1", [1], np.int64),
              _const("genai/window", cfg.sliding_window, np.int64), _const("genai/q_axes", [0, 3], np.int64),
              _const("genai/k_axes", [0, 1], np.int64)]
    nodes += [
        helper.make_node("Cast", ["positions"], ["genai/pos"], to=TensorProto.INT64),  # (1, T)
        helper.make_node("Slice", ["genai/pos", "genai/first", "genai/one", "genai/axis1"], ["genai/p0"]),
        helper.make_node("Sub", ["genai/p0", "genai/back"], ["genai/past_pos"]),  # (1, C)
        helper.make_node("Concat", ["genai/past_pos", "genai/pos"], ["genai/key_pos"], axis=1),  # (1, ctx)
        helper.make_node("Unsqueeze", ["genai/pos", "genai/q_axes"], ["genai/q4"]),  # (1, 1, T, 1)
        helper.make_node("Unsqueeze", ["genai/key_pos", "genai/k_axes"], ["genai/k4"]),  # (1, 1, 1, ctx)
        helper.make_node("Sub", ["genai/q4", "genai/k4"], ["genai/dist"]),
        helper.make_node("Less", ["genai/dist", "genai/window"], ["genai/near"]),
        helper.make_node("And", ["genai/allowed", "genai/near"], ["genai/allowed_local"]),
        helper.make_node("Where", ["genai/allowed", "genai/zero", "genai/masked"], ["genai/mask_full"]),
        helper.make_node("Where", ["genai/allowed_local", "genai/zero", "genai/masked"], ["genai/mask_local"]),
        helper.make_node("Concat", ["genai/mask_full", "genai/mask_local"], ["mask"], axis=1),
    ]
    return nodes, inits


def _tensor(name: str, dtype: str, shape: tuple[int, ...]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, _ONNX_TYPE[dtype], list(shape))


def _model(nodes: list, inits: list, inputs: list, outputs: list, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="npuq")
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def mask_stage(cfg: ModelConfig, context: int, entry: GraphEntry, kind: str) -> onnx.ModelProto:
    """windowed: attention_mask + positions → npuq's mask, for the graph of ar_len T."""
    ins, _ = _io(entry)
    T = entry.ar_len
    nodes, inits = _mask_nodes(cfg, context, T)
    return _model(nodes, inits, [_tensor(ATTENTION_MASK, "int64", (1, context)), _tensor("positions", "int32", (1, T))],
                  [_tensor("mask", "float32", tuple(ins["mask"].shape))], f"genai_mask_{kind}")


def _i64(name: str, value: Any) -> onnx.TensorProto:
    return _const(name, value, np.int64)


def _check(nodes: list, inits: list, name: str, ok: str, value: str, out: str, message: str) -> None:
    """``out`` = ``value`` (shape [1]) when the bool ``ok`` [1] holds; otherwise the stage fails
    with ``message`` as the failing node's name, which ONNX Runtime (and onnxruntime-genai's
    exception) prints: a Reshape of one element to shape [0] (allowzero: 0 is a size, not "copy").
    ONNX has no assert op."""
    inits += [_i64(f"genai/{name}_pass", [1]), _i64(f"genai/{name}_fail", [0])]
    nodes += [helper.make_node("Where", [ok, f"genai/{name}_pass", f"genai/{name}_fail"], [f"genai/{name}_shape"]),
              helper.make_node("Reshape", [value, f"genai/{name}_shape"], [out], name=message, allowzero=1)]


# The bookkeeping cache (shared contract): one more cache "layer" of the KV type, shifted with the
# real caches, whose slot s records in head 0, elements 0..3: 1 when the slot holds a real token,
# then that token's runtime position + 1 in base-128 digits (exact in every KV type npuq writes,
# int8 included; positions below 2^21). The runtime zero-fills it: no slot real.
BOOK_DIGITS = (1, 128, 128 * 128)


def _count_nodes(context: int, T: int, layers: int) -> tuple[list, list]:
    """Nodes computing, from the runtime's ``input_ids`` [1, n] (this append's tokens, or the one
    generated token), ``position_ids`` [1, n] (their runtime positions) and the bookkeeping cache
    (the extra layer ``layers``), the int64 [1] tensors

        genai/n_past   real tokens in the cache (checked: n_past + T <= ctx)
        genai_offset   tokens of this append already in the cache: the runtime calls the prompt
                       stages ceil(n / T) times with the same inputs, one per chunk, so the chunk
                       is found from the position of the last cached token
        genai_n_real   tokens of this chunk: min(T, n - offset)

    and npuq's ``tokens`` [1, T] (the chunk, padded on the right with token 0, as npuq's runner pads).
    onnxruntime-genai 0.18 never feeds the last token it sampled before an append, yet counts its
    position (probed); the cache holds only what was fed, at consecutive slots."""
    book = PAST_KEY % layers
    inits = [_i64("genai/book_start", [0, 0, 0, 0]), _i64("genai/book_end", [1, 1, context, 1 + len(BOOK_DIGITS)]),
             _i64("genai/book_rows", [context, 1 + len(BOOK_DIGITS)]), _i64("genai/last_row", [context - 1]),
             _i64("genai/row_end", [context]), _i64("genai/axis0", [0]), _i64("genai/col0", [0]),
             _i64("genai/col1", [1]), _i64("genai/cols_end", [1 + len(BOOK_DIGITS)]),
             _const("genai/digits", BOOK_DIGITS, np.float32), _i64("genai/p_start", [0, 0]), _i64("genai/p_end", [1, 1]),
             _i64("genai/T", [T]), _i64("genai/room", [context - T]), _i64("genai/zero1", [0]),
             _i64("genai/one1", [1]), _i64("genai/pad_head", [0, 0, 0]), _const("genai/real_code", 1.0, np.float32),
             _const("genai/token_pad", 0, np.int32)]
    nodes = [
        helper.make_node("Slice", [book, "genai/book_start", "genai/book_end"], ["genai/book_4d"]),  # (1, 1, ctx, 4)
        helper.make_node("Cast", ["genai/book_4d"], ["genai/book_f4"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["genai/book_f4", "genai/book_rows"], ["genai/book"]),  # (ctx, 4)
        helper.make_node("Slice", ["genai/book", "genai/col0", "genai/col1", "genai/col1"], ["genai/book_real_f"]),
        helper.make_node("Equal", ["genai/book_real_f", "genai/real_code"], ["genai/book_real"]),  # (ctx, 1)
        helper.make_node("Cast", ["genai/book_real"], ["genai/book_i"], to=TensorProto.INT64),
        helper.make_node("ReduceSum", ["genai/book_i"], ["genai/n_held_0d"], keepdims=0),
        helper.make_node("Reshape", ["genai/n_held_0d", "genai/one1"], ["genai/n_held"]),  # (1,)
        # runtime position + 1 of the newest cached token (slot ctx - 1; 0 when the cache is empty)
        helper.make_node("Slice", ["genai/book", "genai/last_row", "genai/row_end", "genai/axis0"], ["genai/last"]),
        helper.make_node("Slice", ["genai/last", "genai/col1", "genai/cols_end", "genai/col1"], ["genai/last_digits"]),
        helper.make_node("Mul", ["genai/last_digits", "genai/digits"], ["genai/last_parts"]),
        helper.make_node("ReduceSum", ["genai/last_parts", "genai/col1"], ["genai/last_f"], keepdims=0),  # (1,)
        helper.make_node("Cast", ["genai/last_f"], ["genai/last_pos1"], to=TensorProto.INT64),
        helper.make_node("Slice", [POSITION_IDS, "genai/p_start", "genai/p_end"], ["genai/p0_2d"]),
        helper.make_node("Cast", ["genai/p0_2d"], ["genai/p0_i"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["genai/p0_i", "genai/one1"], ["genai/p0"]),  # (1,)
        helper.make_node("Shape", [INPUT_IDS], ["genai/n"], start=1, end=2),  # (1,)
        helper.make_node("Sub", ["genai/last_pos1", "genai/p0"], ["genai/done"]),
        helper.make_node("Max", ["genai/done", "genai/zero1"], ["genai/offset_raw"]),
        helper.make_node("Less", ["genai/offset_raw", "genai/n"], ["genai/in_step"]),
        helper.make_node("LessOrEqual", ["genai/n_held", "genai/room"], ["genai/fits"]),
    ]
    _check(nodes, inits, "in_step", "genai/in_step", "genai/offset_raw", "genai_offset",
           "npuq: position_ids lie behind the cache (a generator rewound?): create a new og.Generator")
    _check(nodes, inits, "fits", "genai/fits", "genai/n_held", "genai/n_past",
           f"npuq: the conversation no longer fits the context of {context} tokens (this call needs {T} free "
           "cache slots): start a new og.Generator, or export with a larger --context")
    nodes += [
        helper.make_node("Sub", ["genai/n", "genai_offset"], ["genai/left"]),
        helper.make_node("Min", ["genai/left", "genai/T"], ["genai_n_real"]),
        helper.make_node("Add", ["genai_offset", "genai_n_real"], ["genai/chunk_end"]),
        helper.make_node("Slice", [INPUT_IDS, "genai_offset", "genai/chunk_end", "genai/one1"], ["genai/chunk"]),
        helper.make_node("Sub", ["genai/T", "genai_n_real"], ["genai/n_pad"]),
        helper.make_node("Concat", ["genai/pad_head", "genai/n_pad"], ["genai/token_pads"], axis=0),  # (4,)
        helper.make_node("Pad", ["genai/chunk", "genai/token_pads", "genai/token_pad"], ["genai/tokens_any"]),
        helper.make_node("Cast", ["genai/tokens_any"], ["tokens"], to=TensorProto.INT32),
    ]
    return nodes, inits


def _runner_mask_nodes(cfg: ModelConfig, context: int, T: int) -> tuple[list, list]:
    """npuq's ``mask`` [1, M, T, ctx] and ``positions`` [1, T] as npuq's runner builds them
    (runtime.runner.step_inputs): cache slot s holds position s and is real when s < n_past; the
    call's tokens take positions n_past .. n_past + T - 1, the first n_real real; query t sees a
    real key at a position <= its own (sliding-window channel: also less than the window back)."""
    C = context - T
    inits = [_i64("genai/slots", np.arange(C)), _i64("genai/cols", np.arange(T)), _i64("genai/mask_rows", [T, 1]),
             _i64("genai/mask_shape", [1, 1, T, context]), _const("genai/zero", 0.0, np.float32),
             _const("genai/masked", MASK_VALUE, np.float32)]
    nodes = [
        helper.make_node("Add", ["genai/n_past", "genai/cols"], ["genai/q_pos"]),  # (T,)
        helper.make_node("Cast", ["genai/q_pos"], ["genai/q_pos32"], to=TensorProto.INT32),
        helper.make_node("Unsqueeze", ["genai/q_pos32", "genai/zero1"], ["positions"]),  # (1, T)
        helper.make_node("Concat", ["genai/slots", "genai/q_pos"], ["genai/k_pos"], axis=0),  # (ctx,)
        helper.make_node("Less", ["genai/slots", "genai/n_past"], ["genai/slot_real"]),
        helper.make_node("Less", ["genai/cols", "genai_n_real"], ["genai/col_real"]),
        helper.make_node("Concat", ["genai/slot_real", "genai/col_real"], ["genai/k_real"], axis=0),  # (ctx,)
        helper.make_node("Reshape", ["genai/q_pos", "genai/mask_rows"], ["genai/q_col"]),  # (T, 1)
        helper.make_node("LessOrEqual", ["genai/k_pos", "genai/q_col"], ["genai/not_future"]),  # (T, ctx)
        helper.make_node("And", ["genai/k_real", "genai/not_future"], ["genai/allowed"]),
        helper.make_node("Where", ["genai/allowed", "genai/zero", "genai/masked"], ["genai/mask_tc"]),
        helper.make_node("Reshape", ["genai/mask_tc", "genai/mask_shape"], ["genai/mask_full" if cfg.has_sliding_layers
                                                                             else "mask"]),
    ]
    if cfg.has_sliding_layers:
        inits.append(_i64("genai/window", [cfg.sliding_window]))
        nodes += [
            helper.make_node("Sub", ["genai/q_col", "genai/k_pos"], ["genai/back"]),
            helper.make_node("Less", ["genai/back", "genai/window"], ["genai/near"]),
            helper.make_node("And", ["genai/allowed", "genai/near"], ["genai/allowed_local"]),
            helper.make_node("Where", ["genai/allowed_local", "genai/zero", "genai/masked"], ["genai/local_tc"]),
            helper.make_node("Reshape", ["genai/local_tc", "genai/mask_shape"], ["genai/mask_local"]),
            helper.make_node("Concat", ["genai/mask_full", "genai/mask_local"], ["mask"], axis=1),
        ]
    return nodes, inits


def shared_in_stage(cfg: ModelConfig, context: int, entry: GraphEntry, kind: str) -> onnx.ModelProto:
    """shared: npuq's inputs for the next chunk of this append (or the generated token), as npuq's
    runner makes them: tokens, mask, positions, and each cache in npuq's layout (slot j holds
    position j: the runtime buffer's last n_past slots, then the zero point in the empty slots,
    K transposed)."""
    ins, _ = _io(entry)
    T, C, L = entry.ar_len, context - entry.ar_len, cfg.num_layers
    nodes, inits = _count_nodes(context, T, L)
    more, more_inits = _runner_mask_nodes(cfg, context, T)
    nodes += more
    inits += more_inits
    shape = (1, cfg.num_kv_heads, context, cfg.head_dim)
    book_spec = ins["k_cache_0"]
    inits += [_i64("genai/ctx", [context]), _i64("genai/C", [C]), _i64("genai/axis2", [2]),
              _i64("genai/fill_head", [1, cfg.num_kv_heads]), _i64("genai/fill_tail", [cfg.head_dim])]
    nodes += [helper.make_node("Sub", ["genai/ctx", "genai/n_past"], ["genai/held_start"]),
              helper.make_node("Sub", ["genai/C", "genai/n_past"], ["genai/n_empty"]),
              helper.make_node("Concat", ["genai/fill_head", "genai/n_empty", "genai/fill_tail"], ["genai/fill_shape"],
                               axis=0)]
    inputs = [_tensor(INPUT_IDS, "int32", (1, "n")), _tensor(POSITION_IDS, "int32", (1, "n")),
              _tensor(PAST_KEY % L, book_spec.dtype, shape)]
    outputs = [_tensor("tokens", "int32", (1, T)), _tensor("mask", "float32", tuple(ins["mask"].shape)),
               _tensor("positions", "int32", (1, T)), _tensor("genai_n_real", "int64", (1,)),
               _tensor("genai_offset", "int64", (1,))]
    for kv, past_name in (("k", PAST_KEY), ("v", PAST_VALUE)):
        for i in range(L):
            spec = ins[f"{kv}_cache_{i}"]
            past = past_name % i
            inputs.append(_tensor(past, spec.dtype, shape))
            empty = f"genai/{kv}{i}_empty"
            inits.append(_const(empty, spec.encoding.zero_point if spec.encoding is not None else 0,
                                helper.tensor_dtype_to_np_dtype(_ONNX_TYPE[spec.dtype])))
            held, fill, slots = f"genai/{kv}{i}_held", f"genai/{kv}{i}_fill", f"genai/{kv}{i}_slots"
            nodes += [helper.make_node("Slice", [past, "genai/held_start", "genai/ctx", "genai/axis2"], [held]),
                      helper.make_node("Expand", [empty, "genai/fill_shape"], [fill]),
                      helper.make_node("Concat", [held, fill], [spec.name if kv == "v" else slots], axis=2)]
            if kv == "k":
                nodes.append(helper.make_node("Transpose", [slots], [spec.name], perm=[0, 1, 3, 2]))
            outputs.append(_tensor(spec.name, spec.dtype, tuple(spec.shape)))
    return _model(nodes, inits, inputs, outputs, f"genai_in_{kind}")


def shared_out_stage(cfg: ModelConfig, context: int, entry: GraphEntry, kind: str) -> onnx.ModelProto:
    """shared: present = the buffer's last ctx - n_real slots followed by the chunk's n_real new
    entries (K back to [.., T, D]; padding never enters the cache), the bookkeeping cache marks
    those slots real, and ``genai_logits`` [1, n, V] holds the chunk's logits at its rows of the
    append (other rows 0: the runtime reads the last row, the append's last token, after the
    last chunk)."""
    _, outs = _io(entry)
    L = cfg.num_layers
    shape = (1, cfg.num_kv_heads, context, cfg.head_dim)
    logits = outs["logits"]
    inits = [_i64("genai/ctx", [context]), _i64("genai/axis1", [1]), _i64("genai/axis2", [2]), _i64("genai/zero1", [0]),
             _i64("genai/pad_zero", [0]), _const("genai/logit_pad", 0.0, np.float32)]
    book_spec = outs["k_new_0"]
    book_type = _ONNX_TYPE[book_spec.dtype]
    inits += [_i64("genai/p_start", [0, 0]), _i64("genai/p_axis", [1]), _i64("genai/pos_shape", [-1, 1]),
              _i64("genai/digit_div", BOOK_DIGITS), _i64("genai/base", [128]), _i64("genai/real1", [[1]]),
              _i64("genai/book_pad_head", [0, 0]), _i64("genai/book_pad_tail", [0, cfg.head_dim - 1 - len(BOOK_DIGITS)]),
              _i64("genai/book_axes", [0, 1]), _i64("genai/kv_heads", [1, cfg.num_kv_heads, 1, 1])]
    nodes = [
        # bookkeeping rows (n_real, D): 1, the digits of (runtime position + 1), zeros; in every head
        helper.make_node("Add", ["genai_offset", "genai_n_real"], ["genai/chunk_end"]),
        helper.make_node("Slice", [POSITION_IDS, "genai_offset", "genai/chunk_end", "genai/p_axis"], ["genai/chunk_pos"]),
        helper.make_node("Cast", ["genai/chunk_pos"], ["genai/chunk_pos_i"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["genai/chunk_pos_i", "genai/pos_shape"], ["genai/pos_col"]),  # (n_real, 1)
        helper.make_node("Add", ["genai/pos_col", "genai/real1"], ["genai/pos1"]),
        helper.make_node("Div", ["genai/pos1", "genai/digit_div"], ["genai/shifted"]),  # (n_real, 3)
        helper.make_node("Mod", ["genai/shifted", "genai/base"], ["genai/digit_vals"]),
        helper.make_node("Mul", ["genai/pos_col", "genai/zero1"], ["genai/zero_col"]),
        helper.make_node("Add", ["genai/zero_col", "genai/real1"], ["genai/real_col"]),
        helper.make_node("Concat", ["genai/real_col", "genai/digit_vals"], ["genai/book_head"], axis=1),  # (n_real, 4)
        helper.make_node("Concat", ["genai/book_pad_head", "genai/book_pad_tail"], ["genai/book_pads"], axis=0),
        helper.make_node("Pad", ["genai/book_head", "genai/book_pads"], ["genai/book_rows_i"]),  # (n_real, D)
        helper.make_node("Unsqueeze", ["genai/book_rows_i", "genai/book_axes"], ["genai/book_rows4"]),
        helper.make_node("Expand", ["genai/book_rows4", "genai/kv_heads"], ["genai/book_new_i"]),  # (1, KV, n_real, D)
        helper.make_node("Cast", ["genai/book_new_i"], ["genai/book_new"], to=book_type),
        helper.make_node("Slice", [PAST_KEY % L, "genai_n_real", "genai/ctx", "genai/axis2"], ["genai/book_kept"]),
        helper.make_node("Concat", ["genai/book_kept", "genai/book_new"], [PRESENT_KEY % L], axis=2),
             # genai_logits: rows [offset, offset + n_real) of [1, n, V]
             helper.make_node("Shape", [INPUT_IDS], ["genai/n"], start=1, end=2),
             helper.make_node("Slice", [logits.name, "genai/zero1", "genai_n_real", "genai/axis1"], ["genai/real_logits"]),
             helper.make_node("Sub", ["genai/n", "genai_offset"], ["genai/after_offset"]),
             helper.make_node("Sub", ["genai/after_offset", "genai_n_real"], ["genai/rows_after"]),
             helper.make_node("Concat", ["genai/pad_zero", "genai_offset", "genai/pad_zero", "genai/pad_zero",
                                         "genai/rows_after", "genai/pad_zero"], ["genai/logit_pads"], axis=0),
             helper.make_node("Pad", ["genai/real_logits", "genai/logit_pads", "genai/logit_pad"], [LOGITS])]
    inputs = [_tensor(INPUT_IDS, "int32", (1, "n")), _tensor(POSITION_IDS, "int32", (1, "n")),
              _tensor("genai_n_real", "int64", (1,)), _tensor("genai_offset", "int64", (1,)), _tensor(logits.name, "float32", tuple(logits.shape)),
              _tensor(PAST_KEY % L, book_spec.dtype, shape)]
    outputs = [_tensor(LOGITS, "float32", (1, "n", cfg.vocab_size)), _tensor(PRESENT_KEY % L, book_spec.dtype, shape)]
    for kv, past_name, present_name in (("k", PAST_KEY, PRESENT_KEY), ("v", PAST_VALUE, PRESENT_VALUE)):
        for i in range(L):
            new = outs[f"{kv}_new_{i}"]
            past, present = past_name % i, present_name % i
            inputs += [_tensor(past, new.dtype, shape), _tensor(new.name, new.dtype, tuple(new.shape))]
            rows = new.name
            if kv == "k":
                rows = f"genai/k{i}_rows"
                nodes.append(helper.make_node("Transpose", [new.name], [rows], perm=[0, 1, 3, 2]))
            nodes += [helper.make_node("Slice", [past, "genai_n_real", "genai/ctx", "genai/axis2"], [f"genai/{kv}{i}_kept"]),
                      helper.make_node("Slice", [rows, "genai/zero1", "genai_n_real", "genai/axis2"], [f"genai/{kv}{i}_real"]),
                      helper.make_node("Concat", [f"genai/{kv}{i}_kept", f"genai/{kv}{i}_real"], [present], axis=2)]
            outputs.append(_tensor(present, new.dtype, shape))
    return _model(nodes, inits, inputs, outputs, f"genai_out_{kind}")


# --------------------------------------------------------------------------- genai_config.json
def _names(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return [v.name for v in model.graph.input], [v.name for v in model.graph.output]


def npu_session_options(htp_arch: int | None) -> dict[str, Any]:
    """Session options that put a windowed folder's graphs on the QNN HTP: the backend by type
    (the library is QnnHtp.dll on Windows, libQnnHtp.so on Android) and, when known, the HTP
    architecture a compiled context was built for (docs/design.md §10)."""
    qnn = {"backend_type": "htp"}
    if htp_arch is not None:
        qnn["htp_arch"] = str(htp_arch)
    return {"log_id": "npuq", "provider_options": [{"qnn": qnn}]}


def pipeline_config(cfg: ModelConfig, context: int, cache: str, chains: dict[str, Sequence[GraphEntry]],
                    stages: dict[str, onnx.ModelProto], tokenizer_ids: dict[str, Any],
                    contexts: dict[str, str] | None = None, htp_arch: int | None = None) -> dict[str, Any]:
    """genai_config.json for the stages (file name → model) and npuq's graphs (``chains``: each
    kind's graphs, one per shard, in order). ``windowed``: the graphs run on the QNN HTP (the
    compiled context ``contexts[name]`` of a graph instead of its QDQ graph when the export has
    them; names as in the manifest's graph_entries); ``shared``: everything on the CPU."""
    window = chains["prefill"][0].ar_len
    cpu = {"provider_options": []}
    contexts = contexts or {}
    pipeline = []
    for kind, prompt in (("prefill", True), ("decode", False)):
        chain = chains[kind]
        before = f"genai_{'mask' if cache == 'windowed' else 'in'}_{kind}.onnx"
        steps: list[tuple[str, onnx.ModelProto | GraphEntry, dict | None]] = [(before, stages[before], cpu)]
        steps += [(contexts.get(f"{kind}{shard_tag(k, len(chain))}", entry.file), entry, None)
                  for k, entry in enumerate(chain)]
        if cache == "shared":
            after = f"genai_out_{kind}.onnx"
            steps.append((after, stages[after], cpu))
        for file, model, options in steps:
            if isinstance(model, onnx.ModelProto):
                inputs, outputs = _names(model)
            else:
                inputs, outputs = [s.name for s in model.inputs], [s.name for s in model.outputs]
            stage: dict[str, Any] = {"filename": file, "inputs": inputs, "outputs": outputs,
                                     "run_on_prompt": prompt, "run_on_token_gen": not prompt}
            if options is not None:
                stage["session_options"] = options
            pipeline.append({file.removesuffix(".onnx"): stage})
    if cache == "windowed":
        past_k, past_v, present_k, present_v = "k_cache_%d", "v_cache_%d", "k_new_%d", "v_new_%d"
    else:
        past_k, past_v, present_k, present_v = PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE
    if cache == "windowed":
        sliding: dict[str, Any] = {"window_size": window, "alignment": "right", "slide_inputs": True,
                                   "slide_key_value_cache": True,
                                   "pad_value": pad_value(e for chain in chains.values() for e in chain)}
        names = {"input_ids": "tokens", "position_ids": "positions", "logits": "logits"}
    else:
        # The runtime calls the prompt stages ceil(n / window) times for an append of n > 1 tokens
        # (a sliding_window with window_size makes it chunk), each time with the whole append,
        # unpadded (slide_inputs false), and its true positions; the stages pick the chunk.
        sliding = {"window_size": window, "slide_inputs": False, "slide_key_value_cache": False}
        names = {"input_ids": INPUT_IDS, "position_ids": POSITION_IDS, "logits": LOGITS}
    decoder = {
        "session_options": (npu_session_options(htp_arch) if cache == "windowed"
                            else {"log_id": "npuq", "provider_options": [], **EXACT}),
        "head_size": cfg.head_dim, "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        # shared: one more cache "layer", the stages' bookkeeping (which slots hold real tokens)
        "num_hidden_layers": cfg.num_layers + (cache == "shared"), "num_key_value_heads": cfg.num_kv_heads,
        "inputs": {"input_ids": names["input_ids"], "position_ids": names["position_ids"],
                   "attention_mask": ATTENTION_MASK, "past_key_names": past_k, "past_value_names": past_v},
        "outputs": {"logits": names["logits"], "present_key_names": present_k, "present_value_names": present_v},
        "sliding_window": sliding,
        "pipeline": pipeline,
    }
    ids = dict(tokenizer_ids)
    if cache == "shared":
        # Nothing is padded, but onnxruntime-genai 0.18 still takes the logits of the last token
        # that is not pad_token_id (probed: an append ending in it read another row): an id no
        # token has keeps that the append's last token.
        ids["pad_token_id"] = NO_TOKEN
    model = {"type": "decoder-pipeline", "context_length": context, "vocab_size": cfg.vocab_size,
             "decoder": decoder, **ids}
    search = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context, "min_length": 0,
              "past_present_share_buffer": cache == "shared", "top_k": 1, "top_p": 1.0, "temperature": 1.0,
              "repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
              "early_stopping": True}
    return {"model": model, "search": search}


# --------------------------------------------------------------------------- the folder
def token_ids(cfg: ModelConfig, tokenizer: Any) -> dict[str, int]:
    """bos / eos / pad ids for genai_config.json. The windowed runtime pads a prompt with
    pad_token_id and treats every prompt token equal to it as padding: the tokenizer's pad token,
    else EOS (the shared contract replaces it with NO_TOKEN: pipeline_config)."""
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    pad = pad if pad is not None else eos
    if eos is None or pad is None:
        raise NpuqError("--genai: the model names no end-of-sequence token, which onnxruntime-genai needs "
                        "(eos_token_id in config.json or the tokenizer)")
    ids = {"eos_token_id": int(eos), "pad_token_id": int(pad)}
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        ids["bos_token_id"] = int(bos)
    return ids


def chat_template_file(folder: Path, written: Sequence[str], tokenizer: Any) -> str | None:
    """The tokenizer file that holds the model's chat template (``save_pretrained`` writes
    chat_template.jinja, which onnxruntime-genai's ``apply_chat_template`` reads; older
    transformers put it into tokenizer_config.json), or None when the model has none (a GGUF's
    ``tokenizer.chat_template``, a Hugging Face folder's template: whatever the tokenizer loaded)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    if "chat_template.jinja" in written:
        return "chat_template.jinja"
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    if config.get("chat_template"):
        return "tokenizer_config.json"
    raise NpuqError("--genai: the model's tokenizer has a chat template but saved it nowhere onnxruntime-genai "
                    "reads; export with the transformers version pinned by npuq")


def write_folder(folder: Path, cfg: ModelConfig, context: int, cache: str, shards: Sequence[dict[str, GraphEntry]],
                 tokenizer: Any, contexts: dict[str, str] | None = None, htp_arch: int | None = None) -> GenaiFolder:
    """Write the stages, the tokenizer and genai_config.json into ``folder`` (the export being
    written, beside npuq's graphs); returns the manifest's record of them. ``shards``: each
    shard's graphs by kind, in order (one for an unsharded export); ``contexts``: the compiled
    context of each graph (--compile, by graph name), which a windowed folder's pipeline runs."""
    chains = {kind: [s[kind] for s in shards] for kind in shards[0]}
    graphs = {kind: chain_entry(chain) for kind, chain in chains.items()}
    stages: dict[str, onnx.ModelProto] = {}
    for kind, entry in graphs.items():
        if cache == "windowed":
            stages[f"genai_mask_{kind}.onnx"] = mask_stage(cfg, context, entry, kind)
        else:
            stages[f"genai_in_{kind}.onnx"] = shared_in_stage(cfg, context, entry, kind)
            stages[f"genai_out_{kind}.onnx"] = shared_out_stage(cfg, context, entry, kind)
    for file, model in stages.items():
        (folder / file).write_bytes(model.SerializeToString())
    before = set(p.name for p in folder.iterdir())
    try:
        tokenizer.save_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001  (transformers raises many types)
        raise NpuqError(f"--genai: cannot save the model's tokenizer ({type(exc).__name__}: {exc}); export "
                        "without --genai") from None
    written = tuple(sorted(set(p.name for p in folder.iterdir()) - before))
    if "tokenizer.json" not in written:
        raise NpuqError("--genai: the model's tokenizer has no fast (tokenizer.json) form, which onnxruntime-genai "
                        "reads; export without --genai")
    template = chat_template_file(folder, written, tokenizer)
    config = pipeline_config(cfg, context, cache, chains, stages, token_ids(cfg, tokenizer), contexts, htp_arch)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    order = tuple(next(iter(stage.values()))["filename"] for stage in config["model"]["decoder"]["pipeline"])
    return GenaiFolder(config=CONFIG_FILE, cache=cache, model_type="decoder-pipeline", window=graphs["prefill"].ar_len,
                       pad_value=config["model"]["decoder"]["sliding_window"].get("pad_value"), stages=order,
                       tokenizer=written, verified=VERIFIED[cache], chat_template=template)
