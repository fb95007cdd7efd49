"""Element-wise arithmetic, activations, softmax and reductions.

Scalar operands (an epsilon, the attention scale) become constants quantized exactly to the
type of the other operand, so the op remains a quantized op on the HTP. Ops that ONNX
spells as two nodes (rsqrt = 1 / sqrt, SiLU = x · sigmoid(x)) get an encoding for the
intermediate tensor: derived from the input range (rsqrt) or fixed (sigmoid output, [0, 1]
with 1 exact: :func:`sigmoid_encoding`).
"""

from __future__ import annotations

import math

import numpy as np

from npuq.lower.qparams import Encoding, affine_for_range
from npuq.lower.ir import Emit, Lowered, NodeView, Unsupported, Value
from npuq.lower.registry import BuildContext, register

BINARY = {
    "aten.add.Tensor": "Add", "aten.add.Scalar": "Add",
    "aten.sub.Tensor": "Sub", "aten.sub.Scalar": "Sub",
    "aten.mul.Tensor": "Mul", "aten.mul.Scalar": "Mul",
    "aten.div.Tensor": "Div", "aten.div.Scalar": "Div",
}
UNARY = {
    "aten.neg.default": "Neg", "aten.sqrt.default": "Sqrt", "aten.exp.default": "Exp",
    "aten.tanh.default": "Tanh", "aten.sigmoid.default": "Sigmoid", "aten.relu.default": "Relu",
    "aten.abs.default": "Abs", "aten.reciprocal.default": "Reciprocal",
}


def _operand(e: Emit, arg, other) -> str:
    if isinstance(arg, Value):
        return arg.name
    if isinstance(arg, (int, float, bool)):
        return e.scalar(float(arg), other if isinstance(other, Value) else None)
    raise Unsupported(f"operand of type {type(arg).__name__}")


@register(*BINARY)
def binary(view: NodeView, ctx: BuildContext) -> Lowered:
    a, b = view.args[0], view.args[1]
    alpha = view.kwargs.get("alpha", view.args[2] if len(view.args) > 2 else 1)
    if alpha != 1:
        raise Unsupported(f"alpha = {alpha}")
    if view.kwargs.get("rounding_mode") is not None:
        raise Unsupported("division with a rounding mode")
    e = Emit(view)
    inputs = [_operand(e, a, b), _operand(e, b, a)]
    return e.done(e.out(e.node(BINARY[view.op], inputs, view.name)))


@register(*UNARY)
def unary(view: NodeView, ctx: BuildContext) -> Lowered:
    e = Emit(view)
    return e.done(e.out(e.node(UNARY[view.op], [view.tensor(0).name], view.name)))


@register("aten.pow.Tensor_Scalar")
def power(view: NodeView, ctx: BuildContext) -> Lowered:
    x, p = view.tensor(0), float(view.args[1])
    e = Emit(view)
    if p == 2.0:  # x · x: an element-wise multiply every backend quantizes well
        return e.done(e.out(e.node("Mul", [x.name, x.name], view.name)))
    if p == 0.5:
        return e.done(e.out(e.node("Sqrt", [x.name], view.name)))
    if p == 1.0:
        return e.done(x)
    return e.done(e.out(e.node("Pow", [x.name, e.scalar(p, x)], view.name)))


def _sqrt_encoding(enc: Encoding) -> Encoding:
    lo, hi = enc.range()
    return affine_for_range(math.sqrt(max(lo, 0.0)), math.sqrt(max(hi, 0.0)), enc.bits)


@register("aten.rsqrt.default")
def rsqrt(view: NodeView, ctx: BuildContext) -> Lowered:
    """1 / sqrt(x) (ONNX has no Rsqrt); the sqrt output is re-encoded over sqrt of the input
    range. Pow(x, -0.5) would avoid that rounding but runs far less accurately on the HTP
    (logits off by 2-6e-2 instead of 5e-3 on a tiny Llama)."""
    x = view.tensor(0)
    e = Emit(view)
    root = e.node("Sqrt", [x.name], tag="sqrt")
    if x.encoding is not None and not x.encoding.per_channel:
        root = e.qdq(root, _sqrt_encoding(x.encoding), tag="sqrt")
    one = e.scalar(1.0, Value(root, (), encoding=x.encoding) if x.encoding is not None else None, tag="one")
    return e.done(e.out(e.node("Div", [one, root], view.name)))


def sigmoid_encoding(like: Encoding) -> Encoding:
    """Fixed encoding of the sigmoid inside a SiLU: [0, 1] *inclusive*, step 1 / (2^bits - 1).

    The PT2E program computes SiLU as one op, rounded once at its output; the sigmoid
    intermediate exists only because ONNX (and the HTP) spell SiLU as x · sigmoid(x). The
    published fixed sigmoid encoding (step 2^-bits, docs/design.md §1) tops out at 1 - 2^-bits,
    so every x above ~11.8 (16 bits) comes out as x · (1 - 2^-16): one output code low at the
    top of a wide gate range (SmolLM2-135M's reach 50), always in the same direction. It was
    the only op whose exported output differed from the PT2E program's by more than rounding
    ties, and it put the export's word perplexity 1.3 % (1024 tokens) / 0.9 % (4096 tokens)
    above the PT2E program's; with 1 exact: -0.05 % / +0.5 %, the spread a re-associated
    softmax alone causes (bench/export.py).

    The HTP's own sigmoid ignores this encoding (it tops out one code lower and rounds low,
    tests/lower/test_lower_htp.py), so on the HTP the bias remains.
    """
    bits = like.bits if like.bits in (8, 16) else 16
    qmax = 2**bits - 1
    return Encoding.per_tensor(1.0 / qmax, 0, 0, qmax)


@register("aten.silu.default")
def silu(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    e = Emit(view)
    gate = e.node("Sigmoid", [x.name], tag="sigmoid")
    if x.encoding is not None:
        gate = e.qdq(gate, sigmoid_encoding(x.encoding), tag="sigmoid")
    return e.done(e.out(e.node("Mul", [x.name, gate], view.name)))


@register("aten.gelu.default")
def gelu(view: NodeView, ctx: BuildContext) -> Lowered:
    approximate = view.kwargs.get("approximate", view.args[1] if len(view.args) > 1 else "none")
    e = Emit(view)
    return e.done(e.out(e.node("Gelu", [view.tensor(0).name], view.name, approximate=approximate)))


@register("aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default")
def softmax(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    dim = view.args[1] if len(view.args) > 1 else view.kwargs.get("dim", -1)
    e = Emit(view)
    return e.done(e.out(e.node("Softmax", [x.name], view.name, axis=dim)))


@register("aten.mean.dim", "aten.sum.dim_IntList")
def reduce(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    dims = view.args[1] if len(view.args) > 1 else view.kwargs.get("dim")
    keepdim = bool(view.args[2] if len(view.args) > 2 else view.kwargs.get("keepdim", False))
    if dims is None:
        dims = list(range(len(x.shape)))
    dims = [dims] if isinstance(dims, int) else list(dims)
    e = Emit(view)
    axes = e.const(np.array(dims, dtype=np.int64), "axes")
    op = "ReduceMean" if view.op == "aten.mean.dim" else "ReduceSum"
    return e.done(e.out(e.node(op, [x.name, axes], view.name, keepdims=int(keepdim))))
