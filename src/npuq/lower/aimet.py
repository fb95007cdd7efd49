"""The encodings of an exported graph in AIMET's encoding format 1.0.0 (docs/design.md §10, §11).

Read from the written QDQ graph itself, so every name is a tensor of the ONNX file and every
number is the one its QuantizeLinear / DequantizeLinear initializers hold:

- activation encodings: the float input of each QuantizeLinear (the tensor being quantized),
  a quantized graph input (the codes a DequantizeLinear reads) and a quantized graph output
  (the codes a QuantizeLinear writes), and codes made by a data-movement op (a Gather of codes);
- param encodings: the float output of each DequantizeLinear of a constant (the weight as its
  consumer reads it); a block-quantized weight whose block scales are themselves
  DequantizeLinear(k, base) is one LPBQ entry.

Offsets follow QNN's sign (offset = -zero point) in the unsigned domain of ``bw`` bits, as
format 1.0.0 stores them: a signed symmetric int8 weight has offset -128 (docs/design.md §11).

Two views of the same entries (docs/design.md §11):

- :func:`export_encodings` / :func:`merge_encodings`: every Q/DQ encoding of all graphs of an
  export (``encodings.json``), named by the tensors of the ONNX files;
- :func:`loadable_encodings`: one graph's entries as AIMET names and holds them once its QDQ
  importer (``QuantizationSimModel.from_onnx_qdq``) has taken the Q/DQ nodes out
  (``decode.encodings.json``, ``prefill.encodings.json``), so ``load_encodings_to_sim``
  accepts the file on the sim of that graph. :func:`aimet_import_graph` is that graph as the
  importer takes it: quantized graph inputs and outputs made float at the edge.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from npuq.errors import NpuqError

FORMAT_VERSION = "1.0.0"
# Bits of an LPBQ block multiplier k (1..2^bits) as AIMET and QNN express it (docs/design.md §1, §11).
LPBQ_SCALE_BITS = 4
# ONNX storage type → (bits, signed).
_TYPES = {
    TensorProto.INT4: (4, True), TensorProto.UINT4: (4, False), TensorProto.INT8: (8, True),
    TensorProto.UINT8: (8, False), TensorProto.INT16: (16, True), TensorProto.UINT16: (16, False),
    TensorProto.INT32: (32, True), TensorProto.UINT32: (32, False),
}


def _attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


class _Graph:
    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.nodes = list(g.node)
        self.inits = {i.name: i for i in g.initializer}  # protos: only qparams are ever converted
        self.producer = {o: n for n in self.nodes for o in n.output}
        self.inputs = {i.name for i in g.input}
        self.outputs = {o.name for o in g.output}
        self.name = g.name

    def array(self, name: str, what: str) -> np.ndarray:
        if name not in self.inits:
            raise NpuqError(f"graph {self.name}: the {what} {name!r} is not a constant; export the artifact again")
        return numpy_helper.to_array(self.inits[name])


def _affine(name: str, scale: np.ndarray, zero_point: np.ndarray, onnx_type: int,
            block_size: int | None) -> dict[str, Any]:
    """One 1.0.0 entry of an integer encoding (scale and zero point as the QDQ node holds them)."""
    if onnx_type not in _TYPES:
        raise NpuqError(f"{name}: quantized type {onnx_type} has no AIMET encoding; export the artifact again")
    bits, signed = _TYPES[onnx_type]
    zp = zero_point.astype(np.int64)
    offset = -(zp + (2 ** (bits - 1) if signed else 0))  # unsigned-domain offset: -(zp - type's lowest)
    entry: dict[str, Any] = {
        "name": name,
        "dtype": "INT",
        "enc_type": "PER_TENSOR" if scale.ndim == 0 else ("PER_BLOCK" if block_size else "PER_CHANNEL"),
        "bw": bits,
        "is_sym": bool(signed and np.all(zp == 0)),
        "scale": scale.astype(np.float64).ravel().tolist(),  # float32 values, exact as doubles
        "offset": offset.ravel().tolist(),
    }
    if block_size:
        entry["block_size"] = int(block_size)
    return entry


def _lpbq(name: str, g: _Graph, node: onnx.NodeProto, scales: onnx.NodeProto) -> dict[str, Any]:
    """The LPBQ entry of DequantizeLinear(codes, DequantizeLinear(k, base), zp, block_size)
    (src/npuq/lower/builders/linear.py writes it). ``scale`` is the per-channel base,
    ``per_block_int_scale`` the multipliers k flattened row-major in AIMET 1.0.0's order
    (output channels, blocks): a MatMul weight (I, O) has k laid (blocks, O) with its channel
    axis 1, which AIMET's 1.0.0 writer transposes and its reader transposes back, so it is
    written transposed here too; k of a weight laid (O, I) (channel axis 0) is already in that
    order. ``compressed_bw`` the bits of the weight codes and ``bw`` = compressed_bw + the
    multipliers' bits, the "decompressed" width whose symmetric offset is -2^(bw-1)
    (docs/design.md §11)."""
    codes_type = g.inits[node.input[0]].data_type
    if codes_type not in _TYPES or not _TYPES[codes_type][1]:
        raise NpuqError(f"{name}: LPBQ codes of type {codes_type} are not a signed integer type; export again")
    compressed = _TYPES[codes_type][0]
    k = g.array(scales.input[0], "block multipliers").astype(np.int64)
    base = g.array(scales.input[1], "base scale").astype(np.float64)
    zp = g.array(node.input[2], "zero point") if len(node.input) > 2 and node.input[2] else np.zeros(1)
    if np.any(zp != 0) or k.min() < 1:
        raise NpuqError(f"{name}: an LPBQ weight needs zero points 0 and multipliers of at least 1; export again")
    # The fewest bits holding every k (k ≤ 2^bits), widened to the 4 bits QNN's LPBQ uses:
    # k · 2^d with base / 2^d is the same scale exactly (a power of two).
    least = max(0, math.ceil(math.log2(int(k.max()))))
    bits = max(least, LPBQ_SCALE_BITS)
    k, base = k << (bits - least), base / float(2 ** (bits - least))
    if k.ndim == 2 and _attr(scales, "axis", 1) in (1, -1):  # (blocks, O) → AIMET's (O, blocks)
        k = k.T
    bw = compressed + bits
    return {
        "name": name,
        "dtype": "INT",
        "enc_type": "LPBQ",
        "bw": bw,
        "compressed_bw": compressed,
        "block_size": int(_attr(node, "block_size")),
        "is_sym": True,
        "scale": base.astype(np.float32).astype(np.float64).ravel().tolist(),
        "offset": [-(2 ** (bw - 1))] * base.size,
        "per_block_int_scale": k.ravel().tolist(),
    }


def graph_encodings(model: onnx.ModelProto) -> tuple[dict[str, dict], dict[str, dict]]:
    """(activation entries, param entries) of one QDQ graph, each by tensor name."""
    g = _Graph(model)
    acts: dict[str, dict] = {}
    params: dict[str, dict] = {}
    block_scales = {n.input[1] for n in g.nodes if n.op_type == "DequantizeLinear"
                    and n.input[1] in g.producer and g.producer[n.input[1]].op_type == "DequantizeLinear"}

    def add(table: dict[str, dict], entry: dict[str, Any]) -> None:
        old = table.setdefault(entry["name"], entry)
        if old != entry:
            raise NpuqError(f"graph {g.name}: tensor {entry['name']!r} is quantized with two encodings; "
                            "AIMET's format holds one per tensor (export the artifact again)")

    def qparams(node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray, int]:
        if len(node.input) < 3 or not node.input[2]:
            raise NpuqError(f"graph {g.name}: {node.name} has no zero point; export the artifact again")
        zp = g.inits.get(node.input[2])
        if zp is None:
            raise NpuqError(f"graph {g.name}: the zero point of {node.name} is not a constant; export again")
        return g.array(node.input[1], "scale"), numpy_helper.to_array(zp), zp.data_type

    for node in g.nodes:
        block = _attr(node, "block_size") or None
        if node.op_type == "QuantizeLinear":
            scale, zp, t = qparams(node)
            add(acts, _affine(node.input[0], scale, zp, t, block))
            if node.output[0] in g.outputs:  # quantized graph output: the codes themselves
                add(acts, _affine(node.output[0], scale, zp, t, block))
        elif node.op_type == "DequantizeLinear":
            src, out = node.input[0], node.output[0]
            if out in block_scales:
                continue  # an LPBQ weight's block scales: part of that weight's entry
            if src in g.inits:
                scales = g.producer.get(node.input[1])
                if scales is not None and scales.op_type == "DequantizeLinear":
                    add(params, _lpbq(out, g, node, scales))
                else:
                    scale, zp, t = qparams(node)
                    add(params, _affine(out, scale, zp, t, block))
            elif src in g.producer and g.producer[src].op_type == "QuantizeLinear":
                continue  # the QuantizeLinear's entry (same initializers) names its float input
            else:  # quantized graph input, or codes moved by a data-movement op (Gather of codes)
                scale, zp, t = qparams(node)
                add(acts, _affine(src, scale, zp, t, block))
    return acts, params


def export_encodings(models: dict[str, onnx.ModelProto]) -> dict[str, Any]:
    """One AIMET 1.0.0 document for all graphs of an export (:func:`merge_encodings`)."""
    return merge_encodings({kind: graph_encodings(model) for kind, model in models.items()})


def merge_encodings(graphs: dict[str, tuple[dict[str, dict], dict[str, dict]]]) -> dict[str, Any]:
    """The document of several graphs' entries (:func:`graph_encodings`): decode and prefill
    share tensor names and must agree on every tensor they share (refused otherwise)."""
    acts: dict[str, tuple[str, dict]] = {}
    params: dict[str, tuple[str, dict]] = {}
    for kind, (a, p) in graphs.items():
        for table, found in ((acts, a), (params, p)):
            for name, entry in found.items():
                seen = table.setdefault(name, (kind, entry))
                if seen[1] != entry:
                    raise NpuqError(f"tensor {name!r} has different encodings in the {seen[0]} and {kind} graphs; "
                                    "they must share encodings: quantize again")
    clash = sorted(set(acts) & set(params))
    if clash:
        raise NpuqError(f"tensor {clash[0]!r} is both an activation and a parameter; export the artifact again")
    return {
        "version": FORMAT_VERSION,
        "activation_encodings": [acts[k][1] for k in sorted(acts)],
        "param_encodings": [params[k][1] for k in sorted(params)],
    }


# Constant inputs AIMET's sim quantizes as parameters, by op and input index (its ConnectedGraph's
# parameter table: weight 1, bias 2; a MatMul's weight may come through a Transpose). Any other
# constant (a norm's gamma in SimplifiedLayerNormalization, a Mul scalar, a Gather table) is
# folded by the importer into a float initializer without a quantizer, and AIMET's loader
# refuses an encoding for it (docs/design.md §11).
_PARAM_INPUTS = {"MatMul": (1,), "Gemm": (1, 2), "Conv": (1, 2), "ConvTranspose": (1, 2),
                 "LayerNormalization": (1, 2), "InstanceNormalization": (1, 2), "GroupNormalization": (1, 2),
                 "RMSNormalization": (1,), "BatchNormalization": (1, 2, 3, 4)}


class _FloatView:
    """One QDQ graph as AIMET sees it once its importer has taken each Q/DQ pair out: a pair's
    float input and the float output of its DequantizeLinear are one tensor."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.g = _Graph(model)
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for n in self.g.nodes:
            for i, x in enumerate(n.input):
                self.readers.setdefault(x, []).append((n, i))

    def pair_dq(self, name: str) -> bool:
        """Whether ``name`` is the output of a DequantizeLinear reading a QuantizeLinear."""
        node = self.g.producer.get(name)
        if node is None or node.op_type != "DequantizeLinear":
            return False
        src = self.g.producer.get(node.input[0])
        return src is not None and src.op_type == "QuantizeLinear"

    def uses(self, name: str) -> list[tuple[onnx.NodeProto, int]]:
        """The (node, input index) pairs reading ``name``'s value, through Q/DQ pairs."""
        found = []
        for node, i in self.readers.get(name, []):
            if node.op_type == "QuantizeLinear" and i == 0:
                for dq, j in self.readers.get(node.output[0], []):
                    if dq.op_type == "DequantizeLinear" and j == 0:
                        found.extend(self.uses(dq.output[0]))
            else:
                found.append((node, i))
        return found

    def source(self, name: str) -> str:
        """The tensor ``name`` is once Q/DQ pairs are gone (a pair's output is its input)."""
        while self.pair_dq(name):
            name = self.g.producer[self.g.producer[name].input[0]].input[0]
        return name

    def is_constant(self, name: str) -> bool:
        node = self.g.producer.get(name)
        return name in self.g.inits or (node is not None and node.op_type == "DequantizeLinear"
                                         and node.input[0] in self.g.inits)

    def rank(self, name: str) -> int:
        node = self.g.producer.get(name)
        src = node.input[0] if node is not None and node.op_type == "DequantizeLinear" else name
        return len(self.g.inits[src].dims) if src in self.g.inits else -1

    def weighted_matmul(self, node: onnx.NodeProto) -> bool:
        if node.op_type != "MatMul" or len(node.input) < 2:
            return False
        w = self.g.producer.get(node.input[1])
        return self.is_constant(node.input[1]) or (w is not None and w.op_type == "Transpose"
                                                   and self.is_constant(w.input[0]))

    def fused_bias(self, add: onnx.NodeProto, index: int) -> bool:
        """Input ``index`` of ``add`` is the bias AIMET fuses into the MatMul before it: a rank-1
        constant added to the output of a MatMul with a constant weight, that Add its only reader."""
        if add.op_type != "Add" or len(add.input) != 2 or self.rank(add.input[index]) != 1:
            return False
        other = self.source(add.input[1 - index])
        mm = self.g.producer.get(other)
        return mm is not None and self.weighted_matmul(mm) and [n for n, _ in self.uses(other)] == [add]

    def is_param(self, name: str) -> bool:
        for node, i in self.uses(name):
            if i in _PARAM_INPUTS.get(node.op_type, ()) or self.fused_bias(node, i):
                return True
            if node.op_type == "Transpose" and any(c.op_type in ("MatMul", "Gemm") and j == 1
                                                   for c, j in self.uses(node.output[0])):
                return True
        return False


def loadable_encodings(model: onnx.ModelProto, entries: tuple[dict[str, dict], dict[str, dict]] | None = None
                       ) -> dict[str, Any]:
    """One graph's AIMET 1.0.0 document as AIMET's own QDQ importer names and holds the tensors
    (``from_onnx_qdq`` of :func:`aimet_import_graph`), so ``load_encodings_to_sim`` takes it on
    that graph's sim. ``entries``: :func:`graph_encodings` of ``model`` when already read.

    From the graph's entries (docs/design.md §11):

    - a requantized tensor (the float output of a Q/DQ pair read by another QuantizeLinear) is
      one tensor with the pair's input in AIMET's sim: only the first encoding is kept;
    - a pair whose output is a graph output (the codes of a KV output, or the float logits) is
      named by that output, as AIMET names it: the tensor it quantizes is left out or renamed;
    - the output of a MatMul whose only reader adds a rank-1 constant is inside AIMET's fused
      MatMul + bias op, which has no quantizer there: left out;
    - only constants AIMET quantizes as parameters (weights, fused biases) stay in
      ``param_encodings``; other constants' encodings stay in the ONNX graph and encodings.json.
    """
    view = _FloatView(model)
    g = view.g
    acts, params = entries if entries is not None else graph_encodings(model)
    kept: dict[str, dict] = {}
    for name, entry in acts.items():
        if view.pair_dq(name):
            continue  # requantized: AIMET's tensor is the first pair's input
        node = g.producer.get(name)
        if node is not None and view.weighted_matmul(node):
            readers = [n for n, _ in view.uses(name)]
            if len(readers) == 1 and any(view.fused_bias(readers[0], i) for i in range(len(readers[0].input))):
                continue
        renamed = name
        for q, i in view.readers.get(name, []):
            if q.op_type != "QuantizeLinear" or i != 0:
                continue
            if q.output[0] in g.outputs:
                renamed = None  # the quantized output's own entry names it
            for dq, j in view.readers.get(q.output[0], []):
                if dq.op_type == "DequantizeLinear" and j == 0 and dq.output[0] in g.outputs:
                    renamed = dq.output[0]
        if renamed is not None:
            kept[renamed] = {**entry, "name": renamed}
    loaded = {name: entry for name, entry in params.items() if view.is_param(name)}
    return {
        "version": FORMAT_VERSION,
        "activation_encodings": [kept[k] for k in sorted(kept)],
        "param_encodings": [loaded[k] for k in sorted(loaded)],
    }


def aimet_import_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` that AIMET's ``QuantizationSimModel.from_onnx_qdq`` imports.

    The importer takes a DequantizeLinear only after a QuantizeLinear or on constants, and
    drops a pair together with the name of a graph output that a QuantizeLinear writes, so a
    graph whose inputs and outputs are quantized codes (the KV caches, docs/design.md §2)
    cannot be imported as it is. Here each quantized input becomes a float input of the same
    name and shape read by a QuantizeLinear with its DequantizeLinear's scale and zero point
    (initializers shared by name), and each quantized output is the float output of one
    DequantizeLinear of its codes (the identical DequantizeLinear readers of those codes
    merged into it). Every other node and initializer is the graph's own, so the sim computes
    what the graph computes from the dequantized I/O (docs/design.md §11).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    added: list[onnx.NodeProto] = []
    dropped: set[str] = set()
    renames: dict[str, str] = {}
    taken = {n.name for n in g.node} | {t for n in g.node for t in n.output} | {i.name for i in g.initializer}

    def fresh(name: str) -> str:
        """A node / tensor name the graph does not use yet (AIMET keys its Q/DQ nodes by name)."""
        while name in taken:
            name += "_"
        taken.add(name)
        return name
    for value in g.input:
        if value.type.tensor_type.elem_type not in _TYPES:
            continue
        users = readers.get(value.name, [])
        if not any(u.op_type == "DequantizeLinear" for u in users):
            continue  # an integer input that holds no codes (token ids)
        if any(u.op_type != "DequantizeLinear" or list(u.input).index(value.name) != 0 for u in users):
            raise NpuqError(f"graph {g.name}: quantized input {value.name!r} is read by something else than a "
                            "DequantizeLinear; AIMET cannot import it (export the artifact again)")
        first = users[0]
        codes = fresh(f"{value.name}/codes")
        for u in users:
            if _attr(u, "axis", 1) != _attr(first, "axis", 1) or not _same_values(g, u, first):
                raise NpuqError(f"graph {g.name}: input {value.name!r} is dequantized with two encodings")
            u.input[0], u.input[1], u.input[2] = codes, first.input[1], first.input[2]
        q = onnx.helper.make_node("QuantizeLinear", [value.name, first.input[1], first.input[2]], [codes], name=codes)
        q.attribute.extend(first.attribute)
        added.append(q)
        value.type.tensor_type.elem_type = TensorProto.FLOAT
    for value in g.output:
        q = producer.get(value.name)
        if value.type.tensor_type.elem_type not in _TYPES or q is None or q.op_type != "QuantizeLinear":
            continue
        codes = fresh(f"{value.name}/codes")
        q.output[0] = codes
        users = readers.get(value.name, [])
        if any(u.op_type != "DequantizeLinear" or list(u.input[1:3]) != list(q.input[1:3]) for u in users):
            raise NpuqError(f"graph {g.name}: quantized output {value.name!r} is read inside the graph by something "
                            "else than its own DequantizeLinear; AIMET cannot import it (export the artifact again)")
        for u in users[1:]:
            dropped.add(u.name)
            renames[u.output[0]] = value.name
        if users:
            renames[users[0].output[0]] = value.name
            users[0].input[0] = codes
            users[0].output[0] = value.name
        else:
            added.append(onnx.helper.make_node("DequantizeLinear", [codes, q.input[1], q.input[2]], [value.name],
                                               name=fresh(f"{value.name}/dq")))
        value.type.tensor_type.elem_type = TensorProto.FLOAT
    nodes = added + [n for n in g.node if n.name not in dropped or n.op_type != "DequantizeLinear"]
    for n in nodes:
        for i, x in enumerate(n.input):
            if x in renames:
                n.input[i] = renames[x]
    del g.node[:]
    g.node.extend(nodes)
    return out


def _same_values(g: onnx.GraphProto, a: onnx.NodeProto, b: onnx.NodeProto) -> bool:
    inits = {i.name: i for i in g.initializer if i.name in (*a.input[1:3], *b.input[1:3])}
    return all(x in inits and y in inits and inits[x].data_type == inits[y].data_type
               and np.array_equal(numpy_helper.to_array(inits[x]), numpy_helper.to_array(inits[y]))
               for x, y in zip(a.input[1:3], b.input[1:3]))
