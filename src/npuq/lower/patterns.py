"""Multi-node patterns of the converted graph that lower to one backend op.

RMSNorm: the static decoder writes it out (pow, mean, add eps, rsqrt, mul, mul by weight), and
npuq's quantizer treats it as one backend op: only its input, weight and output are quantized
and the internals stay float. The HTP runs such a chain only as one RmsNorm op (float
internals would need CPU fallback), and that op is also the accurate form (docs/design.md §9),
so the chain is matched here and handed to the ``npuq.rms_norm`` builder as one node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

ALIASES = {"aten.to.dtype", "aten._to_copy.default", "aten.alias.default", "aten.clone.default",
           "aten.contiguous.default", "aten.detach.default"}
IGNORED_USERS = {"aten._assert_tensor_metadata.default"}
RMS_NORM_OP = "npuq.rms_norm"


def op_name(node) -> str:
    if not isinstance(node, Node) or node.op != "call_function":
        return ""
    t = node.target
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def _users(node: Node) -> list[Node]:
    return [u for u in node.users if op_name(u) not in IGNORED_USERS]


def _identity_requant(node: Node) -> Node | None:
    """dequantize(quantize(y)) with the same arguments: returns y."""
    if "dequantize_per_tensor" not in op_name(node):
        return None
    q = node.args[0]
    if "quantize_per_tensor" not in op_name(q) or "dequantize" in op_name(q):
        return None
    if tuple(q.args[1:5]) != tuple(node.args[1:5]):
        return None
    return q.args[0]


def strip(node, path: list[Node] | None = None):
    """Follow value-preserving nodes (same-dtype casts, identity requantization) to the source."""
    while isinstance(node, Node):
        if op_name(node) in ALIASES:
            nxt = node.args[0]
        else:
            nxt = _identity_requant(node)
            if nxt is None:
                return node
            if path is not None:
                path.append(node.args[0])
        if path is not None:
            path.append(node)
        node = nxt
    return node


@dataclass(frozen=True)
class RmsNormMatch:
    final: Node  # mul(weight, normalized): lowered as the whole norm
    x: Node  # the argument the chain normalizes (as the inner mul reads it)
    weight: Node
    eps: float
    internal: frozenset  # nodes replaced by the fused op


def _scalar_add(node) -> tuple[Node, float] | None:
    if op_name(node) not in ("aten.add.Tensor", "aten.add.Scalar"):
        return None
    a, b = node.args[0], node.args[1]
    if isinstance(a, Node) and isinstance(b, (int, float)):
        return a, float(b)
    if isinstance(b, Node) and isinstance(a, (int, float)):
        return b, float(a)
    return None


def _is_weight(node) -> bool:
    src = strip(node)
    if isinstance(src, Node) and src.op == "get_attr":
        return True
    if "dequantize" in op_name(node) and isinstance(node.args[0], Node) and node.args[0].op == "get_attr":
        return True
    return False


def match_rms_norm(final: Node) -> RmsNormMatch | None:
    if op_name(final) != "aten.mul.Tensor":
        return None
    for w, n in (final.args, final.args[::-1]):
        if not (isinstance(w, Node) and isinstance(n, Node) and _is_weight(w)):
            continue
        path: list[Node] = []
        inner = strip(n, path)
        if op_name(inner) != "aten.mul.Tensor":
            continue
        for x, r in (inner.args, inner.args[::-1]):
            if op_name(r) != "aten.rsqrt.default" or not isinstance(x, Node):
                continue
            added = _scalar_add(r.args[0])
            if added is None or op_name(added[0]) != "aten.mean.dim":
                continue
            mean = added[0]
            if list(mean.args[1]) not in ([-1], [len(mean.meta["val"].shape) - 1]) or not (len(mean.args) > 2 and mean.args[2]):
                continue
            power = mean.args[0]
            if op_name(power) != "aten.pow.Tensor_Scalar" or float(power.args[1]) != 2.0:
                continue
            if strip(power.args[0]) is not strip(x):
                continue
            internal = {power, mean, r.args[0], r, inner, *path}
            if all(u in internal or u is final for node in internal for u in _users(node)):
                return RmsNormMatch(final, x, w, added[1], frozenset(internal))
    return None


def match_patterns(graph: torch.fx.Graph) -> dict[Node, RmsNormMatch]:
    """final node → match, for every RMSNorm chain with float internals."""
    found = {}
    for node in graph.nodes:
        m = match_rms_norm(node)
        if m is not None:
            found[node] = m
    return found
