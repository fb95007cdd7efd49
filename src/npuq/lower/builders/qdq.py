"""quantize / dequantize nodes of the converted graph → QuantizeLinear / DequantizeLinear.

PT2E carries every format in a wider dtype (uint16 in int32 over [0, 65535], int4 in int8
over [-7, 7]); the quant range decides the ONNX type. Quantize nodes on constants (left
unfolded by convert_pt2e) are folded here.
"""

from __future__ import annotations

import numpy as np

from npuq.lower.qparams import NUMPY_OF, Encoding, quantize, storage_type
from npuq.lower.ir import Emit, Lowered, NodeView, Unsupported, Value
from npuq.lower.registry import BuildContext, register

QD = "quantized_decomposed"
Q_PER_TENSOR = (f"{QD}.quantize_per_tensor.default", f"{QD}.quantize_per_tensor.tensor", f"{QD}.quantize_per_tensor.tensor2")
DQ_PER_TENSOR = (f"{QD}.dequantize_per_tensor.default", f"{QD}.dequantize_per_tensor.tensor", f"{QD}.dequantize_per_tensor.tensor2")
Q_PER_CHANNEL = (f"{QD}.quantize_per_channel.default",)
DQ_PER_CHANNEL = (f"{QD}.dequantize_per_channel.default",)
Q_AFFINE = ("torchao.quantize_affine.default",)
DQ_AFFINE = ("torchao.dequantize_affine.default",)
QUANTIZE_OPS = Q_PER_TENSOR + Q_PER_CHANNEL + Q_AFFINE
DEQUANTIZE_OPS = DQ_PER_TENSOR + DQ_PER_CHANNEL + DQ_AFFINE


def _scalar(arg, what: str) -> float:
    if isinstance(arg, Value):
        if arg.const is None or arg.const.size != 1:
            raise Unsupported(f"the {what} must be a constant scalar")
        return arg.const.reshape(()).item()
    return arg


def encoding_of(op: str, args: tuple, static: bool) -> Encoding:
    """The encoding a quantized_decomposed node applies, from its arguments."""
    if op in Q_AFFINE + DQ_AFFINE:
        return _affine_encoding(args, static)
    if op in Q_PER_TENSOR + DQ_PER_TENSOR:
        scale, zp, qmin, qmax = (_scalar(args[1], "scale"), int(_scalar(args[2], "zero point")), args[3], args[4])
        return Encoding.per_tensor(scale, zp, qmin, qmax, storage_type(qmin, qmax, static))
    scales, zps, axis, qmin, qmax = args[1], args[2], args[3], args[4], args[5]
    if not isinstance(scales, Value) or scales.const is None:
        raise Unsupported("per-channel scales must be constants")
    s = scales.const.astype(np.float32).reshape(-1)
    z = zps.const.astype(np.int64).reshape(-1) if isinstance(zps, Value) and zps.const is not None else np.zeros_like(s, np.int64)
    return Encoding(s, z, qmin, qmax, storage_type(qmin, qmax, static), axis)


def _affine_encoding(args: tuple, static: bool) -> Encoding:
    """torchao quantize_affine / dequantize_affine (input, block_size, scale, zero_point, dtype,
    qmin, qmax): a block of 1 along every axis but one is a blocked encoding along that axis
    (LPBQ weights: block (1, 32) on an (O, I) weight)."""
    x, block, scales, zps = args[0], list(args[1]), args[2], args[3]
    qmin, qmax = args[5], args[6]
    if not isinstance(scales, Value) or scales.const is None:
        raise Unsupported("block scales must be constants")
    if qmin is None or qmax is None:
        raise Unsupported("quantize_affine without an explicit quant range")
    shape = x.shape
    blocked = [i for i, b in enumerate(block) if b != 1]
    full = [i for i, b in enumerate(block) if b == shape[i]]
    if len(blocked) == 1 and not [i for i in blocked if i in full]:
        axis = blocked[0]
        s = scales.const.astype(np.float32).reshape([d // b for d, b in zip(shape, block)])
        z = zps.const.astype(np.int64).reshape(s.shape) if isinstance(zps, Value) and zps.const is not None \
            else np.zeros(s.shape, np.int64)
        return Encoding(s, z, qmin, qmax, storage_type(qmin, qmax, static), axis, int(block[axis]))
    raise Unsupported(f"block size {tuple(block)} on shape {tuple(shape)}: only blocks along one axis are supported")


@register(*QUANTIZE_OPS)
def quantize_node(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    static = x.const is not None
    enc = encoding_of(view.op, view.args, static)
    e = Emit(view)
    if static:  # a constant left unfolded: quantize it here
        codes = quantize(x.const, enc)
        name = e.const(codes, name=f"{view.name}_{enc.type_name}")
        return e.done(e.out(name, elem_type=enc.onnx_type, encoding=enc, codes=codes))
    if enc.per_channel:
        raise Unsupported("per-channel quantization of an activation")
    name = e.quantize(x.name, enc, output=view.name)
    return e.done(e.out(name, elem_type=enc.onnx_type, encoding=enc))


@register(*DEQUANTIZE_OPS)
def dequantize_node(view: NodeView, ctx: BuildContext) -> Lowered:
    q = view.tensor(0)
    e = Emit(view)
    static = q.codes is not None or q.const is not None
    enc = encoding_of(view.op, view.args, static)
    if static:
        raw = q.codes if q.codes is not None else q.const
        if raw.min(initial=enc.qmin) < enc.qmin or raw.max(initial=enc.qmax) > enc.qmax:
            raise Unsupported(f"constant codes outside the quant range [{enc.qmin}, {enc.qmax}]")
        codes = raw.astype(NUMPY_OF[enc.onnx_type], copy=False)
        source = e.const(codes, name=f"{q.name}_{enc.type_name}")
    else:
        if q.elem_type != enc.onnx_type:
            raise Unsupported(f"dequantizes a {q.elem_type} tensor as {enc.type_name}")
        codes, source = None, q.name
    if enc.block_size is not None and codes is None:
        raise Unsupported("blocked dequantization of an activation")
    name = e.dequantize(source, enc, output=view.name)
    return e.done(e.out(name, elem_type=view.elem_type, encoding=enc, quantized=source, codes=codes))
