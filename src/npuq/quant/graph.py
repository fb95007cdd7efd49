"""Reading the exported StaticDecoder graph: module paths, op kinds, KV-cache structure.

Pure helpers over ``torch.fx`` nodes of ``torch.export.export(model, inputs).module()``; the
quantizer and the calibration engines both use them, so "which node is what" is decided in
one place.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten


def attr_tensor(gm: GraphModule, node: object) -> torch.Tensor | None:
    """The tensor a ``get_attr`` node reads (its dotted target walked one name at a time); None
    for anything else."""
    if not isinstance(node, Node) or node.op != "get_attr":
        return None
    obj: object = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj if isinstance(obj, torch.Tensor) else None

# Ops that only move or view data: their output keeps the input's encoding.
DATA_MOVERS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.slice.Tensor,
    aten.select.int, aten.alias.default, aten.expand.default, aten.clone.default, aten.contiguous.default,
    aten.t.default, aten.to.dtype, aten._to_copy.default, aten.flatten.using_ints, aten.unflatten.int,
}
LINEAR = {aten.linear.default}
MATMUL = {aten.matmul.default, aten.bmm.default}
EMBEDDING = {aten.embedding.default}
SOFTMAX = {aten.softmax.int, aten._softmax.default}
ACT_FN = {aten.silu.default, aten.gelu.default, aten.sigmoid.default, aten.tanh.default}
ELEMENTWISE = {
    aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.neg.default, aten.rsqrt.default,
    aten.pow.Tensor_Scalar, aten.mean.dim, aten.sqrt.default, aten.exp.default,
}
CONCAT = {aten.cat.default}
IGNORED = {aten._assert_tensor_metadata.default, operator.getitem}


def module_path(node: Node) -> str:
    """The innermost module path of a node ('' for the top module or no module)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return _clean_path(list(stack.values())[-1][0])


def module_type(node: Node) -> str:
    """Qualified class name of the innermost module ('' if none)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    t = list(stack.values())[-1][1]
    return t if isinstance(t, str) else f"{t.__module__}.{t.__qualname__}"


def _clean_path(path: str) -> str:
    """``L['self'].layers[0].mlp`` (older torch) → ``layers.0.mlp``; already-clean paths pass."""
    if path.startswith("L['self']"):
        path = path[len("L['self']"):].lstrip(".")
        path = path.replace("[", ".").replace("]", "").replace("'", "")
    return path


def is_float_tensor(node: object) -> bool:
    if not isinstance(node, Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def in_rmsnorm(node: Node) -> bool:
    return module_type(node).endswith(".RMSNorm")


def rmsnorm_weight_mul(node: Node) -> bool:
    """The last op of an RMSNorm: weight (a get_attr) × normalized input."""
    return (
        node.op == "call_function" and node.target == aten.mul.Tensor and in_rmsnorm(node)
        and any(isinstance(a, Node) and a.op == "get_attr" for a in node.args)
    )


def op_kind(node: Node) -> str | None:
    """The recipe op kind of a call_function node (see npuq.quant.recipe.OP_KINDS), or None
    for nodes that get no encoding of their own (data movers, RMSNorm internals, ignored)."""
    if node.op != "call_function":
        return None
    t = node.target
    if in_rmsnorm(node):
        return "norm" if rmsnorm_weight_mul(node) else None
    if t in LINEAR:
        return "linear"
    if t in EMBEDDING:
        return "embedding"
    if t == aten.index.Tensor and isinstance(node.args[0], Node) and node.args[0].op == "get_attr":
        return "rope_table"
    if t in MATMUL:
        return "matmul"
    if t in SOFTMAX:
        return "softmax"
    if t in ACT_FN:
        return "act_fn"
    if t in CONCAT:
        return None if is_cache_concat(node) else "concat"
    if t in ELEMENTWISE and is_float_tensor(node):
        return "elementwise"
    return None


def graph_inputs(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def graph_outputs(gm: GraphModule) -> list[Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return list(out.args[0])


def cache_inputs(gm: GraphModule, num_layers: int) -> list[Node]:
    """K caches then V caches (placeholders after tokens, mask, positions); empty in calibrate mode."""
    inputs = graph_inputs(gm)
    caches = inputs[3:]
    if caches and len(caches) != 2 * num_layers:
        raise ValueError(f"graph has {len(caches)} cache inputs, expected 0 or {2 * num_layers}")
    return caches


def is_cache_concat(node: Node) -> bool:
    """cat([cache placeholder, new entries]) of a prefill/decode graph (observed or not)."""
    if node.op != "call_function" or node.target not in CONCAT or not isinstance(node.args[0][0], Node):
        return False
    first = node.args[0][0]
    while first.op == "call_module":  # an observer inserted by prepare
        first = first.args[0]
    return first.op == "placeholder"


def source_through_movers(node: Node) -> Node:
    """Walk back through data movers to the node that computed the values."""
    while node.op == "call_function" and node.target in DATA_MOVERS:
        node = node.args[0]
    return node


MASK_INPUT = "mask"  # the additive attention mask input of every model and part graph


def is_mask_add_operand(node: object) -> bool:
    """The attention mask input, or a view of it (the sliding-window mask is a slice of it)."""
    if not isinstance(node, Node):
        return False
    src = source_through_movers(node)
    return src.op == "placeholder" and src.name == MASK_INPUT


def is_mask_add(node: Node) -> bool:
    """``scores + mask``: an add one of whose operands is the attention mask input."""
    return node.op == "call_function" and node.target == aten.add.Tensor and any(
        is_mask_add_operand(a) for a in node.args[:2])


def kv_output_roots(gm: GraphModule, num_layers: int) -> list[Node]:
    """For each K/V output (k_new_0.., v_new_0..): the op that computed it (RoPE add for K,
    the V projection for V) — the start of the KV path of docs/design.md §1."""
    outs = graph_outputs(gm)[1:]
    if len(outs) != 2 * num_layers:
        raise ValueError(f"graph has {len(outs)} K/V outputs, expected {2 * num_layers}")
    return [source_through_movers(o) for o in outs]
