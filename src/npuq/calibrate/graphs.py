"""Export the graphs of one model (docs/design.md §2) as PT2E-ready GraphModules.

The quantize flow exports one graph, :func:`export_model_graph`: the graph with cache inputs,
with dynamic batch, ar_len T and cache length C. Prepared once, it serves every mode:

- decode (T = 1) and prefill (T = N): the graph itself, called with a cache of ctx - T slots
  (batch 1, as a device runs them), later specialised to static shapes;
- calibrate (T = ctx, no cache): :func:`calibration_view`, the same prepared nodes and observer
  instances with every cache concat bypassed, so whole windows many per batch and a short tail
  as its own forward run through the observers the decode and prefill programs are converted
  from (no encodings to carry from graph to graph, no padding ever observed).

Its nodes are named as a static trace of the decode graph names them (:func:`static_names`), so
encodings.json reads the same as when each graph was exported on its own. :func:`export_graph`
still exports one mode by itself (static prefill/decode, dynamic calibrate): the tests use it
as the reference the one-graph flow must reproduce bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from typing import Any

import torch
from torch.export import Dim
from torch.fx import Graph, GraphModule, Node
from torch.fx.graph import CodeGen, _Namespace

from npuq.models.decoder import StaticDecoder
from npuq.quant import graph as g
from npuq.runtime.runner import example_inputs, step_inputs

log = logging.getLogger("npuq.calibrate.graphs")
aten = torch.ops.aten
_INT64_MAX = 2**63 - 1
# Nodes that compute shapes or check them, which only a graph with symbolic sizes has.
SHAPE_OPS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int, aten._assert_scalar.default,
             aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default}


def export_graph(model: torch.nn.Module, mode: str, context: int, ar_len: int | None = None) -> GraphModule:
    """The unlifted graph of ``mode`` (calibrate / prefill / decode) at context ``context``.

    calibrate graphs have symbolic batch and length (one graph for any T ≤ context); prefill
    and decode graphs are static with batch 1.
    """
    if mode == "calibrate":
        inputs = example_inputs(model.config, "calibrate", context, batch=2)  # batch 2: not specialised to 1
        B, T = Dim.DYNAMIC, Dim.DYNAMIC
        dynamic = ({0: B, 1: T}, {0: B, 2: T, 3: T}, {0: B, 1: T})
        program = torch.export.export(model, inputs, dynamic_shapes=dynamic)
    else:
        program = torch.export.export(model, example_inputs(model.config, mode, context, ar_len))
    return program.module()


def export_model_graph(model: torch.nn.Module, device: str = "cpu") -> GraphModule:
    """The one graph of the model: tokens, mask, positions and one K and V cache per layer, with
    symbolic batch B, ar_len T and cache length C (mask length C + T), named by
    :func:`static_names`. Traced at B, T, C = 4, 2, 3 (distinct and above 1, so that no size is
    specialised or two sizes merged); it runs at any B, T ≥ 1 and C ≥ 0.

    Tracing with symbolic sizes costs a few times a static trace, per op. Decoder layers of one
    kind trace to the same ops, so only a template is traced (:func:`template_layers`: the first
    layer and the first later layer of each kind) and the others are copies of their kind's
    template layer (:func:`stitch_layers`); a model no deeper than its template is traced whole.
    ``tests/quant/test_quant_onegraph.py`` checks, node by node, that both give the same graph.
    ``device``: where the example inputs are made (the model's device; "meta" for
    :func:`meta_model_graph`).
    """
    picks = template_layers(model)
    if len(picks) < model.config.num_layers:
        template = _export_dynamic(_with_layers(model, picks), device)
        try:
            return static_names(stitch_layers(template, model, picks))
        except StitchError as exc:  # a layout this code does not know: trace the whole model
            log.debug("tracing the whole model: %s", exc)
    return static_names(_export_dynamic(model, device))


def _export_dynamic(model: torch.nn.Module, device: str = "cpu") -> GraphModule:
    cfg = model.config
    B, T, C = 4, 2, 3
    tokens, mask, positions = step_inputs(cfg, torch.zeros(B, T, dtype=torch.long, device=device), 0, C + T)
    KV, D, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    caches = (tuple(torch.zeros(B, KV, D, C, device=device) for _ in range(L))
              + tuple(torch.zeros(B, KV, C, D, device=device) for _ in range(L)))
    A = Dim.AUTO
    dynamic = ({0: A, 1: A}, {0: A, 2: A, 3: A}, {0: A, 1: A},
               tuple([{0: A, 3: A}] * L + [{0: A, 2: A}] * L))
    return torch.export.export(model, (tokens, mask, positions, *caches), dynamic_shapes=dynamic).module()


def layer_kind(model: torch.nn.Module, i: int) -> tuple:
    """What decides the ops a decoder layer traces to: its type in the config (full / sliding
    attention, RoPE or not) and its modules, parameter shapes and scalar settings."""
    cfg, layer = model.config, model.layers[i]
    params = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
    modules = tuple((name, type(m).__qualname__) for name, m in layer.named_modules())
    scalars = tuple(sorted((f"{name}.{k}", v) for name, m in layer.named_modules() for k, v in vars(m).items()
                           if not k.startswith("_") and isinstance(v, (bool, int, float, str))))
    return cfg.layer_types[i], cfg.use_rope[i], params, modules, scalars


def template_layers(model: torch.nn.Module) -> list[int]:
    """The layers traced for :func:`export_model_graph`: layer 0 (which reads the embeddings)
    and, for each kind of layer after it, the first layer of that kind."""
    picks, seen = [0], set()
    for i in range(1, model.config.num_layers):
        kind = layer_kind(model, i)
        if kind not in seen:
            seen.add(kind)
            picks.append(i)
    return picks


def _with_layers(model: torch.nn.Module, picks: list[int]) -> torch.nn.Module:
    """A shallow copy of ``model`` whose layers are ``picks`` of its own (the same modules and
    weights) and whose config says so."""
    cfg = model.config
    template = copy.copy(model)
    template._modules = dict(model._modules)
    template._modules["layers"] = torch.nn.ModuleList(model.layers[i] for i in picks)
    template.config = dataclasses.replace(
        cfg, num_layers=len(picks), layer_types=tuple(cfg.layer_types[i] for i in picks),
        use_rope=tuple(cfg.use_rope[i] for i in picks))
    return template


class StitchError(ValueError):
    """The template graph is not laid out as :func:`stitch_layers` expects."""


def _layer_of(node: Node) -> int | None:
    """The decoder layer (index into ``layers``) a node was traced in, from its module path."""
    parts = g.module_path(node).split(".")
    if len(parts) >= 2 and parts[0] == "layers" and parts[1].isdigit():
        return int(parts[1])
    return None


def _renumber(text: str, m: int, i: int) -> str:
    return re.sub(rf"layers\.{m}(?=\.|$)", f"layers.{i}", text)


def stitch_layers(template: GraphModule, model: torch.nn.Module, picks: list[int]) -> GraphModule:
    """The graph of ``model`` from ``template``, the graph of ``_with_layers(model, picks)``:
    the nodes before and after the layers as they are, and for every layer i of the model the
    nodes of the template layer of its kind (the template's own for the layers it holds), with
    layer i's weights, cache inputs and module paths, reading layer i - 1's result where the
    template layer read its predecessor's. Shape nodes (symbolic sizes and their checks) are
    made once, as a trace makes them. Nodes come in the order a trace of the whole model gives
    them (inputs, weights layer by layer, then the ops), so :func:`static_names` names them
    alike. Raises :class:`StitchError` when the template is not laid out so."""
    cfg = model.config
    L, k = cfg.num_layers, len(picks)
    kinds = [layer_kind(model, i) for i in picks]
    source = [0] + [next(m for m in range(1, k) if kinds[m] == layer_kind(model, i)) for i in range(1, L)]

    nodes = [n for n in template.graph.nodes if not is_input_guard(n)]
    spans: dict[int, list[Node]] = {m: [] for m in range(k)}
    for n in nodes:
        m = _layer_of(n) if n.op == "call_function" else None
        if m is not None:
            spans[m].append(n)
    span_of = {n: m for m, span in spans.items() for n in span}
    output = next(n for n in nodes if n.op == "output")
    outputs = output.args[0]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(outputs) != 1 + 2 * k or len(placeholders) != 3 + 2 * k:
        raise StitchError(f"the template has {len(placeholders)} inputs and {len(outputs)} outputs for {k} layers")
    cache_of = {n: (j % k, j // k) for j, n in enumerate(placeholders[3:])}  # (template layer, 0 K / 1 V)
    results = {}  # each template layer's result: the one value of its span that a later op reads
    for m, span in spans.items():
        leaving = [n for n in span if not is_shape_node(n)
                   and any(u.op != "output" and span_of.get(u) != m for u in n.users)]
        if len(leaving) != 1:
            raise StitchError(f"template layer {m} passes {len(leaving)} values on, not 1")
        results[m] = leaving[0]
    last = results[k - 1]

    graph = Graph()
    outer: dict[Node, Node] = {}  # template nodes outside the layers → the new graph's
    shapes: dict[Any, Node] = {}  # shape nodes by what they compute
    weights: dict[tuple[int, str], Node] = {}  # (layer, target after "layers.N.") → get_attr
    caches: list[Node] = []
    made: dict[str, list[Node]] = {"result": [], "k": [], "v": []}

    def copy(t: Node, resolve, m: int | None = None, i: int | None = None) -> Node:
        new = graph.node_copy(t, resolve)
        new.meta = dict(t.meta)
        stack = t.meta.get("nn_module_stack")
        if stack and m is not None and m != i:
            new.meta["nn_module_stack"] = {_renumber(key, m, i): (_renumber(path, m, i), kind)
                                           for key, (path, kind) in stack.items()}
        return new

    def shape(t: Node, resolve, m: int | None = None, i: int | None = None) -> Node:
        val = t.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            key: Any = ("value", str(val.node.expr))
        else:
            key = ("check", str(t.target), repr(torch.fx.node.map_arg(t.args, resolve)))
        if key not in shapes:
            shapes[key] = copy(t, resolve, m, i)
        return shapes[key]

    def is_layer_weight(a: Node) -> bool:
        parts = a.target.split(".") if a.op == "get_attr" else []
        return len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit()

    def make_layers() -> None:
        for i in range(L):
            m = source[i]
            local: dict[Node, Node] = {}

            def resolve(a: Node, i: int = i, m: int = m, local: dict = local) -> Node:
                if a in local:
                    return local[a]
                if is_layer_weight(a):
                    return weights[(i, a.target.split(".", 2)[2])]
                if a in cache_of:
                    layer, which = cache_of[a]
                    if layer != m:
                        raise StitchError(f"template layer {m} reads the cache of template layer {layer}")
                    return caches[which * L + i]
                if a in span_of:
                    if is_shape_node(a):
                        return shape(a, resolve)
                    if span_of[a] == m - 1 and a is results[m - 1] and i > 0:
                        return made["result"][i - 1]
                    raise StitchError(f"template layer {m} reads {a.name} of template layer {span_of[a]}")
                if a in outer:
                    return outer[a]
                raise StitchError(f"template layer {m} reads {a.name}, which comes after the layers")

            for t in spans[m]:
                local[t] = shape(t, resolve, m, i) if is_shape_node(t) else copy(t, resolve, m, i)
            made["result"].append(local[results[m]])
            made["k"].append(local[outputs[1 + m]])
            made["v"].append(local[outputs[1 + k + m]])

    def resolve_outer(a: Node) -> Node:
        if a in outer:
            return outer[a]
        if a in cache_of and caches:  # where a trace reads a size shared by every cache
            layer, which = cache_of[a]
            return caches[which * L + picks[layer]]
        if a is last and made["result"]:
            return made["result"][-1]
        if a in span_of and is_shape_node(a):
            return shape(a, resolve_outer)
        raise StitchError(f"{a.name} is read outside the layers but is not the last layer's result")

    for n in nodes:
        if n.op == "placeholder":
            if n not in cache_of:
                outer[n] = copy(n, resolve_outer)
            elif not caches:
                caches = [graph.placeholder(f"caches_{j}") for j in range(2 * L)]
                for j, c in enumerate(caches):
                    c.meta = dict(placeholders[3 + (j // L) * k].meta)
        elif is_layer_weight(n):
            if not weights:
                per_layer: dict[int, list[Node]] = {m: [] for m in range(k)}
                for a in nodes:
                    if is_layer_weight(a):
                        per_layer[int(a.target.split(".")[1])].append(a)
                for i in range(L):
                    for a in per_layer[source[i]]:
                        rest = a.target.split(".", 2)[2]
                        weights[(i, rest)] = graph.get_attr(f"layers.{i}.{rest}")
                        weights[(i, rest)].meta = dict(a.meta)
        elif n in span_of:
            if not made["result"]:
                make_layers()
        elif n.op == "output":
            graph.output((resolve_outer(outputs[0]), *made["k"], *made["v"]))
        elif n.op == "get_attr":
            outer[n] = copy(n, resolve_outer)
        elif is_shape_node(n):
            outer[n] = shape(n, resolve_outer)
        else:
            if not made["result"] and any(a in span_of for a in n.all_input_nodes):
                raise StitchError(f"{n.name} reads a layer before the layers are made")
            outer[n] = copy(n, resolve_outer)
    graph._codegen = CodeGen()  # positional inputs: tokens, mask, positions, K caches, V caches
    graph.lint()
    return GraphModule(model, graph)


def is_shape_node(node: Node) -> bool:
    """A node that computes or checks a symbolic size (absent from a static trace)."""
    if node.op != "call_function":
        return False
    val = node.meta.get("val")
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)) or node.target in SHAPE_OPS


def is_input_guard(node: Node) -> bool:
    """The call of ``_guards_fn``, which ``ExportedProgram.module()`` (torch ≥ 2.9) puts after the
    inputs to check their shapes against the trace's assumptions: it computes nothing, and a
    static program or a view with other inputs has no use for it."""
    return node.op == "call_module" and node.target == "_guards_fn"


def _whole_slice(node: Node) -> bool:
    """aten.slice over a whole dimension (``x[:, 0:1]`` of a size-1 dim, ``:`` of a symbolic one)."""
    if node.op != "call_function" or node.target != aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    x, dim, start, end, step = args[0], args[1] or 0, args[2], args[3], args[4] or 1
    size = x.meta["val"].shape[dim]
    whole_end = end is None or end == _INT64_MAX or (isinstance(size, int) and isinstance(end, int) and end >= size)
    return start in (0, None) and step == 1 and whole_end


def static_names(gm: GraphModule) -> GraphModule:
    """Rename (in place) the nodes of a graph traced with symbolic sizes as a static trace of the
    same module names them, and make its indexing no-ops look the same.

    A trace names each node after its op with a counter per op name (``mul``, ``mul_1``, ...);
    with symbolic sizes the shape arithmetic takes counters too (an ``operator.mul`` of two
    sizes is a ``mul``), so every later ``mul`` is numbered differently. Indexing differs as
    well: a static trace drops a slice over a whole dimension, and makes an expression whose
    slices all do nothing an ``alias`` of its input, while a symbolic size keeps the slice. So:
    whole-dimension slices feeding only other slices are removed, the other ones become aliases,
    and the names are handed out again in graph order, shape nodes left out (they take names
    after all the others). Nothing computes differently (a whole slice and an alias are both
    views of the input). ``tests/quant/test_quant_onegraph.py`` checks, for every tiny family,
    that the result has exactly the static decode graph's node names and ops.
    """
    graph = gm.graph
    aliases: set[Node] = set()
    for node in list(graph.nodes):
        if not _whole_slice(node):
            continue
        source = node.args[0]
        if node.users and all(u.op == "call_function" and u.target == aten.slice.Tensor for u in node.users):
            node.replace_all_uses_with(source)
        else:
            with graph.inserting_before(node):
                alias = graph.call_function(aten.alias.default, (source,))
            alias.meta = dict(node.meta)
            node.replace_all_uses_with(alias)
            aliases.add(alias)
        graph.erase_node(node)

    names = _Namespace()
    nodes = list(graph.nodes)
    for node in nodes:
        if node.op != "call_function":
            names.create_name(node.name, node)  # inputs, weights and the output keep their names
    for shape_pass in (False, True):
        for node in nodes:
            if node.op == "call_function" and is_shape_node(node) == shape_pass:
                base = "alias" if node in aliases else re.sub(r"_\d+$", "", node.name)
                node.name = names.create_name(base, node)
    graph._graph_namespace = names  # later nodes (observers, q/dq) get names unique among these
    gm.recompile()
    return gm


def calibration_view(prepared: GraphModule) -> GraphModule:
    """The calibrate graph of a prepared model graph: each cache concat ``cat([cache, new])``
    replaced by ``new``, over the *same* observer instances and weights. Called with an empty
    cache (C = 0, :func:`npuq.calibrate.engines.calibrate_onepass` passes one) on whole windows,
    it computes exactly what the calibrate graph computes (attention over the new entries, the
    same operands in the same memory layout: a concat with an empty cache would copy them) and
    records it in the observers the decode and prefill programs are converted from. The cache
    inputs' observers are derived from the new entries' (they observe nothing). Inputs are
    positional: tokens, mask, positions, K caches, V caches."""
    view = Graph()
    env: dict[Node, Node] = {}
    for node in prepared.graph.nodes:
        if is_input_guard(node):
            continue
        if g.is_cache_concat(node):
            env[node] = env[node.args[0][1]]
        elif node.op == "output":
            outputs = node.args[0]
            view.output(tuple(env[a] for a in outputs) if isinstance(outputs, (list, tuple)) else env[outputs])
        else:
            env[node] = view.node_copy(node, env.__getitem__)
    view._codegen = CodeGen()
    return GraphModule(prepared, view)  # shares the observer modules and weights, copies nothing


HIDDEN = "hidden"  # the input of a part that starts after layer 0: the hidden states (B, T, hidden)


def meta_model_graph(cfg: Any, max_context: int) -> GraphModule:
    """:func:`export_model_graph` of a model of config ``cfg`` whose tensors are all on the meta
    device: the graph without a byte of weights (a 7B model's graph is traced in the memory of
    its nodes). Its ``get_attr`` nodes name the weights; :func:`part_graph` cuts a part out of it
    and binds that part's real tensors. Tensors the model makes while it runs (``device=``
    arguments) are made on the CPU, where the parts run."""
    with torch.device("meta"):
        skeleton = StaticDecoder(cfg, max_context)
    gm = export_model_graph(skeleton.to("meta"), device="meta")
    for node in gm.graph.nodes:
        if isinstance(node.kwargs.get("device"), torch.device) and node.kwargs["device"].type == "meta":
            node.kwargs = {**node.kwargs, "device": torch.device("cpu")}
    gm.recompile()
    return gm


def _results(nodes: list[Node], span_of: dict[Node, int]) -> dict[int, Node]:
    """Each layer's result: the one value of its nodes that an op outside the layer reads."""
    results: dict[int, list[Node]] = {}
    for n, m in span_of.items():
        if not is_shape_node(n) and any(u.op != "output" and span_of.get(u) != m for u in n.users):
            results.setdefault(m, []).append(n)
    for m, leaving in results.items():
        if len(leaving) != 1:
            raise ValueError(f"layer {m} passes {len(leaving)} values on, not 1")
    return {m: leaving[0] for m, leaving in results.items()}


def part_graph(whole: GraphModule, first: int, end: int, weights: torch.nn.Module) -> GraphModule:
    """Layers ``first`` … ``end - 1`` of the model graph ``whole`` (:func:`export_model_graph` or
    :func:`meta_model_graph`) as a graph of their own, with the same node names, ops and symbolic
    sizes. Inputs, positional: the token ids (a part starting at layer 0, which holds the
    embedding) or the hidden states :data:`HIDDEN` (B, T, hidden) that layer ``first - 1``
    passes on; the mask; the positions; the part's K caches; its V caches. Outputs: the logits
    (a part ending at the last layer, which holds the final norm and head) or the hidden states
    layer ``end - 1`` passes on; the part's K news; its V news. Chained in order, the parts compute
    what ``whole`` computes, op for op (:class:`npuq.runtime.runner.PartChain`).

    A weight is read from ``weights`` (a module with the model's parameter names, holding at
    least this part's real tensors), any other constant from ``whole``. A size the part's ops
    read off a value it no longer has (the batch of the token ids) is read off an input of the
    part with the same symbolic size."""
    nodes = [n for n in whole.graph.nodes if not is_input_guard(n)]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    L = (len(placeholders) - 3) // 2
    if not 0 <= first < end <= L:
        raise ValueError(f"layers {first}..{end - 1} are not a part of a model of {L} layers")
    span_of = {n: m for n in nodes if n.op == "call_function" and (m := _layer_of(n)) is not None}
    results = _results(nodes, span_of)
    outs = next(n for n in nodes if n.op == "output").args[0]
    targets = [outs[0] if end == L else results[end - 1],
               *outs[1 + first : 1 + end], *outs[1 + L + first : 1 + L + end]]
    cut = results[first - 1] if first > 0 else None
    tokens, mask, positions = placeholders[:3]
    inputs = [tokens if cut is None else cut, mask, positions,
              *placeholders[3 + first : 3 + end], *placeholders[3 + L + first : 3 + L + end]]

    needed: set[Node] = set(inputs)
    stack = list(targets)
    while stack:  # what the targets read, back to the part's inputs; sizes are bound below
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if not is_shape_node(n):
            stack.extend(n.all_input_nodes)
    graph = Graph()
    env: dict[Node, Node] = {}
    for n in inputs:
        if n is cut:
            env[n] = graph.placeholder(HIDDEN)
            env[n].meta = {"val": n.meta["val"]}
        else:
            env[n] = graph.node_copy(n, env.__getitem__)
            env[n].meta = dict(n.meta)
    sizes = [(env[n], d, s.node.expr) for n in inputs for d, s in enumerate(n.meta["val"].shape)
             if isinstance(s, torch.SymInt)]

    def copy_shape(n: Node) -> Node:
        if all(a in env for a in n.all_input_nodes):
            return graph.node_copy(n, env.__getitem__)
        if n.target is aten.sym_size.int:
            expr = n.args[0].meta["val"].shape[n.args[1]].node.expr
            match = next(((p, d) for p, d, e in sizes if e == expr), None)
            if match is not None:
                return graph.call_function(aten.sym_size.int, match)
        raise ValueError(f"{n.name} reads a value outside layers {first}..{end - 1}")

    def resolve(a: Node) -> Node:
        if a not in env:
            env[a] = copy_shape(a)  # a shape node first read here
            env[a].meta = dict(a.meta)
        return env[a]

    for n in nodes:
        if n in env or n not in needed or n.op in ("placeholder", "output"):
            continue
        if is_shape_node(n):
            resolve(n)
            continue
        for a in n.all_input_nodes:
            if a not in env and is_shape_node(a):
                resolve(a)
        env[n] = graph.node_copy(n, env.__getitem__)
        env[n].meta = dict(n.meta)
    graph.output(tuple(env[t] for t in targets))
    graph._codegen = CodeGen()  # positional inputs
    graph.lint()
    root: dict[str, Any] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            try:
                root[n.target] = _attr(weights, n.target)
            except AttributeError:
                root[n.target] = _attr(whole, n.target)
    return GraphModule(root, graph)


def _attr(module: torch.nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)
