"""HtpQuantizer: annotates the exported StaticDecoder graph the way the HTP backend needs.

What each op gets (docs/design.md §1; "act" is the activation format of the op's scheme):

    linear          input act, weight per-channel (or LPBQ) symmetric, bias int32 with
                    scale = input scale × weight scale, output act
    matmul          input 0 act; input 1 int16 symmetric when act is 16-bit, else act; output act
    RMSNorm         one backend op: input (its producer's encoding), weight on act, output act;
                    the internals (pow, mean, rsqrt, ...) stay float
    embedding       shared: table on act and the gathered output shares it (gather moves data)
                    pcq8/pcq4: table int8/int4 symmetric per row (axis 0), output act
    RoPE tables     gathered like a shared embedding (the cos/sin tables are static)
    softmax, silu, gelu, add, mul, neg, cat, ...   inputs and output act
    scores + mask   output: the scores' range widened below by a margin; the mask requantized
                    to [-width of that range, 0], so a masked entry saturates under every real
                    score of its row (npuq.quant.specs.masked_scores_spec, layer_mask_spec)
    data movers     (view, transpose, slice, to, ...) output shares the input's encoding
    KV cache        cache input and cache concat take the new entries' encoding (derived from
                    their observer; cache contents are never observed), so KV input encoding =
                    KV output encoding by construction; a recipe's 8-bit KV cache
                    (Recipe.kv_format) makes the K/V path uint8 symmetric: the RoPE add's
                    output for K; for V, the view after the V projection requantizes its
                    16-bit output to uint8 (the HTP has no
                    FullyConnected/MatMul with 16-bit input and 8-bit output, docs/design.md §1)

Which scheme an op gets is the recipe's decision (:mod:`npuq.quant.recipe`), by op kind and
module path from ``node.meta["nn_module_stack"]``.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, Quantizer, SharedQuantizationSpec

from npuq.errors import NpuqError
from npuq.quant import graph as g
from npuq.quant.recipe import Recipe, RecipePlan
from npuq.quant.schemes import INT16_SYM, PerBlock, PerChannel, TensorFormat
from npuq.quant.specs import (
    activation_spec, bias_spec, copied_spec, layer_mask_spec, masked_scores_spec, weight_spec,
)

Q_ANNOTATION_KEY = "quantization_annotation"


def _annotate(node: Node, inputs: dict, output, implicit_sharing: bool = True) -> None:
    """``implicit_sharing``: PT2E may give an input edge its producer's observer where their
    specs agree in dtype and range (a derived spec always does: it must say False to get its own)."""
    node.meta[Q_ANNOTATION_KEY] = QuantizationAnnotation(input_qspec_map=inputs, output_qspec=output, _annotated=True,
                                                         allow_implicit_sharing=implicit_sharing)


def model_layers(gm: GraphModule) -> list[tuple[str, str]]:
    """(module path, op kind) of every node that gets its own encoding, in graph order."""
    layers = []
    for node in gm.graph.nodes:
        kind = g.op_kind(node)
        if kind is not None:
            layers.append((g.module_path(node), kind))
    return list(dict.fromkeys(layers))


class HtpQuantizer(Quantizer):
    """PT2E quantizer for the static decoder graphs (calibrate, prefill, decode)."""

    def __init__(self, recipe: Recipe, num_layers: int, plan: RecipePlan | None = None):
        """``plan``: the recipe matched against the whole model, for a graph that holds a part
        of it (whose layers alone could leave a rule unmatched); None: matched against the graph."""
        super().__init__()
        self.recipe = recipe
        self.num_layers = num_layers
        self.plan: RecipePlan | None = plan

    # ---------------------------------------------------------------- annotate
    def annotate(self, model: GraphModule) -> GraphModule:
        if self.plan is None:
            self.plan = self.recipe.plan(model_layers(model))
        kv_roots = set(g.kv_output_roots(model, self.num_layers))
        default_act = self.recipe.scheme.activation
        kv_fmt = self.recipe.kv_format  # None: the K/V path keeps each op's own activations
        out_fmt: dict[Node, TensorFormat] = {}  # the activation format each annotated node produces
        requant: dict[Node, TensorFormat] = {}  # nodes whose consumers requantize their output to this format

        for node in model.graph.nodes:
            if node.op != "call_function" or node.target in g.IGNORED:
                continue
            kind = g.op_kind(node)
            if kind is None:
                if g.is_cache_concat(node):
                    self._cache_concat(node, out_fmt, default_act)
                elif node.target in g.DATA_MOVERS and g.is_float_tensor(node):
                    src = node.args[0]
                    # Only views of encoded tensors (or of graph inputs) are encoded: a view of a
                    # float RMSNorm internal stays float inside that op.
                    if src in out_fmt or (isinstance(src, Node) and src.op == "placeholder" and g.is_float_tensor(src)):
                        fmt = requant.get(src) or out_fmt.get(src, default_act)
                        _annotate(node, {src: activation_spec(fmt)}, SharedQuantizationSpec((src, node)))
                        out_fmt[node] = fmt
                continue

            scheme = self.plan.scheme_of(g.module_path(node), kind)
            act = scheme.activation
            out = act
            if node in kv_roots and kv_fmt is not None:
                if kind in ("linear", "matmul") and act.bits > kv_fmt.bits:
                    requant[node] = kv_fmt  # its 16-bit output is requantized by the next view
                else:
                    out = kv_fmt
            out_spec = activation_spec(out)
            float_args = [a for a in node.args if g.is_float_tensor(a)]

            if kind == "linear":
                x, w = node.args[0], node.args[1]
                self._check_weight(node, w, scheme.weight)
                inputs = {x: activation_spec(act), w: weight_spec(scheme.weight)}
                if len(node.args) > 2 and isinstance(node.args[2], Node):
                    inputs[node.args[2]] = bias_spec(node)
                _annotate(node, inputs, out_spec)
            elif kind == "embedding":
                table = node.args[0]
                mode = self.recipe.embedding
                if mode == "shared":
                    _annotate(node, {table: activation_spec(act, constant=True)}, SharedQuantizationSpec((table, node)))
                else:
                    bits = 8 if mode == "pcq8" else 4
                    _annotate(node, {table: weight_spec(TensorFormat(bits, True, PerChannel(0)))}, out_spec)
            elif kind == "rope_table":
                table = node.args[0]
                _annotate(node, {table: activation_spec(act, constant=True)}, SharedQuantizationSpec((table, node)))
            elif kind == "matmul":
                a, b = node.args[0], node.args[1]
                second = INT16_SYM if act.bits == 16 else act
                _annotate(node, {a: activation_spec(act), b: activation_spec(second)}, out_spec)
            elif kind == "norm":
                weight = next(a for a in node.args if isinstance(a, Node) and a.op == "get_attr")
                _annotate(node, {weight: activation_spec(act, constant=True)}, out_spec)
            elif kind == "concat":
                _annotate(node, {a: activation_spec(act) for a in node.args[0] if g.is_float_tensor(a)}, out_spec)
            elif g.is_mask_add(node):  # the softmax input: the scores' range, masked entries below it
                mask = next(a for a in float_args if g.is_mask_add_operand(a))
                scores = next(a for a in float_args if a is not mask)
                where = g.module_path(node)
                _annotate(node, {scores: SharedQuantizationSpec(scores), mask: layer_mask_spec(scores, node, out, where)},
                          masked_scores_spec(scores, node, out, where), implicit_sharing=False)
            else:  # softmax, act_fn, elementwise
                _annotate(node, {a: activation_spec(act) for a in float_args}, out_spec)
            out_fmt[node] = out
        return model

    def _cache_concat(self, node: Node, out_fmt: dict, default_act: TensorFormat) -> None:
        """cat([cache, new]): the cache input and the output take the new entries' encoding,
        derived from the new entries' observer (cache contents are never observed)."""
        cache, new = node.args[0]
        fmt = out_fmt.get(new, default_act)
        same = copied_spec(new, fmt)
        _annotate(node, {new: activation_spec(fmt), cache: same}, same)
        out_fmt[node] = fmt

    def _check_weight(self, node: Node, w: Node, fmt: TensorFormat) -> None:
        if isinstance(fmt.granularity, PerBlock):
            shape = tuple(w.meta["val"].shape)
            if len(shape) != 2 or shape[1] % fmt.granularity.size:
                raise NpuqError(
                    f"{g.module_path(node)}: LPBQ blocks of {fmt.granularity.size} input channels do not divide "
                    f"the weight shape {shape}; give this layer 16a4w with a recipe rule"
                )

    def validate(self, model: GraphModule) -> None:
        """Every op with its own encoding was annotated (a missed op would silently stay float)."""
        for node in model.graph.nodes:
            if g.op_kind(node) is not None and Q_ANNOTATION_KEY not in node.meta:
                raise AssertionError(f"node {node.name} ({g.op_kind(node)}) was not annotated")
