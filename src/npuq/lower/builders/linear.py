"""aten.linear → MatMul on a transposed per-channel weight, or Gemm when there is a bias.

The weight (O, I) is quantized per output channel (axis 0). ONNX MatMul wants (I, O), so the
codes are transposed ahead of time and dequantized along axis 1; the HTP runs the pair as a
FullyConnected with per-channel weights (docs/design.md §9). With a bias, the input is
flattened to 2-D (a lossless reshape in its own encoding), fed to Gemm(transB=1) with the
int32 bias (scale = input scale × weight scale, zero point 0), and reshaped back.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from npuq.lower.qparams import NUMPY_OF, Encoding, affine_for_range, dequantize, lpbq_split, quantize
from npuq.lower.ir import Emit, Lowered, NodeView, Unsupported, Value
from npuq.lower.registry import BuildContext, register


def _weight_codes(w: Value) -> tuple[np.ndarray, Encoding] | None:
    if w.codes is not None and w.encoding is not None:
        return w.codes, w.encoding
    return None


def _blocked_weight(e: Emit, codes: np.ndarray, enc: Encoding, transpose: bool) -> str:
    """Float name of a block-quantized (LPBQ) weight, laid out (I, O) if ``transpose`` else (O, I).

    Written the way the QNN EP recognises LPBQ (its LowPowerBlockQuantized fusions): the block
    scales are themselves DequantizeLinear(integer multipliers k, per-channel base scale), and
    feed the blocked DequantizeLinear of the int4 codes.
    """
    if enc.axis != 1 or codes.ndim != 2:
        raise Unsupported(f"block quantization along axis {enc.axis} of a {codes.ndim}-d weight; expected input channels")
    split = lpbq_split(enc.scale)
    if transpose:
        codes, scale_t = np.ascontiguousarray(codes.T), enc.scale.T
        laid = Encoding(scale_t, enc.zero_point.T, enc.qmin, enc.qmax, enc.onnx_type, 0, enc.block_size)
    else:
        laid = enc
    if split is None:  # not base · integer: a plain blocked dequantization
        return e.static(codes, laid, "weight_blocked")
    base, k, _ = split
    k_laid = np.ascontiguousarray(k.T) if transpose else k
    channel_axis = 1 if transpose else 0
    scales = e.node("DequantizeLinear", [e.const(k_laid, "block_k"), e.const(base, "base_scale"),
                                         e.const(np.zeros_like(base, dtype=np.uint8), "base_zp")],
                    tag="block_scales", axis=channel_axis)
    zp = e.const(np.zeros(laid.scale.shape, dtype=NUMPY_OF[enc.onnx_type]), "weight_zp")
    codes_name = e.const(codes.astype(NUMPY_OF[enc.onnx_type]), "weight_codes")
    return e.node("DequantizeLinear", [codes_name, scales, zp], tag="weight_lpbq", axis=laid.axis,
                  block_size=enc.block_size)


def _transposed_weight(e: Emit, w: Value) -> str:
    """Float name of W^T (I, O): re-laid codes + DequantizeLinear along axis 1, or a float const."""
    quant = _weight_codes(w)
    if quant is None:
        if w.const is None:
            raise Unsupported("the weight is neither a quantized constant nor a float constant")
        return e.const(np.ascontiguousarray(w.const.T).astype(np.float32), "weight_t")
    codes, enc = quant
    if enc.block_size is not None:
        return _blocked_weight(e, codes, enc, transpose=True)
    if enc.per_channel and enc.axis != 0:
        raise Unsupported(f"weight quantized along axis {enc.axis}; expected output channels (axis 0)")
    t_enc = Encoding(enc.scale, enc.zero_point, enc.qmin, enc.qmax, enc.onnx_type, 1 if enc.per_channel else None)
    return e.static(np.ascontiguousarray(codes.T), t_enc, "weight_t")


def _bias(e: Emit, b: Value, x: Value, w: Value) -> str:
    """Float name of the bias, as int32 codes at scale = s_x · s_w (the HTP's bias encoding)."""
    if b.codes is not None and b.encoding is not None:
        if b.encoding.onnx_type != TensorProto.INT32:
            raise Unsupported(f"bias quantized as {b.encoding.type_name}; expected int32")
        return e.static(b.codes, b.encoding, "bias")
    if b.const is None:
        raise Unsupported("the bias is not a constant")
    quant = _weight_codes(w)
    if x.encoding is None or quant is None:
        return e.const(b.const.astype(np.float32), "bias")
    w_scale = quant[1].scale if quant[1].block_size is None else lpbq_split(quant[1].scale)[0]
    scale = (w_scale * x.encoding.scale).astype(np.float32).reshape(-1)
    scale = np.broadcast_to(scale, b.const.shape).copy()
    enc = Encoding(scale, np.zeros_like(scale, dtype=np.int64), -(2**31), 2**31 - 1, TensorProto.INT32, 0)
    return e.static(quantize(b.const, enc), enc, "bias")


@register("aten.linear.default")
def linear(view: NodeView, ctx: BuildContext) -> Lowered:
    x, w = view.tensor(0), view.tensor(1)
    b = view.args[2] if len(view.args) > 2 else view.kwargs.get("bias")
    e = Emit(view)
    if b is None:
        return e.done(e.out(e.node("MatMul", [x.name, _transposed_weight(e, w)], view.name)))
    if not isinstance(b, Value):
        raise Unsupported("bias is not a tensor")
    quant = _weight_codes(w)
    if quant is not None and quant[1].block_size is not None and view.out_encoding is not None:
        # The HTP composes no Gemm with LPBQ weights: MatMul, then the bias as a quantized Add.
        # The MatMul output gets the output range shifted by the bias range (so nothing the Add
        # brings back into range is clipped): one extra rounding.

        if b.const is not None:
            bias = b.const.astype(np.float32)
        elif b.codes is not None:
            bias = dequantize(b.codes, b.encoding)
        else:
            raise Unsupported("the bias is not a constant")
        out_lo, out_hi = view.out_encoding.range()
        bits = view.out_encoding.bits
        mm_enc = affine_for_range(out_lo - float(bias.max()), out_hi - float(bias.min()), bits)
        b_enc = affine_for_range(float(bias.min()), float(bias.max()), bits)
        out = e.qdq(e.node("MatMul", [x.name, _transposed_weight(e, w)], tag="matmul"), mm_enc, tag="matmul")
        add = e.node("Add", [out, e.static(quantize(bias, b_enc), b_enc, "bias")], view.name)
        e.note("linear_bias", form="matmul+add", reason="LPBQ weights")
        return e.done(e.out(add))
    rows = int(np.prod(x.shape[:-1]))
    flat = e.node("Reshape", [x.name, e.const(np.array([rows, x.shape[-1]], np.int64), "shape")], tag="flat")
    if x.encoding is not None:
        flat = e.qdq(flat, x.encoding, tag="flat")
    if quant is not None and quant[1].block_size is not None:
        weight = _blocked_weight(e, quant[0], quant[1], transpose=False)
    elif quant is not None:
        weight = e.static(quant[0], quant[1], "weight")
    elif w.const is not None:
        weight = e.const(w.const.astype(np.float32), "weight")
    else:
        raise Unsupported("the weight is not a constant")
    out = e.node("Gemm", [flat, weight, _bias(e, b, x, w)], tag="gemm", transB=1)
    if view.out_encoding is not None:
        out = e.qdq(out, view.out_encoding, tag="gemm")
    shape = e.const(np.array(view.shape, np.int64), "shape")
    return e.done(e.out(e.node("Reshape", [out, shape], view.name)))
