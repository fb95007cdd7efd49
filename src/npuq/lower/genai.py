"""An onnxruntime-genai model folder around an export's graphs (``npuq export --genai windowed|shared``,
docs/design.md §10, §11).

onnxruntime-genai's ``decoder-pipeline`` model type runs a list of ONNX graphs ("stages") in
order, passing each stage's outputs to the later stages by name; the tokens, positions,
attention mask, KV cache and logits are the runtime's own ("managed") tensors. npuq's prefill
and decode graphs become two stages (prompt and token generation) as they are written, and
small float graphs of a few ops, on the CPU, turn the runtime's tensors into npuq's:

    attention_mask [1, ctx] int64 (1: a real token; the current window in the last T columns)
    + positions [1, T]  →  mask [1, M, T, ctx], npuq's additive mask (0 / MASK_VALUE)

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
  the graphs must shift themselves. Stages ``genai_in_<graph>`` (mask, then each cache's last
  ctx - T slots as npuq's inputs, empty slots set to the zero point as npuq's runner keeps them)
  and ``genai_out_<graph>`` (present = the last ctx - T slots followed by the new entries) wrap
  npuq's graphs, which are unchanged. This contract runs on any ONNX Runtime, which is how
  npuq's tests prove the folder with onnxruntime-genai itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from npuq.errors import NpuqError
from npuq.lower.manifest import KV_PREFIXES, GenaiFolder, GraphEntry, IOEntry
from npuq.models.config import ModelConfig
from npuq.models.decoder import MASK_VALUE

RUNTIME = "onnxruntime-genai 0.18"
VERIFIED = {"shared": "onnxruntime-genai 0.18 on the CPU provider (npuq's tests)",
            "windowed": "reference driver of the windowed cache on ONNX Runtime (CPU, and the QNN HTP emulator for "
                        "compiled contexts); onnxruntime-genai selects this cache on a QNN HTP device only"}
CONFIG_FILE = "genai_config.json"
OPSET = 21
ATTENTION_MASK = "attention_mask"
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"  # shared contract: the runtime's buffers
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"
# The QDQ graphs computed exactly, as npuq's own CPU sessions run them (docs/design.md §9).
EXACT = {"graph_optimization_level": "ORT_DISABLE_ALL"}
_ONNX_TYPE = {"uint8": TensorProto.UINT8, "uint16": TensorProto.UINT16, "int8": TensorProto.INT8,
              "int16": TensorProto.INT16, "float32": TensorProto.FLOAT, "int32": TensorProto.INT32,
              "int64": TensorProto.INT64}


def _io(entry: GraphEntry) -> tuple[dict[str, IOEntry], dict[str, IOEntry]]:
    return {s.name: s for s in entry.inputs}, {s.name: s for s in entry.outputs}


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
    for name in ("tokens", "mask", "positions", "logits", "k_cache_0", "v_cache_0", "k_new_0", "v_new_0"):
        if name not in names:
            raise NpuqError(f"--genai: the {kind} graph has no tensor {name!r}; export again with this npuq")
    if names["mask"].shape[1] != (2 if cfg.has_sliding_layers else 1) or names["logits"].dtype != "float32":
        raise NpuqError(f"--genai: the {kind} graph's mask or logits are not npuq's; export again with this npuq")
    kv = [s for s in specs if s.name.startswith(KV_PREFIXES)]
    if cache == "windowed":
        wrong = sorted({s.dtype for s in kv if s.dtype != "uint8"})
        if wrong:
            raise NpuqError(
                f"--genai windowed: onnxruntime-genai's NPU cache holds uint8 KV codes, but this artifact's KV cache "
                f"is {', '.join(wrong)}: quantize again with a recipe that has \"kv_bits\": 8 (a JSON recipe file such "
                "as {\"default\": \"16a8w\", \"kv_bits\": 8}), or use --genai shared (the CPU provider's contract, "
                "any KV type)")
        if any(s.encoding is None or isinstance(s.encoding.scale, tuple) or isinstance(s.encoding.zero_point, tuple)
               for s in kv):
            raise NpuqError("--genai windowed: the KV cache must be quantized per tensor; quantize again")
    elif any(s.dtype not in _ONNX_TYPE for s in kv):
        raise NpuqError("--genai shared: a KV cache type this npuq cannot wrap; export again with this npuq")


def pad_value(graphs: dict[str, Any]) -> int:
    """The one value the windowed runtime fills empty slots with: the caches' common zero point
    (uint8 symmetric KV: 128); when the caches' zero points differ, the most common one."""
    points = [int(s.encoding.zero_point) for g in graphs.values() for s in g.inputs
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


def shared_in_stage(cfg: ModelConfig, context: int, entry: GraphEntry, kind: str) -> onnx.ModelProto:
    """shared: the mask, and each cache's last ctx - T slots in npuq's layout (K transposed),
    the slots no real token holds set to the cache's zero point."""
    ins, _ = _io(entry)
    T, C, L = entry.ar_len, context - entry.ar_len, cfg.num_layers
    nodes, inits = _mask_nodes(cfg, context, T)
    inits += [_const("genai/start", [T], np.int64), _const("genai/end", [context], np.int64),
              _const("genai/axis2", [2], np.int64), _const("genai/m0", [0], np.int64), _const("genai/mC", [C], np.int64),
              _const("genai/m_axis", [1], np.int64), _const("genai/slot_shape", [1, 1, C, 1], np.int64)]
    nodes += [helper.make_node("Slice", ["genai/valid", "genai/m0", "genai/mC", "genai/m_axis"], ["genai/past_valid"]),
              helper.make_node("Reshape", ["genai/past_valid", "genai/slot_shape"], ["genai/slot_valid"])]
    inputs = [_tensor(ATTENTION_MASK, "int64", (1, context)), _tensor("positions", "int32", (1, T))]
    outputs = [_tensor("mask", "float32", tuple(ins["mask"].shape))]
    for kv, past_name in (("k", PAST_KEY), ("v", PAST_VALUE)):
        for i in range(L):
            spec = ins[f"{kv}_cache_{i}"]
            past = past_name % i
            inputs.append(_tensor(past, spec.dtype, (1, cfg.num_kv_heads, context, cfg.head_dim)))
            empty = f"genai/{kv}{i}_empty"
            # Where in int32 (ONNX Runtime's CPU Where has no 16-bit kernels); codes are exact in it
            wide = spec.dtype if spec.dtype in ("float32", "uint8", "int32", "int64") else "int32"
            inits.append(_const(empty, spec.encoding.zero_point if spec.encoding is not None else 0,
                                helper.tensor_dtype_to_np_dtype(_ONNX_TYPE[wide])))
            recent, kept = f"genai/{kv}{i}_recent", f"genai/{kv}{i}_kept"
            nodes.append(helper.make_node("Slice", [past, "genai/start", "genai/end", "genai/axis2"], [recent]))
            if wide != spec.dtype:
                nodes.append(helper.make_node("Cast", [recent], [recent + "_wide"], to=_ONNX_TYPE[wide]))
                recent = recent + "_wide"
            nodes.append(helper.make_node("Where", ["genai/slot_valid", recent, empty], [kept + "_wide"]))
            last = spec.name if kv == "v" else kept
            nodes.append(helper.make_node("Cast", [kept + "_wide"], [last], to=_ONNX_TYPE[spec.dtype]))
            if kv == "k":
                nodes.append(helper.make_node("Transpose", [kept], [spec.name], perm=[0, 1, 3, 2]))
            outputs.append(_tensor(spec.name, spec.dtype, tuple(spec.shape)))
    return _model(nodes, inits, inputs, outputs, f"genai_in_{kind}")


def shared_out_stage(cfg: ModelConfig, context: int, entry: GraphEntry, kind: str) -> onnx.ModelProto:
    """shared: present = the cache's last ctx - T slots followed by the T new entries (K back to
    [.., T, D])."""
    _, outs = _io(entry)
    T, L = entry.ar_len, cfg.num_layers
    inits = [_const("genai/start", [T], np.int64), _const("genai/end", [context], np.int64),
             _const("genai/axis2", [2], np.int64)]
    nodes, inputs, outputs = [], [], []
    for kv, past_name, present_name in (("k", PAST_KEY, PRESENT_KEY), ("v", PAST_VALUE, PRESENT_VALUE)):
        for i in range(L):
            new = outs[f"{kv}_new_{i}"]
            past, present = past_name % i, present_name % i
            shape = (1, cfg.num_kv_heads, context, cfg.head_dim)
            inputs += [_tensor(past, new.dtype, shape), _tensor(new.name, new.dtype, tuple(new.shape))]
            rows = new.name
            if kv == "k":
                rows = f"genai/k{i}_rows"
                nodes.append(helper.make_node("Transpose", [new.name], [rows], perm=[0, 1, 3, 2]))
            nodes += [helper.make_node("Slice", [past, "genai/start", "genai/end", "genai/axis2"], [f"genai/{kv}{i}_kept"]),
                      helper.make_node("Concat", [f"genai/{kv}{i}_kept", rows], [present], axis=2)]
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


def pipeline_config(cfg: ModelConfig, context: int, cache: str, graphs: dict[str, GraphEntry],
                    stages: dict[str, onnx.ModelProto], tokenizer_ids: dict[str, Any],
                    contexts: dict[str, str] | None = None, htp_arch: int | None = None) -> dict[str, Any]:
    """genai_config.json for the stages (file name → model) and npuq's graphs. ``windowed``:
    the graphs run on the QNN HTP (the compiled contexts ``contexts[kind]`` instead of the QDQ
    graphs when the export has them); ``shared``: everything on the CPU."""
    window = graphs["prefill"].ar_len
    cpu = {"provider_options": []}
    contexts = contexts or {}
    pipeline = []
    for kind, prompt in (("prefill", True), ("decode", False)):
        entry = graphs[kind]
        before = f"genai_{'mask' if cache == 'windowed' else 'in'}_{kind}.onnx"
        steps = [(before, stages[before], cpu)]
        steps.append((contexts.get(kind, entry.file), None, None))
        if cache == "shared":
            after = f"genai_out_{kind}.onnx"
            steps.append((after, stages[after], cpu))
        for file, model, options in steps:
            if model is not None:
                inputs, outputs = _names(model)
            else:
                inputs, outputs = [s.name for s in entry.inputs], [s.name for s in entry.outputs]
            stage: dict[str, Any] = {"filename": file, "inputs": inputs, "outputs": outputs,
                                     "run_on_prompt": prompt, "run_on_token_gen": not prompt}
            if options is not None:
                stage["session_options"] = options
            pipeline.append({file.removesuffix(".onnx"): stage})
    if cache == "windowed":
        past_k, past_v, present_k, present_v = "k_cache_%d", "v_cache_%d", "k_new_%d", "v_new_%d"
    else:
        past_k, past_v, present_k, present_v = PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE
    sliding: dict[str, Any] = {"window_size": window, "alignment": "right", "slide_inputs": True,
                               "slide_key_value_cache": cache == "windowed"}
    if cache == "windowed":
        sliding["pad_value"] = pad_value(graphs)
    decoder = {
        "session_options": (npu_session_options(htp_arch) if cache == "windowed"
                            else {"log_id": "npuq", "provider_options": [], **EXACT}),
        "head_size": cfg.head_dim, "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers, "num_key_value_heads": cfg.num_kv_heads,
        "inputs": {"input_ids": "tokens", "position_ids": "positions", "attention_mask": ATTENTION_MASK,
                   "past_key_names": past_k, "past_value_names": past_v},
        "outputs": {"logits": "logits", "present_key_names": present_k, "present_value_names": present_v},
        "sliding_window": sliding,
        "pipeline": pipeline,
    }
    model = {"type": "decoder-pipeline", "context_length": context, "vocab_size": cfg.vocab_size,
             "decoder": decoder, **tokenizer_ids}
    search = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context, "min_length": 0,
              "past_present_share_buffer": cache == "shared", "top_k": 1, "top_p": 1.0, "temperature": 1.0,
              "repetition_penalty": 1.0, "length_penalty": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
              "early_stopping": True}
    return {"model": model, "search": search}


# --------------------------------------------------------------------------- the folder
def token_ids(cfg: ModelConfig, tokenizer: Any) -> dict[str, int]:
    """bos / eos / pad ids for genai_config.json. The runtime pads a prompt with pad_token_id and
    treats every prompt token equal to it as padding: the tokenizer's pad token, else EOS."""
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


def write_folder(folder: Path, cfg: ModelConfig, context: int, cache: str, graphs: dict[str, GraphEntry],
                 tokenizer: Any, contexts: dict[str, str] | None = None, htp_arch: int | None = None) -> GenaiFolder:
    """Write the stages, the tokenizer and genai_config.json into ``folder`` (the export being
    written, beside npuq's graphs); returns the manifest's record of them. ``contexts``: the
    compiled context of each graph (--compile), which a windowed folder's pipeline runs."""
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
    config = pipeline_config(cfg, context, cache, graphs, stages, token_ids(cfg, tokenizer), contexts, htp_arch)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    order = tuple(next(iter(stage.values()))["filename"] for stage in config["model"]["decoder"]["pipeline"])
    return GenaiFolder(config=CONFIG_FILE, cache=cache, model_type="decoder-pipeline", window=graphs["prefill"].ar_len,
                       pad_value=config["model"]["decoder"]["sliding_window"].get("pad_value"), stages=order,
                       tokenizer=written, verified=VERIFIED[cache])
