"""RMSNorm → SimplifiedLayerNormalization, which the HTP runs as one RmsNorm op with a
uint16/int16 gamma (docs/design.md §9).

ONNX Runtime registers SimplifiedLayerNormalization in the default ONNX domain (version 1),
not in com.microsoft, so the node carries no domain; ``onnx.checker`` does not know the op
(it is not standard ONNX before RMSNormalization in opset 23). Two entry points: the
``aten.rms_norm`` op, and a decomposed chain with float internals matched by
:mod:`npuq.lower.patterns`. A chain quantized op by op is lowered by the element-wise
builders instead."""

from __future__ import annotations

import numpy as np

from npuq.lower.ir import Emit, Lowered, NodeView, Unsupported, Value
from npuq.lower.patterns import RMS_NORM_OP
from npuq.lower.registry import BuildContext, register


@register("aten.rms_norm.default")
def rms_norm(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    shape = list(view.args[1])
    weight = view.args[2] if len(view.args) > 2 else view.kwargs.get("weight")
    eps = view.args[3] if len(view.args) > 3 else view.kwargs.get("eps")
    if len(shape) != 1:
        raise Unsupported("RMSNorm over more than the last dimension")
    if eps is None:
        eps = float(np.finfo(np.float32).eps)
    e = Emit(view)
    gamma = weight.name if isinstance(weight, Value) else e.const(np.ones(shape, np.float32), "gamma")
    out = e.node("SimplifiedLayerNormalization", [x.name, gamma], view.name,
                 axis=-1, epsilon=float(eps), stash_type=1)
    return e.done(e.out(out))


@register(RMS_NORM_OP)
def rms_norm_chain(view: NodeView, ctx: BuildContext) -> Lowered:
    """A matched decomposed RMSNorm (npuq.lower.patterns): args (x, weight, eps)."""
    x, weight, eps = view.tensor(0), view.tensor(1), view.args[2]
    e = Emit(view)
    out = e.node("SimplifiedLayerNormalization", [x.name, weight.name], view.name,
                 axis=-1, epsilon=float(eps), stash_type=1)
    return e.done(e.out(out))
