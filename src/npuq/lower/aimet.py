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
    ``per_block_int_scale`` the multipliers k in the ONNX tensor's own layout (flattened
    row-major, as its initializer); ``compressed_bw`` the bits of the weight codes and
    ``bw`` = compressed_bw + the multipliers' bits, the "decompressed" width whose symmetric
    offset is -2^(bw-1) (docs/design.md §11)."""
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
