"""Data movement: reshape, transpose, slice, concat, gather by index, no-op casts.

These ops move codes without changing them; in a QDQ graph they sit between a
DequantizeLinear and a QuantizeLinear of the same encoding and run on integers on the HTP.
"""

from __future__ import annotations

import numpy as np

from npuq.lower.ir import Emit, Lowered, NodeView, Unsupported, Value, alias
from npuq.lower.registry import BuildContext, register


def _axis(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


@register("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.flatten.using_ints")
def reshape(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    if x.shape == view.shape:
        return alias(x)
    e = Emit(view)
    shape = e.const(np.array(view.shape, dtype=np.int64), "shape")
    return e.done(e.out(e.node("Reshape", [x.name, shape], view.name)))


@register("aten.transpose.int", "aten.permute.default", "aten.t.default")
def transpose(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    rank = len(x.shape)
    perm = list(range(rank))
    if view.op == "aten.permute.default":
        perm = [_axis(d, rank) for d in view.args[1]]
    else:
        a, b = (view.args[1], view.args[2]) if view.op == "aten.transpose.int" else (0, 1)
        a, b = _axis(a, rank), _axis(b, rank)
        perm[a], perm[b] = perm[b], perm[a]
    if perm == list(range(rank)):
        return alias(x)
    e = Emit(view)
    if moves_only_unit_dims(x.shape, perm):  # e.g. (B, 1, KV, D) → (B, KV, D, 1) in decode graphs
        shape = e.const(np.array(view.shape, dtype=np.int64), "shape")
        return e.done(e.out(e.node("Reshape", [x.name, shape], view.name)))
    groups = fused_groups(perm)
    if len(groups) < rank:
        # Dimensions that move together are merged: (B, T, KV, D) → (B, KV, D, T) is the
        # transpose (B, T, KV·D) → (B, KV·D, T) between two reshapes. ONNX Runtime's transpose
        # optimizer pushes the 4-D form past the QuantizeLinear of a graph output, where the
        # HTP cannot run it (SmolLM3's NoPE layers).
        order = sorted(range(len(groups)), key=lambda i: groups[i][0])  # input-order position of each group
        in_shape = [int(np.prod([x.shape[d] for d in groups[i]])) for i in order]
        small_perm = [order.index(i) for i in range(len(groups))]
        flat = e.node("Reshape", [x.name, e.const(np.array(in_shape, np.int64), "shape")], tag="merge")
        if x.encoding is not None and not x.encoding.per_channel:
            flat = e.qdq(flat, x.encoding, tag="merge")
        moved = e.node("Transpose", [flat], tag="transpose", perm=small_perm)
        if x.encoding is not None and not x.encoding.per_channel:
            moved = e.qdq(moved, x.encoding, tag="transpose")
        shape = e.const(np.array(view.shape, dtype=np.int64), "shape")
        return e.done(e.out(e.node("Reshape", [moved, shape], view.name)))
    return e.done(e.out(e.node("Transpose", [x.name], view.name, perm=perm)))


def fused_groups(perm: list[int]) -> list[list[int]]:
    """Runs of consecutive input dimensions that stay consecutive, in output order:
    [0, 2, 3, 1] → [[0], [2, 3], [1]]."""
    groups = [[perm[0]]]
    for d in perm[1:]:
        if d == groups[-1][-1] + 1:
            groups[-1].append(d)
        else:
            groups.append([d])
    return groups


def moves_only_unit_dims(shape: tuple[int, ...], perm: list[int]) -> bool:
    """A transpose that keeps the order of every dimension of size > 1 moves no data: it is a
    reshape (a cheaper op, and one ONNX Runtime's transpose optimizer leaves alone)."""
    big = [d for d in perm if shape[d] != 1]
    return big == sorted(big)


@register("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def unsqueeze(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    if x.shape == view.shape:
        return alias(x)
    e = Emit(view)
    shape = e.const(np.array(view.shape, dtype=np.int64), "shape")  # static shapes: a Reshape says it all
    return e.done(e.out(e.node("Reshape", [x.name, shape], view.name)))


@register("aten.slice.Tensor")
def slice_(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    args = list(view.args) + [None] * (5 - len(view.args))
    dim = _axis(args[1] if args[1] is not None else 0, len(x.shape))
    size = x.shape[dim]
    start = 0 if args[2] is None else args[2]
    end = size if args[3] is None else args[3]
    step = 1 if args[4] is None else args[4]
    start = max(0, min(size, start + size if start < 0 else start))
    end = max(0, min(size, end + size if end < 0 else end))
    if start == 0 and end == size and step == 1:
        return alias(x)
    e = Emit(view)
    ins = [e.const(np.array([v], dtype=np.int64), t) for v, t in ((start, "starts"), (end, "ends"), (dim, "axes"), (step, "steps"))]
    return e.done(e.out(e.node("Slice", [x.name, *ins], view.name)))


@register("aten.select.int")
def select(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    dim = _axis(view.args[1], len(x.shape))
    index = view.args[2] + x.shape[dim] if view.args[2] < 0 else view.args[2]
    e = Emit(view)
    idx = e.const(np.array(index, dtype=np.int64), "index")
    return e.done(e.out(e.node("Gather", [x.name, idx], view.name, axis=dim)))


@register("aten.cat.default", "aten.concat.default")
def cat(view: NodeView, ctx: BuildContext) -> Lowered:
    tensors = [t for t in view.args[0] if isinstance(t, Value) and 0 not in t.shape]
    if not tensors:
        raise Unsupported("concatenation of no non-empty tensors")
    dim = view.args[1] if len(view.args) > 1 else view.kwargs.get("dim", 0)
    if len(tensors) == 1:
        return alias(tensors[0])
    e = Emit(view)
    return e.done(e.out(e.node("Concat", [t.name for t in tensors], view.name, axis=_axis(dim, len(view.shape)))))


@register("aten.expand.default")
def expand(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    if x.shape == view.shape:
        return alias(x)
    e = Emit(view)
    shape = e.const(np.array(view.shape, dtype=np.int64), "shape")
    return e.done(e.out(e.node("Expand", [x.name, shape], view.name)))


@register("aten.alias.default", "aten.clone.default", "aten.contiguous.default", "aten.detach.default",
          "aten.to.dtype", "aten._to_copy.default", "aten.to.dtype_layout", "aten.lift_fresh_copy.default",
          "aten.dropout.default")
def no_op(view: NodeView, ctx: BuildContext) -> Lowered:
    x = view.tensor(0)
    if x.elem_type == view.elem_type:
        return alias(x)
    e = Emit(view)
    return e.done(e.out(e.node("Cast", [x.name], view.name, to=view.elem_type)))


@register("aten.index.Tensor")
def index(view: NodeView, ctx: BuildContext) -> Lowered:
    """``table[ids]`` (one index tensor, e.g. RoPE tables indexed by positions) → Gather."""
    x = view.tensor(0)
    indices = list(view.args[1])
    used = [i for i, t in enumerate(indices) if t is not None]
    if len(used) != 1 or not isinstance(indices[used[0]], Value):
        raise Unsupported("only indexing with a single index tensor is supported")
    e = Emit(view)
    return e.done(e.out(e.node("Gather", [x.name, indices[used[0]].name], view.name, axis=used[0])))
