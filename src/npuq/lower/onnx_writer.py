"""Walk a converted PT2E program and write an opset-21 QDQ ONNX graph with static shapes.

The converted program (torch.export after torchao ``convert_pt2e``) is aten ops wrapped by
``quantized_decomposed`` quantize / dequantize ops. Each call_function node is handed to the
builder the registry picks for the target; the writer only threads values between them,
then:

- quantized I/O: a graph input whose only consumers quantize it becomes an input of the
  quantized type, and an output produced by a dequantize becomes the quantized tensor, so a
  runner can copy KV-cache codes straight from outputs to inputs (docs/design.md §2);
- ``fold_identity_requant``: a QuantizeLinear reading a DequantizeLinear of the same
  encoding (data-movement ops sharing their input's encoding) is removed;
- ``share_qdq_params``: each DequantizeLinear reading a QuantizeLinear reads that node's scale
  and zero-point initializers by name (the pair form AIMET's QDQ importer recognises,
  docs/design.md §11);
- ``remove_dead``: nodes and initializers nothing reads are dropped.
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from npuq.errors import NpuqError
from npuq.lower.builders.qdq import DEQUANTIZE_OPS, QUANTIZE_OPS, encoding_of
from npuq.lower.qparams import Encoding
from npuq.lower.builders import select
from npuq.lower.ir import Initializer, Lowered, NodeView, Note, Unsupported, Value
from npuq.lower.manifest import IOEncoding, IOEntry
from npuq.lower.patterns import RMS_NORM_OP, match_patterns
from npuq.quantize.graphfile import NARROWED
from npuq.lower.registry import BuildContext, LowerOptions
from npuq.lower.target import Target
from npuq.records import to_json

log = logging.getLogger("npuq.lower")

OPSET = 21
IR_VERSION = 10
# Nodes that compute nothing the graph needs (export-time checks).
SKIP_OPS = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
            "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg"}

ONNX_OF_TORCH = {
    torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32, torch.int16: TensorProto.INT16, torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL,
}


class UnsupportedOp(NpuqError):
    """A node of the program that no builder can lower for the target."""


@dataclass(frozen=True)
class IOSpec:
    """One graph input or output as a runner sees it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy name: float32, int64, uint16, ...
    encoding: Encoding | None = None  # set when the tensor holds quantized codes

    def entry(self) -> IOEntry:
        """The spec as manifest.json records it."""
        enc = self.encoding
        if enc is None:
            return IOEntry(self.name, tuple(self.shape), self.dtype)
        return IOEntry(self.name, tuple(self.shape), self.dtype, IOEncoding(
            enc.type_name, enc.bits, enc.qmin, enc.qmax, _numbers(enc.scale), _numbers(enc.zero_point),
            enc.axis, enc.block_size))

    def to_json(self) -> dict[str, Any]:
        return to_json(self.entry())


def _numbers(a: np.ndarray) -> Any:
    """A 0-d array as its number, any other as a tuple of its values."""
    return a.item() if a.ndim == 0 else tuple(a.tolist())


@dataclass
class LoweredGraph:
    model: onnx.ModelProto
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    notes: list[Note] = field(default_factory=list)
    builders: dict[str, str] = field(default_factory=dict)  # op → variant used


def _np_dtype_name(elem_type: int) -> str:
    return helper.tensor_dtype_to_np_dtype(elem_type).name


def _graph_module(program) -> torch.fx.GraphModule:
    if isinstance(program, torch.export.ExportedProgram):
        return program.module()
    if isinstance(program, torch.fx.GraphModule):
        return program
    raise TypeError(f"expected an ExportedProgram or GraphModule, got {type(program).__name__}")


def _has_meta(graph: torch.fx.Graph) -> bool:
    return all(isinstance(n.meta.get("val"), torch.Tensor) for n in graph.nodes
               if n.op == "call_function" and _op_name(n) not in SKIP_OPS)


def _program_graph(program) -> tuple[torch.fx.Graph, Callable[[str], Any]]:
    """The graph to walk, with every node's metadata, and the lookup of its get_attr targets.

    For an ExportedProgram this is the graph ``program.module()`` builds, made without
    building the module: a copy of the program's graph in which each lifted parameter,
    buffer or constant placeholder becomes a get_attr node, the way
    ``torch.export._unlift`` does it (so the nodes get the same names), and whose targets
    are read from the program's state dict and constants. ``module()`` also generates and
    compiles Python code for the graph (several times), which the lowering never runs: most
    of its cost on a real model. Programs whose signature holds anything else (mutated
    buffers, tokens, custom objects) or that lack metadata go through ``module()``.
    """
    if isinstance(program, torch.export.ExportedProgram):
        flat = _unlifted_graph(program)
        if flat is not None:
            return flat
    gm = _graph_module(program)
    _ensure_meta(gm)
    return gm.graph, lambda target: _get_attr(gm, target)


def _unlifted_graph(ep: torch.export.ExportedProgram) -> tuple[torch.fx.Graph, Callable[[str], Any]] | None:
    sig = ep.graph_signature
    lifted = {InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR}
    if any(s.kind not in lifted | {InputKind.USER_INPUT} for s in sig.input_specs) \
            or any(s.kind != OutputKind.USER_OUTPUT for s in sig.output_specs) or not _has_meta(ep.graph):
        return None
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(sig.input_specs):
        return None
    tensors: dict[str, Any] = {}
    for spec in sig.input_specs:
        if spec.kind in lifted:
            source = ep.state_dict if spec.target in ep.state_dict else ep.constants
            if spec.target not in source:
                return None
            tensors[spec.target] = source[spec.target]
    graph = copy.deepcopy(ep.graph)  # module() unlifts a deep copy too: same names, same counters
    for node, spec in zip([n for n in graph.nodes if n.op == "placeholder"], sig.input_specs):
        if spec.kind not in lifted:
            continue
        with graph.inserting_after(node), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            getattr_node = graph.get_attr(spec.target)
        node.replace_all_uses_with(getattr_node)
        meta = node.meta
        graph.erase_node(node)
        getattr_node.meta = meta
    return graph, tensors.__getitem__


def _ensure_meta(gm: torch.fx.GraphModule) -> None:
    """Give every node a ``meta["val"]`` (convert_pt2e leaves its q/dq nodes without one) by
    propagating fake tensors shaped like the placeholders: no real computation."""
    computing = [n for n in gm.graph.nodes if n.op == "call_function"]
    if all(isinstance(n.meta.get("val"), torch.Tensor) for n in computing if _op_name(n) not in SKIP_OPS):
        return
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedOp(f"graph input {n.name!r} has no shape metadata; export the program with torch.export")
        inputs.append(mode.from_tensor(torch.empty(tuple(val.shape), dtype=val.dtype)))
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)


def _get_attr(gm: torch.nn.Module, target: str):
    """Walk a dotted attribute path (``getattr(m, "a.b.c")`` would fail, docs/design.md §6)."""
    obj = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _meta(node: torch.fx.Node) -> tuple[tuple[int, ...], int]:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise UnsupportedOp(f"node {node.name!r} ({node.target}) has no static tensor metadata; export with torch.export")
    if val.dtype not in ONNX_OF_TORCH:
        raise UnsupportedOp(f"node {node.name!r} has dtype {val.dtype}, which the lowering does not handle")
    return tuple(int(d) for d in val.shape), ONNX_OF_TORCH[val.dtype]


_OP_NAMES: dict[Any, str] = {}


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    try:
        return _OP_NAMES[target]
    except (KeyError, TypeError):
        pass
    name = str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    try:
        _OP_NAMES[target] = name
    except TypeError:  # an unhashable target
        pass
    return name


def _users(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [u for u in node.users if u.op == "call_function" and _op_name(u) not in SKIP_OPS]


def lower_program(
    program,
    target: Target | None = None,
    options: LowerOptions | None = None,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    quantized_io: Callable[[str], bool] | Iterable[str] = (),
    graph_name: str = "npuq",
    log_warnings: bool = True,
) -> LoweredGraph:
    """Lower a converted PT2E program to a QDQ ONNX model (see the module docstring).

    ``quantized_io`` names the inputs/outputs to carry as quantized codes (the KV caches);
    ``input_names``/``output_names`` rename the graph I/O in order.
    """
    target = target or Target()
    ctx = BuildContext(target, options or LowerOptions())
    wants_quantized = quantized_io if callable(quantized_io) else frozenset(quantized_io).__contains__
    graph, get_attr = _program_graph(program)
    narrowed = getattr(program, "meta", {}).get(NARROWED, frozenset())

    env: dict[torch.fx.Node, Any] = {}
    nodes: list[onnx.NodeProto] = []
    initializers: dict[str, Initializer | onnx.TensorProto] = {}
    consts: dict[str, np.ndarray] = {}  # get_attr tensors, materialized if an ONNX node reads them raw
    notes: list[Note] = []
    opsets: dict[str, int] = {"": OPSET}
    inputs: list[IOSpec] = []
    builders: dict[str, str] = {}

    def resolve(arg):
        if isinstance(arg, torch.fx.Node):
            if arg not in env:
                raise UnsupportedOp(f"node {arg.name!r} is used before it is lowered")
            return env[arg]
        if isinstance(arg, (list, tuple)):
            return type(arg)(resolve(a) for a in arg)
        return arg

    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        tensor = get_attr(node.target)
        if isinstance(tensor, torch.Tensor):
            array = tensor.detach().cpu().numpy()
            dtype = tensor.dtype
            if node.target in narrowed:
                # 16-bit codes read narrow (npuq.quantize.graphfile.read_program): a dequantize
                # takes them as they are (it casts its codes to the format's type, uint16); any
                # other reader gets the int32 the program holds
                dtype = torch.int32
                if not node.users or not all(u.op == "call_function" and _op_name(u) in DEQUANTIZE_OPS
                                             for u in node.users):
                    array = array.astype(np.int32)
            consts[node.name] = array
            env[node] = Value(node.name, tuple(array.shape), ONNX_OF_TORCH.get(dtype, TensorProto.FLOAT), const=array)

    fused = match_patterns(graph)
    internal = {n for m in fused.values() for n in m.internal}

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if input_names is not None and len(input_names) != len(placeholders):
        raise NpuqError(f"{len(input_names)} input names for {len(placeholders)} graph inputs")
    for i, node in enumerate(placeholders):
        name = input_names[i] if input_names is not None else node.name
        shape, elem_type = _meta(node)
        value = Value(name, shape, elem_type)
        users = _users(node)
        if wants_quantized(name) and users and all(_op_name(u) in QUANTIZE_OPS for u in users):
            encs = [encoding_of(_op_name(u), (None, *resolve(u.args[1:])), False) for u in users]
            if all(encs[0].same_as(e) for e in encs[1:]) and not encs[0].per_channel:
                value = Value(name, shape, encs[0].onnx_type, encoding=encs[0])
                for u in users:
                    env[u] = value
        env[node] = value
        inputs.append(IOSpec(name, shape, _np_dtype_name(value.elem_type), value.encoding))

    for node in graph.nodes:
        if node.op == "placeholder" or node in env:
            continue
        if node.op == "get_attr":
            continue
        if node.op == "call_module":
            if str(node.target).startswith("_guards"):
                continue
            raise UnsupportedOp(f"node {node.name!r} calls module {node.target!r}; lower a flat (exported) program")
        if node.op == "output":
            break
        op = _op_name(node)
        if op in SKIP_OPS or node in internal:
            continue
        shape, elem_type = _meta(node)
        args, kwargs = node.args, node.kwargs
        if node in fused:
            m = fused[node]
            op, args, kwargs = RMS_NORM_OP, (m.x, m.weight, m.eps), {}
        view = NodeView(node.name, op, resolve(args), dict(resolve(kwargs)), shape, elem_type,
                        _output_encoding(node, resolve))
        try:
            spec = select(op, target, ctx.options.variant_for(op))
            lowered: Lowered = spec.fn(view, ctx)
        except Unsupported as exc:
            raise UnsupportedOp(
                f"cannot lower node {node.name!r} ({op}) for {target.describe()}: {exc}"
            ) from None
        builders[op] = spec.variant
        nodes.extend(lowered.nodes)
        for init in lowered.initializers:
            initializers.setdefault(init.name, init)
        notes.extend(lowered.notes)
        for domain, version in lowered.opsets:
            opsets[domain] = version
        env[node] = lowered.outputs[0] if len(lowered.outputs) == 1 else lowered.outputs

    out_node = next(n for n in graph.nodes if n.op == "output")
    results = out_node.args[0]
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    if output_names is not None and len(output_names) != len(results):
        raise NpuqError(f"{len(output_names)} output names for {len(results)} graph outputs")
    outputs: list[IOSpec] = []
    renames: dict[str, str] = {}
    input_names_set = {s.name for s in inputs}
    for i, fx_out in enumerate(results):
        name = output_names[i] if output_names is not None else fx_out.name
        value: Value = env[fx_out]
        if wants_quantized(name) and isinstance(fx_out, torch.fx.Node) and _op_name(fx_out) in DEQUANTIZE_OPS \
                and value.encoding is not None and not value.encoding.per_channel and value.quantized:
            value = Value(value.quantized, value.shape, value.encoding.onnx_type, encoding=value.encoding)
        elif value.elem_type != TensorProto.FLOAT and value.encoding is not None:
            pass  # already quantized (no dequantize before the output)
        else:
            value = Value(value.name, value.shape, value.elem_type)
        produced = value.name not in input_names_set and value.name not in renames and value.name not in consts \
            and value.name not in initializers
        if produced:
            renames[value.name] = name
        else:
            nodes.append(helper.make_node("Identity", [renames.get(value.name, value.name)], [name], name=name))
        outputs.append(IOSpec(name, value.shape, _np_dtype_name(value.elem_type),
                              value.encoding if value.elem_type != TensorProto.FLOAT else None))

    _rename(nodes, renames)
    protected = {o.name for o in outputs}
    nodes = fold_identity_requant(nodes, initializers, protected)
    nodes = merge_transposes(nodes, initializers, protected)
    share_qdq_params(nodes, initializers)
    nodes, used = remove_dead(nodes, [o.name for o in outputs])
    inputs = narrow_index_inputs(nodes, inputs, notes)
    for name in consts:  # in graph order, so the file does not depend on set iteration order
        if name in used and name not in initializers:
            initializers[name] = Initializer(name, consts[name])
    model = _assemble(
        graph_name, nodes,
        [helper.make_tensor_value_info(s.name, helper.np_dtype_to_tensor_dtype(np.dtype(s.dtype)), s.shape) for s in inputs],
        [helper.make_tensor_value_info(s.name, helper.np_dtype_to_tensor_dtype(np.dtype(s.dtype)), s.shape) for s in outputs],
        [initializers[n] for n in initializers if n in used], opsets,
    )
    if log_warnings:
        log_notes_once(notes)
    return LoweredGraph(model, inputs, outputs, notes, builders)


def _assemble(name: str, nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
              outputs: list[onnx.ValueInfoProto], initializers: list[Initializer | onnx.TensorProto],
              opsets: dict[str, int]) -> onnx.ModelProto:
    """The model ``helper.make_model(helper.make_graph(...))`` builds, field for field, filled
    in place: make_graph copies every initializer into the graph and make_model copies the
    whole graph into the model (twice the weights' bytes). Each :class:`Initializer` is encoded
    once, directly into the model's graph."""
    model = onnx.ModelProto()
    model.ir_version = IR_VERSION
    model.producer_name = "npuq"
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in opsets.items())
    graph = model.graph
    graph.node.extend(nodes)
    graph.name = name
    graph.input.extend(inputs)
    graph.output.extend(outputs)
    for init in initializers:
        if isinstance(init, Initializer):
            write_tensor(graph.initializer.add(), init.array, init.name)
        else:
            graph.initializer.append(init)
    return model


# numpy_helper.from_array packs these (or handles them element by element): left to it.
_PACKED = {TensorProto.INT4, TensorProto.UINT4, TensorProto.STRING}
_PACKED |= {getattr(TensorProto, n) for n in ("FLOAT4E2M1", "INT2", "UINT2", "FLOAT6E2M3", "FLOAT6E3M2")
            if hasattr(TensorProto, n)}


def write_tensor(tensor: onnx.TensorProto, array: np.ndarray, name: str) -> None:
    """Fill the empty ``tensor`` exactly as ``numpy_helper.from_array(array, name)`` would
    (dims, name, data type, little-endian raw data), without an intermediate TensorProto to
    copy; exotic types go through from_array itself."""
    array = np.asarray(array)
    dtype = None if array.dtype == object or np.issubdtype(array.dtype, np.str_) \
        else helper.np_dtype_to_tensor_dtype(array.dtype)
    if dtype is None or dtype in _PACKED:
        tensor.CopyFrom(numpy_helper.from_array(array, name))
        return
    tensor.dims.extend(array.shape)
    if name:
        tensor.name = name
    tensor.data_type = dtype
    if array.dtype.byteorder == ">" or (sys.byteorder == "big" and array.dtype.byteorder == "="):
        array = array.astype(array.dtype.newbyteorder("<"))
    tensor.raw_data = array.tobytes()


def _output_encoding(node: torch.fx.Node, resolve) -> Encoding | None:
    quants = [u for u in _users(node) if _op_name(u) in QUANTIZE_OPS]
    if not quants:
        return None
    try:
        encs = [encoding_of(_op_name(u), (None, *resolve(u.args[1:])), False) for u in quants]
    except Unsupported:
        return None
    return encs[0] if all(encs[0].same_as(e) for e in encs[1:]) else None


def _rename(nodes: list[onnx.NodeProto], renames: dict[str, str]) -> None:
    if not renames:
        return
    for n in nodes:
        for i, x in enumerate(n.input):
            if x in renames:
                n.input[i] = renames[x]
        for i, x in enumerate(n.output):
            if x in renames:
                n.output[i] = renames[x]


def _array(init: Initializer | onnx.TensorProto) -> np.ndarray:
    return init.array if isinstance(init, Initializer) else numpy_helper.to_array(init)


def _qparams(node: onnx.NodeProto, inits: dict[str, Initializer | onnx.TensorProto]):
    if len(node.input) < 3 or node.input[1] not in inits or node.input[2] not in inits:
        return None
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    scale = _array(inits[node.input[1]])
    zp = _array(inits[node.input[2]])
    return scale, zp, axis


def fold_identity_requant(nodes: list[onnx.NodeProto], inits: dict[str, onnx.TensorProto],
                          protected: set[str]) -> list[onnx.NodeProto]:
    """Drop QuantizeLinear(DequantizeLinear(q)) when both use the same encoding: it returns q."""
    producer = {o: n for n in nodes for o in n.output}
    replace: dict[str, str] = {}
    kept = []
    for n in nodes:
        if n.op_type == "QuantizeLinear" and n.output[0] not in protected:
            dq = producer.get(n.input[0])
            if dq is not None and dq.op_type == "DequantizeLinear":
                a, b = _qparams(n, inits), _qparams(dq, inits)
                if a is not None and b is not None and a[2] == b[2] and a[1].dtype == b[1].dtype \
                        and np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]):
                    source = dq.input[0]
                    replace[n.output[0]] = replace.get(source, source)
                    continue
        kept.append(n)
    _rename(kept, replace)
    return kept


def _same_qparams(a: onnx.NodeProto, b: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool:
    pa, pb = _qparams(a, inits), _qparams(b, inits)
    return (pa is not None and pb is not None and pa[2] == pb[2] and pa[1].dtype == pb[1].dtype
            and np.array_equal(pa[0], pb[0]) and np.array_equal(pa[1], pb[1]))


def merge_transposes(nodes: list[onnx.NodeProto], inits: dict[str, onnx.TensorProto],
                     protected: set[str]) -> list[onnx.NodeProto]:
    """DQ(e) → Transpose → Q(e) → DQ(e) → Transpose  ⇒  DQ(e) → Transpose(composed).

    Two transposes separated only by an identity requantization are one transpose. Left
    apart, ONNX Runtime's transpose optimizer merges them across the Q/DQ pair for the QNN
    EP and leaves a float Transpose the HTP cannot run (seen on SmolLM3's NoPE layers).
    """
    producer = {o: n for n in nodes for o in n.output}
    readers: dict[str, int] = {}
    for n in nodes:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    dropped: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}

    def single(name: str) -> bool:
        return readers.get(name, 0) == 1 and name not in protected

    for t2 in nodes:
        if t2.op_type != "Transpose" or id(t2) in dropped:
            continue
        dq = producer.get(t2.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        t1 = producer.get(q.input[0]) if q is not None and q.op_type == "QuantizeLinear" else None
        src = producer.get(t1.input[0]) if t1 is not None and t1.op_type == "Transpose" else None
        if src is None or src.op_type != "DequantizeLinear" or id(t1) in dropped or id(t1) in replaced:
            continue
        if not (single(dq.output[0]) and single(q.output[0]) and single(t1.output[0])):
            continue
        if not (_same_qparams(q, dq, inits) and _same_qparams(dq, src, inits)):
            continue
        p1 = list(next(a.ints for a in t1.attribute if a.name == "perm"))
        p2 = list(next(a.ints for a in t2.attribute if a.name == "perm"))
        perm = [p1[j] for j in p2]
        replaced[id(t2)] = helper.make_node("Transpose", [t1.input[0]], [t2.output[0]], name=t2.name, perm=perm)
        dropped.update({id(t1), id(q), id(dq)})
    return [replaced.get(id(n), n) for n in nodes if id(n) not in dropped]


def share_qdq_params(nodes: list[onnx.NodeProto], inits: dict[str, Initializer | onnx.TensorProto]) -> int:
    """Point each DequantizeLinear that reads a QuantizeLinear of the same encoding (same scale
    and zero-point values and types, same axis and block_size) at that QuantizeLinear's scale and
    zero-point initializers, in place; returns how many were re-pointed.

    The values are unchanged, so every runtime computes the same outputs; the copies the DQ's
    builder made are then read by nothing and dropped by :func:`remove_dead`. AIMET's
    ``QuantizationSimModel.from_onnx_qdq`` takes a Q/DQ pair only when both name the same
    initializers (docs/design.md §11).
    """
    producer = {o: n for n in nodes for o in n.output}
    shared = 0
    for dq in nodes:
        if dq.op_type != "DequantizeLinear" or len(dq.input) < 3:
            continue
        q = producer.get(dq.input[0])
        if q is None or q.op_type != "QuantizeLinear" or len(q.input) < 3 or list(q.input[1:3]) == list(dq.input[1:3]):
            continue
        attrs = ({a.name: helper.get_attribute_value(a) for a in n.attribute} for n in (q, dq))
        if next(attrs) != next(attrs) or not _same_qparams(q, dq, inits):
            continue
        dq.input[1], dq.input[2] = q.input[1], q.input[2]
        shared += 1
    return shared


def share_model_qdq_params(model: onnx.ModelProto) -> int:
    """:func:`share_qdq_params` on an assembled model (Q/DQ pairs added after the lowering, such
    as the heads-first KV edges of ``--genai windowed``), deleting the initializers no node reads
    any more in place, so the weights are not copied."""
    g = model.graph
    shared = share_qdq_params(list(g.node), {i.name: i for i in g.initializer})
    if shared:  # by index, from the end: remove() would compare messages, weights included
        read = {x for n in g.node for x in n.input} | {o.name for o in g.output}
        for i in reversed([i for i, init in enumerate(g.initializer) if init.name not in read]):
            del g.initializer[i]
    return shared


def narrow_index_inputs(nodes: list[onnx.NodeProto], inputs: list[IOSpec], notes: list[Note]) -> list[IOSpec]:
    """Carry int64 graph inputs that only index Gathers (the tokens) as int32.

    The QNN HTP (2.51, emulated) returns a wrong row for the last index of a table when the
    indices are int64 and right ones for int32; token ids fit int32 on any vocabulary.
    """
    out = []
    for spec in inputs:
        if spec.dtype == "int64":
            uses = [(n, i) for n in nodes for i, x in enumerate(n.input) if x == spec.name]
            if uses and all(n.op_type == "Gather" and i == 1 for n, i in uses):
                spec = IOSpec(spec.name, spec.shape, "int32", spec.encoding)
                notes.append(Note("index_input", spec.name, {"dtype": "int32", "reason": "int64 Gather indices "
                                  "read the last table row wrongly on the QNN HTP"}))
        out.append(spec)
    return out


def remove_dead(nodes: list[onnx.NodeProto], outputs: Sequence[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """Keep only nodes that contribute to ``outputs``; also returns every name they read."""
    needed = set(outputs)
    live = []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            live.append(n)
            needed.update(x for x in n.input if x)
    live.reverse()
    return live, needed


def log_notes_once(notes: Iterable[Note]) -> None:
    seen = set()
    for note in notes:
        if note.warn and note.warn not in seen:
            seen.add(note.warn)
            log.warning(note.warn)
