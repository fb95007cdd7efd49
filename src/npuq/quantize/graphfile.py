"""Static programs on disk without pickle: each graph as JSON, their tensors once in safetensors.

    PROGRAM.json   {"format": GRAPH_FORMAT, "weights": "weights.safetensors",
                    "tensors": {get_attr target: {"key": k, "dtype": d}},
                    "stacks": [[[key, module path, module type], ...], ...],
                    "nodes": [{"op", "name", "target", "args", "kwargs", "val", "stack"}, ...]}
    weights.safetensors   every tensor the programs read, each stored once (decode and prefill
                          read the same converted weights)

A graph is a list of FX nodes in order: ``placeholder`` (the inputs), ``get_attr`` (a tensor of
the weights file), ``call_function`` and one ``output``. An op is named ``namespace::name.overload``
and only ops of the ``aten``, ``quantized_decomposed`` and ``torchao`` libraries (and
``operator.getitem``) are accepted; arguments are numbers, strings, None, lists and tagged
values (a node, a tuple, a dtype, a device, a memory format, a layout, a non-finite float).
``val`` is the node's static shape and dtype, so a reader (the lowering) knows every tensor's
type without running anything; ``stack`` indexes the modules the node was traced in (its
``nn_module_stack``, which the per-layer error report reads).

Reading trusts nothing in the files: the JSON is checked node by node (known fields and types,
names that are identifiers, arguments that refer to earlier nodes, ops from the libraries above
resolved by name, never imported or evaluated), and tensors come from safetensors, which holds
raw bytes. Nothing is unpickled and no code from the files runs. The Python FX generates for
the graph is made of those checked names and ops only.

Integer tensors whose values fit 0..65535 (the int32 containers of 16-bit codes, docs/design.md
§1) are stored as uint16 and widened back on reading, which is exact and halves them.
"""

from __future__ import annotations

import json
import math
import operator
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.fx import Graph, GraphModule, Node

from npuq.errors import NpuqError
from npuq.fsio import read_json, resolve_inside

GRAPH_FORMAT = "npuq-graph/1"
WEIGHTS_FILE = "weights.safetensors"
OP_LIBRARIES = ("aten", "quantized_decomposed", "torchao")
PY_FUNCTIONS = {"operator.getitem": operator.getitem}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_TARGET = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*\Z")
_OP = re.compile(r"([a-z_][a-z0-9_]*)::([a-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\Z")
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.uint16, torch.bool)}
_MEMORY_FORMATS = {str(m).removeprefix("torch."): m for m in (
    torch.contiguous_format, torch.preserve_format, torch.channels_last, torch.channels_last_3d)}
_LAYOUTS = {"strided": torch.strided}
MAX_NODES = 2_000_000
NARROWED = "npuq_narrowed"  # GraphModule.meta key: the get_attr targets of int32 tensors left uint16 (narrow=True)
MAX_DIMS = 16


class GraphFileError(NpuqError):
    """A program file that is not one this npuq wrote."""


# --------------------------------------------------------------------------- writing
def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverloadPacket) and target.overloads() == ["default"]:
        target = target.default  # what a packet with one overload runs (LPBQ's quantize_affine)
    if isinstance(target, torch._ops.OpOverload) and target.namespace in OP_LIBRARIES:
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    for name, fn in PY_FUNCTIONS.items():
        if target is fn:
            return name
    raise TypeError(f"cannot store op {target!r}: not an op of {', '.join(OP_LIBRARIES)}")


def _encode(arg: Any) -> Any:
    if isinstance(arg, Node):
        return {"node": arg.name}
    if arg is None or isinstance(arg, (bool, str, int)):
        return arg
    if isinstance(arg, float):
        return arg if math.isfinite(arg) else {"float": repr(arg)}
    if isinstance(arg, list):
        return [_encode(a) for a in arg]
    if isinstance(arg, tuple):
        return {"tuple": [_encode(a) for a in arg]}
    if isinstance(arg, torch.dtype):
        return {"dtype": str(arg).removeprefix("torch.")}
    if isinstance(arg, torch.device):
        return {"device": str(arg)}
    if isinstance(arg, torch.memory_format):
        return {"memory_format": str(arg).removeprefix("torch.")}
    if isinstance(arg, torch.layout):
        return {"layout": str(arg).removeprefix("torch.")}
    raise TypeError(f"cannot store argument {arg!r} of type {type(arg).__name__}")


def _attr(gm: torch.nn.Module, target: str) -> Any:
    obj = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _val(node: Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and all(isinstance(d, int) for d in val.shape):
        return [list(val.shape), str(val.dtype).removeprefix("torch.")]
    return None


def _stack(node: Node) -> tuple | None:
    """A node's ``nn_module_stack`` (the modules it was traced in) as (key, path, type name) triples."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    out = []
    for key, (path, kind) in stack.items():
        name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
        out.append((str(key), str(path), name))
    return tuple(out)


def graph_json(gm: GraphModule, tensors: dict[str, dict[str, str]], weights: str = WEIGHTS_FILE) -> dict[str, Any]:
    """The JSON of a static program whose get_attr targets are keys of ``tensors``."""
    nodes: list[dict[str, Any]] = []
    stacks: dict[tuple, int] = {}
    for node in gm.graph.nodes:
        entry: dict[str, Any] = {"op": node.op, "name": node.name}
        if node.op == "get_attr":
            entry["target"] = node.target
        elif node.op == "call_function":
            entry.update(target=_op_name(node.target), args=_encode(list(node.args)),
                         kwargs={k: _encode(v) for k, v in node.kwargs.items()})
        elif node.op == "output":
            entry["args"] = _encode(list(node.args))
        elif node.op != "placeholder":
            raise TypeError(f"cannot store {node.op} node {node.name}: a program holds only inputs, tensors and ops")
        val = _val(node)
        if val is not None:
            entry["val"] = val
        stack = _stack(node)
        if stack is not None:
            entry["stack"] = stacks.setdefault(stack, len(stacks))
        nodes.append(entry)
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    return {"format": GRAPH_FORMAT, "weights": weights, "tensors": {t: tensors[t] for t in sorted(used)},
            "stacks": [[list(t) for t in stack] for stack in stacks], "nodes": nodes}


def collect_tensors(programs: list[GraphModule]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    """(what to write in the weights file, get_attr target → {"key", "dtype"}) for ``programs``:
    each tensor once however many programs or targets read it; int32 tensors within 0..65535
    stored as uint16."""
    stored: dict[str, torch.Tensor] = {}
    table: dict[str, dict[str, str]] = {}
    by_tensor: dict[int, str] = {}
    storages: set[int] = set()
    for gm in programs:
        for node in gm.graph.nodes:
            if node.op != "get_attr" or node.target in table:
                continue
            t = _attr(gm, node.target)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"get_attr {node.target} is a {type(t).__name__}, not a tensor")
            key = by_tensor.get(id(t))
            if key is None:
                key = node.target
                data = t.detach().cpu().contiguous()
                if data.dtype == torch.int32 and data.numel() and 0 <= int(data.min()) and int(data.max()) <= 65535:
                    data = data.to(torch.uint16)
                if data.untyped_storage().data_ptr() in storages or data.untyped_storage().nbytes() != data.nbytes:
                    data = data.clone()  # safetensors stores whole, unshared buffers
                storages.add(data.untyped_storage().data_ptr())
                stored[key] = data
                by_tensor[id(t)] = key
            table[node.target] = {"key": key, "dtype": str(t.dtype).removeprefix("torch.")}
    return stored, table


def write_programs(programs: dict[str, GraphModule], folder: Path, files: dict[str, str],
                   weights: str = WEIGHTS_FILE) -> int:
    """Write each program of ``programs`` (kind → static GraphModule) to ``folder / files[kind]``
    and their tensors once to ``folder / weights``; returns the bytes of tensor data written."""
    stored, table = collect_tensors(list(programs.values()))
    save_file(stored, str(folder / weights), metadata={"format": GRAPH_FORMAT})
    for kind, gm in programs.items():
        text = json.dumps(graph_json(gm, table, weights), separators=(",", ":"))
        (folder / files[kind]).write_text(text + "\n", encoding="utf-8")
    return sum(t.nbytes for t in stored.values())


def tensor_bytes(programs: list[GraphModule]) -> int:
    """Bytes the weights file of ``programs`` takes (before the uint16 narrowing): each distinct
    storage once."""
    sizes: dict[int, int] = {}
    for gm in programs:
        for t in list(gm.parameters()) + list(gm.buffers()):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(sizes.values())


# --------------------------------------------------------------------------- reading
def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file (safetensors: raw bytes, nothing to unpickle)."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
        raise GraphFileError(f"{path}: not a readable weights file ({type(exc).__name__}: {exc}); quantize again") from None


def _resolve_op(name: Any, where: str) -> Any:
    if not isinstance(name, str):
        raise GraphFileError(f"{where}: op {name!r:.60} is not a name")
    if name in PY_FUNCTIONS:
        return PY_FUNCTIONS[name]
    match = _OP.match(name)
    if match is None or match.group(1) not in OP_LIBRARIES or "__" in name:
        raise GraphFileError(f"{where}: op {name!r:.80} is not an op of {', '.join(OP_LIBRARIES)}")
    library, op, overload = match.groups()
    _register_quantized_ops()
    try:
        target = getattr(getattr(getattr(torch.ops, library), op), overload)
    except (AttributeError, RuntimeError):
        target = None
    if not isinstance(target, torch._ops.OpOverload):
        raise GraphFileError(f"{where}: unknown op {name!r:.80} (another torch/torchao version?)")
    return target


def _register_quantized_ops() -> None:
    import torchao.quantization.pt2e  # noqa: F401  (registers the quantized_decomposed ops)
    import torchao.quantization.quant_primitives  # noqa: F401  (the torchao affine ops)


class _Decoder:
    def __init__(self, where: str):
        self.where = where
        self.env: dict[str, Node] = {}

    def __call__(self, arg: Any, depth: int = 0) -> Any:
        if depth > 32:
            raise GraphFileError(f"{self.where}: arguments nested too deeply")
        if arg is None or isinstance(arg, (bool, str, int)):
            return arg
        if isinstance(arg, float):
            return arg
        if isinstance(arg, list):
            return [self(a, depth + 1) for a in arg]
        if isinstance(arg, dict) and len(arg) == 1:
            (tag, value), = arg.items()
            if tag == "node" and isinstance(value, str) and value in self.env:
                return self.env[value]
            if tag == "tuple" and isinstance(value, list):
                return tuple(self(a, depth + 1) for a in value)
            if tag == "float" and value in ("inf", "-inf", "nan"):
                return float(value)
            if tag == "dtype" and value in _DTYPES:
                return _DTYPES[value]
            if tag == "memory_format" and value in _MEMORY_FORMATS:
                return _MEMORY_FORMATS[value]
            if tag == "layout" and value in _LAYOUTS:
                return _LAYOUTS[value]
            if tag == "device" and isinstance(value, str) and re.fullmatch(r"[a-z]+(:\d+)?", value):
                return torch.device(value)
        raise GraphFileError(f"{self.where}: argument {arg!r:.80} is not one npuq writes (a node defined later?)")


def _meta_val(val: Any, where: str) -> torch.Tensor:
    if (not isinstance(val, list) or len(val) != 2 or not isinstance(val[0], list) or len(val[0]) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**40 for d in val[0])
            or val[1] not in _DTYPES):
        raise GraphFileError(f"{where}: val {val!r:.80} is not [shape, dtype]")
    return torch.empty(val[0], dtype=_DTYPES[val[1]], device="meta")


def build_program(data: Any, tensors: dict[str, torch.Tensor], where: str, *, narrow: bool = False) -> GraphModule:
    """The GraphModule of a program's JSON (already parsed) over ``tensors`` (a weights file's
    content, shared by every program built from it: tensors stored narrow are widened in the
    dict itself, once)."""
    again = "quantize again"
    if not isinstance(data, dict) or data.get("format") != GRAPH_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise GraphFileError(f"{where}: format {found!r:.60} is not {GRAPH_FORMAT!r}; {again}")
    nodes, table = data.get("nodes"), data.get("tensors")
    if not isinstance(nodes, list) or not isinstance(table, dict) or not 0 < len(nodes) <= MAX_NODES:
        raise GraphFileError(f"{where}: 'nodes' and 'tensors' must be a list and an object; {again}")
    root = torch.nn.Module()
    narrowed: set[str] = set()
    for target, entry in table.items():
        if not isinstance(target, str) or not _TARGET.match(target) or not isinstance(entry, dict):
            raise GraphFileError(f"{where}: tensor entry {target!r:.60} is not a dotted name with a key; {again}")
        key, dtype = entry.get("key"), entry.get("dtype")
        if key not in tensors or dtype not in _DTYPES:
            raise GraphFileError(f"{where}: tensor {target} names {key!r:.60} ({dtype!r:.20}), which the weights file "
                                 f"does not hold; {again}")
        t = tensors[key]
        if t.dtype != _DTYPES[dtype]:
            if not (t.dtype == torch.uint16 and dtype == "int32"):
                raise GraphFileError(f"{where}: tensor {target} is stored as {t.dtype}, not {dtype}; {again}")
            if narrow:
                narrowed.add(target)
            else:
                t = tensors[key] = t.to(torch.int32)  # widened once: later programs share it
        owner = root
        *path, attr = target.split(".")
        for atom in path:
            if not hasattr(owner, atom):
                owner.add_module(atom, torch.nn.Module())
            owner = getattr(owner, atom)
            if not isinstance(owner, torch.nn.Module):
                raise GraphFileError(f"{where}: tensor {target} lies under another tensor; {again}")
        if hasattr(owner, attr):
            raise GraphFileError(f"{where}: tensor {target} is named twice; {again}")
        owner.register_buffer(attr, t)

    stacks = data.get("stacks", [])
    if not isinstance(stacks, list) or not all(
            isinstance(st, list) and all(isinstance(t, list) and len(t) == 3 and all(isinstance(x, str) for x in t)
                                         for t in st) for st in stacks):
        raise GraphFileError(f"{where}: 'stacks' is not a list of [key, path, type] lists; {again}")
    module_stacks = [{key: (path, kind) for key, path, kind in st} for st in stacks]

    graph = Graph()
    decode = _Decoder(where)
    outputs = 0
    for i, spec in enumerate(nodes):
        here = f"{where}, node {i}"
        if not isinstance(spec, dict):
            raise GraphFileError(f"{here} is not an object; {again}")
        op, name = spec.get("op"), spec.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or name in decode.env:
            raise GraphFileError(f"{here}: name {name!r:.60} is not a new identifier; {again}")
        if outputs:
            raise GraphFileError(f"{here}: nodes after the output; {again}")
        if op == "placeholder":
            node = graph.create_node("placeholder", name, name=name)
        elif op == "get_attr":
            target = spec.get("target")
            if target not in table:
                raise GraphFileError(f"{here}: get_attr {target!r:.60} is not in 'tensors'; {again}")
            node = graph.create_node("get_attr", target, name=name)
        elif op == "call_function":
            args, kwargs = spec.get("args"), spec.get("kwargs")
            if not isinstance(args, list) or not isinstance(kwargs, dict) or not all(_NAME.match(str(k)) for k in kwargs):
                raise GraphFileError(f"{here}: args/kwargs are not a list and an object of names; {again}")
            target = _resolve_op(spec.get("target"), here)
            node = graph.create_node("call_function", target, tuple(decode(args)),
                                     {k: decode(v) for k, v in kwargs.items()}, name=name)
        elif op == "output":
            args = spec.get("args")
            if not isinstance(args, list) or len(args) != 1:
                raise GraphFileError(f"{here}: the output's args are not [outputs]; {again}")
            node = graph.output(decode(args[0]))
            outputs += 1
        else:
            raise GraphFileError(f"{here}: op kind {op!r:.40} is not placeholder, get_attr, call_function or output; "
                                 f"{again}")
        if node.name != name and op != "output":
            raise GraphFileError(f"{here}: name {name!r:.60} is reserved; {again}")
        if "val" in spec:
            node.meta["val"] = _meta_val(spec["val"], here)
        if "stack" in spec:
            index = spec["stack"]
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(module_stacks):
                raise GraphFileError(f"{here}: stack {index!r:.20} is not an index into 'stacks'; {again}")
            node.meta["nn_module_stack"] = dict(module_stacks[index])
        decode.env[name] = node
    if outputs != 1:
        raise GraphFileError(f"{where}: the graph has no output; {again}")
    try:
        gm = GraphModule(root, graph)
    except Exception as exc:  # FX refuses a graph it cannot generate code for
        raise GraphFileError(f"{where}: not a valid program ({type(exc).__name__}: {exc}); {again}") from None
    if narrowed:
        gm.meta[NARROWED] = frozenset(narrowed)
    return gm


def read_program(path: Path, tensors: dict[str, torch.Tensor] | None = None, *, narrow: bool = False) -> GraphModule:
    """The program in ``path``, over ``tensors`` (the content of its weights file; read from the
    file the program names, inside the same folder, when None). ``narrow``: int32 tensors stored
    as uint16 stay uint16 (half the memory, and no copy of the file's bytes), for a reader that
    only looks at the values, such as the lowering (:func:`npuq.lower.onnx_writer.lower_program`
    widens what needs it); the program must then not be run."""
    path = Path(path)
    data = read_json(path, f"program {path}", "quantize again")
    if tensors is None:
        if not isinstance(data, dict) or not isinstance(data.get("weights"), str):
            raise GraphFileError(f"{path}: no weights file named; quantize again")
        tensors = read_weights(resolve_inside(path.parent, data["weights"], f"{path}, weights"))
    return build_program(data, tensors, str(path), narrow=narrow)
