"""Graph passes over converted PT2E programs: folding, specialisation and clean-up.

:func:`npuq.quantize.pt2e.quantize_model` converts its prepared graph with :func:`convert`
(torchao's ``convert_pt2e`` with the weight folding done here) and specialises the result to
the static programs a device runs (:func:`specialize`); the artifact writer folds the constant
dequantizations of those programs once (:func:`fold_constant_dequant`) and simplifies
Q/DQ chains (:func:`simplify_qdq`). Each pass takes a GraphModule and returns it (or a new
one); none reads the model or the recipe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Sequence

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import CodeGen
from torchao.quantization.pt2e.constant_fold import replace_node_with_constant
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

from npuq.calibrate.graphs import is_input_guard, is_shape_node
from npuq.quant.graph import DATA_MOVERS


_QUANTIZE_PER_CHANNEL = torch.ops.quantized_decomposed.quantize_per_channel.default
_QUANTIZE_PER_TENSOR = (torch.ops.quantized_decomposed.quantize_per_tensor.default,
                        torch.ops.quantized_decomposed.quantize_per_tensor.tensor)
_QUANT_OPS = (*_QUANTIZE_PER_TENSOR,
              _QUANTIZE_PER_CHANNEL,
              torch.ops.torchao.quantize_affine)
_DEQUANT_OPS = (torch.ops.quantized_decomposed.dequantize_per_channel.default,
                torch.ops.quantized_decomposed.dequantize_per_tensor.default,
                torch.ops.quantized_decomposed.dequantize_per_tensor.tensor,
                torch.ops.quantized_decomposed.convert_element_type.no_fuse,
                torch.ops.torchao.dequantize_affine)


def convert(prepared: GraphModule) -> GraphModule:
    """``convert_pt2e`` with its weight folding done by :func:`fold_quantized_constants`, which
    gives the same graph without computing what it then throws away, and without the tensors
    no node reads any more (:func:`drop_unused_tensors`).

    The result is a lazy GraphModule: its Python code is generated on its first call, and none
    is generated on the way (:func:`_codegen_deferred`)."""
    with _codegen_deferred():
        converted = convert_pt2e(prepared, fold_quantize=False)
        fold_quantized_constants(converted)
        converted = drop_unused_tensors(converted)
    return _LazyGraphModule(converted, converted.graph)


@contextlib.contextmanager
def _codegen_deferred() -> Iterator[None]:
    """No GraphModule generates its Python code inside: ``recompile`` does nothing.

    convert_pt2e and the folding after it would generate the code of the whole graph five times
    (after torchao's passes, in every GraphModule it builds, after the folding), 1.0 s of the
    2.5 s convert of SmolLM2-135M, and nothing runs these modules in between: only the graph is read,
    and the result is rebuilt as a lazy GraphModule. Deferring is safe as long as nothing calls
    a module built inside; the programs convert gives are checked bit for bit against torchao's
    own convert (tests/quant/test_quant_onegraph.py)."""
    real = GraphModule.recompile
    GraphModule.recompile = lambda self: None  # type: ignore[method-assign, assignment, return-value]
    try:
        yield
    finally:
        GraphModule.recompile = real  # type: ignore[method-assign]


def _row_blocks(x: torch.Tensor) -> Iterator[slice]:
    """Slices of ``x``'s first dimension of FOLD_ROWS_ELEMENTS elements or fewer (a row at least)."""
    step = max(1, FOLD_ROWS_ELEMENTS // max(1, x[0].numel()))
    for i in range(0, x.shape[0], step):
        yield slice(i, i + step)


def _quantize_per_tensor(x: torch.Tensor, scale: Any, zero_point: Any, quant_min: int, quant_max: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """``quantized_decomposed.quantize_per_tensor`` (``.default`` or ``.tensor``) of a float32
    constant, bit for bit: the same product by the Python float 1/scale, round half to even,
    zero point and clamp, each element on its own, so a block of rows at a time gives the same
    codes. Its memory is the result and one block's float temporary, where the op makes two
    float copies of the whole tensor besides the result (the 16-bit embedding table of a 1.5B
    model is 0.93 GB)."""
    if isinstance(scale, torch.Tensor) or isinstance(zero_point, torch.Tensor):
        if scale.numel() != 1 or zero_point.numel() != 1:  # the op's own error
            return _QUANTIZE_PER_TENSOR[1](x, scale, zero_point, quant_min, quant_max, dtype)
        scale, zero_point = scale.item(), zero_point.item()
    if x.dtype != torch.float32 or x.dim() == 0 or x.shape[0] == 0:
        return _QUANTIZE_PER_TENSOR[0](x, scale, zero_point, quant_min, quant_max, dtype)
    _QUANTIZE_PER_TENSOR[0](x[:1], scale, zero_point, quant_min, quant_max, dtype)  # the op's range checks
    inv_scale = 1.0 / scale
    out = torch.empty(x.shape, dtype=dtype)
    for rows in _row_blocks(x):
        block = x[rows] * inv_scale
        block.round_().add_(zero_point).clamp_(quant_min, quant_max)
        out[rows] = block
    return out


def _quantize_per_channel(x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, axis: int,
                          quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    """``quantized_decomposed.quantize_per_channel`` of a float32 weight, bit for bit (the same
    product by 1/scale, round half to even, zero point, clamp), a block of rows at a time, in
    place on that block's one float copy: half the time of the op, and besides the result only
    one block's temporary (an lm head's float copy was 0.93 GB on a 1.5B model)."""
    if x.dtype != torch.float32 or x.dim() == 0 or x.shape[0] == 0:
        return _QUANTIZE_PER_CHANNEL(x, scales, zero_points, axis, quant_min, quant_max, dtype)
    axis = axis % x.dim()
    shape = [1] * x.dim()
    shape[axis] = -1
    inv = (1.0 / scales).view(shape)
    zps = zero_points.view(shape)
    out = torch.empty(x.shape, dtype=dtype)
    for rows in _row_blocks(x):
        block = x[rows] * (inv[rows] if axis == 0 else inv)
        block.round_().add_(zps[rows] if axis == 0 else zps).clamp_(quant_min, quant_max)
        out[rows] = block
    return out


_FOLDERS = {_QUANTIZE_PER_CHANNEL: _quantize_per_channel,
            **{op: _quantize_per_tensor for op in _QUANTIZE_PER_TENSOR}}


def fold_quantized_constants(gm: GraphModule) -> None:
    """What ``convert_pt2e(fold_quantize=True)`` does last (torchao's ``constant_fold`` with its
    quantize-op constraint), computing only what it keeps: every quantize op whose input is
    constant (a weight, possibly through pure ops) and whose result a non-constant node reads is
    replaced by its integer result (``_frozen_param<i>``, in graph order, as torchao names them),
    and what no node reads any more is removed. Dequantize ops stay in the graph, as there.
    torchao's folder also runs each weight's dequantize (about a third of a convert), only to
    decide not to fold it."""
    graph = gm.graph
    constant: set[Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            constant.add(node)
        elif (node.op == "call_function" and node.target not in _DEQUANT_OPS and node.all_input_nodes
              and all(a in constant for a in node.all_input_nodes)
              and not (isinstance(node.target, torch._ops.OpOverload)
                       and torch.Tag.nondeterministic_seeded in node.target.tags)):
            constant.add(node)
    frontier = [n for n in graph.nodes if n in constant and n.op == "call_function" and n.target in _QUANT_OPS
                and any(u not in constant for u in n.users)]
    values: dict[Node, Any] = {}

    def value(node: Node) -> Any:
        if node not in values:
            if node.op == "get_attr":
                obj: Any = gm
                for atom in node.target.split("."):
                    obj = getattr(obj, atom)
                values[node] = obj
            else:
                args = torch.fx.node.map_arg(node.args, value)
                kwargs = torch.fx.node.map_arg(node.kwargs, value)
                fn = _FOLDERS.get(node.target, node.target) if not kwargs else node.target
                values[node] = fn(*args, **kwargs)
        return values[node]

    with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
        for node in frontier:
            replace_node_with_constant(gm, node, value(node))
            values.clear()  # each weight is read once: keep memory to one weight at a time
    for node in list(graph.find_nodes(op="get_attr")):
        if not node.users:
            if hasattr(gm, node.target):
                delattr(gm, node.target)
            graph.erase_node(node)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def specialize(gm: GraphModule, inputs: Sequence[torch.Tensor]) -> GraphModule:
    """A static program of ``gm`` (a graph with symbolic sizes) for inputs shaped like ``inputs``.

    Every symbolic size is bound from the inputs' shapes; the nodes that compute sizes become the
    numbers they compute, size checks are checked here and dropped, and every other node is
    copied as it is (same op, same name, the same weights: nothing is copied but the graph), so
    the program computes exactly what ``gm`` computes on such inputs, and exactly what a graph
    traced at these static shapes computes. The inputs are plain positional tensors
    (tokens, mask, positions, K caches, V caches) and every node's ``meta["val"]`` is a meta
    tensor of its static shape and dtype (what the lowering reads).
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise ValueError(f"{len(inputs)} inputs for a graph of {len(placeholders)}")
    bindings: dict[Any, int] = {}
    for node, x in zip(placeholders, inputs):
        val = node.meta["val"]
        if val.dim() != x.dim():
            raise ValueError(f"input {node.name} has {x.dim()} dimensions, the graph's {val.dim()}")
        for d, size in zip(val.shape, x.shape):
            if isinstance(d, torch.SymInt) and d.node.expr.is_Symbol:
                if bindings.setdefault(d.node.expr, int(size)) != int(size):
                    raise ValueError(f"input {node.name}: size {d} is {bindings[d.node.expr]} elsewhere, {size} here")

    def concrete(value: Any) -> Any:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = value.node.expr.xreplace(bindings)
            if not isinstance(expr, (int, bool)) and not (expr.is_number or expr.is_Boolean and not expr.free_symbols):
                raise ValueError(f"size {value} is not fixed by the inputs' shapes")
            kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)]
            return kind(expr)
        return value

    for node, x in zip(placeholders, inputs):
        if tuple(concrete(d) for d in node.meta["val"].shape) != tuple(x.shape):
            raise ValueError(f"input {node.name} of shape {tuple(x.shape)} does not fit the graph's "
                             f"{tuple(node.meta['val'].shape)}")

    static = Graph()
    env: dict[Node, Any] = {}
    for node in gm.graph.nodes:
        if is_input_guard(node):
            continue
        if is_shape_node(node):
            if node.target == torch.ops.aten._assert_scalar.default:
                check = node.args[0]
                holds = concrete(check.meta["val"]) if isinstance(check, Node) else check
                if not holds:
                    raise ValueError(f"the inputs' shapes fail the graph's check {node.args[1:]}")
            elif node.meta.get("val") is not None:
                env[node] = concrete(node.meta["val"])
            continue
        if node.op == "output":
            outputs = node.args[0]
            static.output(tuple(env[a] for a in outputs) if isinstance(outputs, (list, tuple)) else env[outputs])
            continue
        copy = static.node_copy(node, env.__getitem__)
        val = node.meta.get("val")
        copy.meta.pop("val", None)
        if isinstance(val, torch.Tensor):
            copy.meta["val"] = torch.empty(tuple(concrete(d) for d in val.shape), dtype=val.dtype, device="meta")
        env[node] = copy

    static._codegen = CodeGen()  # plain positional inputs and a tuple of outputs
    # Lazy: its Python code is generated on the first call, not here (a quantize that only
    # saves the programs never calls them; generating the code costs ~0.2 s per program).
    program = _LazyGraphModule(gm, static)
    set_static_meta(program)
    return program


_DEQUANTIZE_DTYPE_KWARGS = ("out_dtype", "output_dtype")


def set_static_meta(gm: GraphModule) -> None:
    """Give every get_attr and call_function node of a static graph ``meta["val"]``, an empty
    tensor on the meta device with the node's shape and dtype, from the placeholders' (which
    must have one): quantize/dequantize ops keep their input's shape and take the dtype they
    name; other ops get one from the op's meta kernel (no data is touched). Nodes it cannot work out keep none (the lowering then
    propagates shapes itself). Nodes that have a tensor val already keep it."""
    graph = gm.graph

    def meta_of(arg: Any) -> Any:
        if isinstance(arg, Node):
            val = arg.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise LookupError(arg.name)
            return val
        if isinstance(arg, (list, tuple)):
            return type(arg)(meta_of(a) for a in arg)
        if isinstance(arg, dict):
            return {k: meta_of(v) for k, v in arg.items()}
        return arg

    for node in graph.nodes:
        if isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if node.op == "get_attr":
            t = gm
            for atom in node.target.split("."):
                t = getattr(t, atom)
            if isinstance(t, torch.Tensor):
                node.meta["val"] = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
            continue
        if node.op != "call_function":
            continue
        name = str(node.target)
        try:
            if "quantize" in name and isinstance(node.args[0], Node):
                x = meta_of(node.args[0])
                if "dequantize" in name:
                    dtype = next((node.kwargs[k] for k in _DEQUANTIZE_DTYPE_KWARGS if node.kwargs.get(k)), torch.float32)
                else:
                    dtype = next(a for a in node.args[1:] if isinstance(a, torch.dtype))
                node.meta["val"] = torch.empty(tuple(x.shape), dtype=dtype, device="meta")
                continue
            with torch.no_grad():
                out = node.target(*meta_of(node.args), **meta_of(dict(node.kwargs)))
        except (LookupError, StopIteration, RuntimeError, TypeError, ValueError, NotImplementedError):
            node.meta.pop("val", None)
            continue
        if isinstance(out, torch.Tensor):
            node.meta["val"] = torch.empty(tuple(out.shape), dtype=out.dtype, device="meta")
        else:
            node.meta.pop("val", None)


def fold_constant_dequant(gm: GraphModule, cache: dict[Any, Any] | None = None) -> GraphModule:
    """Replace every quantize or dequantize op whose inputs are all constants (integer weights
    and their scales; the float weights of LPBQ layers, which convert leaves to be quantized at
    every call) by its result, computed once, in graph order, so a chain folds to its end. The
    numbers are unchanged; a CPU simulation then skips (de)quantizing every weight at every call
    (most of a prefill call's time).

    ``cache`` (shared by programs over the same weight tensors, such as an artifact's decode
    and prefill) keeps each result, keyed by the op and the identity of the tensors it reads,
    so a weight read by several programs is dequantized, and held in memory, once."""
    graph = gm.graph
    cache = {} if cache is None else cache
    for node in list(graph.nodes):
        if node.op != "call_function" or "quantize" not in str(node.target):
            continue
        if not node.all_input_nodes or any(a.op != "get_attr" for a in node.all_input_nodes):
            continue

        def value(arg):
            if isinstance(arg, torch.fx.Node):
                obj = gm
                for part in arg.target.split("."):
                    obj = getattr(obj, part)
                return obj
            if isinstance(arg, (list, tuple)):
                return type(arg)(value(a) for a in arg)
            return arg

        args, kwargs = value(node.args), {k: value(v) for k, v in node.kwargs.items()}
        key = (node.target, _identity(args), _identity(kwargs))
        if key not in cache:
            with torch.no_grad():  # the inputs are kept with the result: no other tensor can take their ids
                cache[key] = (_in_rows(node.target, args, kwargs).detach().contiguous(), args, kwargs)
        result = cache[key][0]
        name = f"_folded_{node.name}"
        gm.register_buffer(name, result)
        with graph.inserting_before(node):
            const = graph.get_attr(name)
        const.meta = dict(node.meta)
        node.replace_all_uses_with(const)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()
    return drop_unused_tensors(gm)


_DQ_CHANNEL = torch.ops.quantized_decomposed.dequantize_per_channel.default
FOLD_ROWS_ELEMENTS = 1 << 24  # a dequantize of more elements is computed a block of rows at a time


def _in_rows(target: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``target(*args, **kwargs)``; a per-tensor or per-row (axis 0) dequantize of a large weight
    a block of rows at a time, into one output: each element goes through the same subtraction
    and multiplication, so the values are the same, without the op's whole-tensor temporaries
    (a 152064 x 3584 head or embedding: several 2.2 GB float32 copies at once)."""
    codes = args[0] if args else None
    rowwise = target is _DQ or (target is _DQ_CHANNEL and args[3] == 0)
    if not rowwise or not isinstance(codes, torch.Tensor) or codes.dim() < 2 or codes.numel() <= FOLD_ROWS_ELEMENTS:
        return target(*args, **kwargs)
    per_row = target is _DQ_CHANNEL  # its scales and zero points are sliced with the rows

    def block(rows: slice) -> torch.Tensor:
        rest = [a[rows] if per_row and i < 2 and isinstance(a, torch.Tensor) else a for i, a in enumerate(args[1:])]
        return target(codes[rows], *rest, **kwargs)

    step = max(1, FOLD_ROWS_ELEMENTS // codes[0].numel())
    first = block(slice(0, step))
    out = torch.empty((codes.shape[0], *first.shape[1:]), dtype=first.dtype)
    out[:step] = first
    for start in range(step, codes.shape[0], step):
        out[start : start + step] = block(slice(start, start + step))
    return out


def _identity(value: Any) -> Any:
    """A hashable key of an op's arguments: tensors by identity, everything else by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, tuple)):
        return tuple(_identity(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _identity(v)) for k, v in value.items()))
    return value


_Q = torch.ops.quantized_decomposed.quantize_per_tensor.default
_DQ = torch.ops.quantized_decomposed.dequantize_per_tensor.default
_CODE_RANGE = 1 << 21  # codes whose dequantized value re-quantizes to itself (see simplify_qdq)


def _qparams(node: Node) -> tuple | None:
    """(scale, zero point, qmin, qmax, dtype) of a per-tensor q/dq node with plain arguments."""
    params = tuple(node.args[1:6])
    if len(params) != 5 or not all(isinstance(p, (int, float)) for p in params[:4]) or not isinstance(params[4], torch.dtype):
        return None
    if node.target is _DQ and node.kwargs.get("out_dtype") not in (None, torch.float32):
        return None
    return params


def _float32(node: Any) -> bool:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == torch.float32


def simplify_qdq(gm: GraphModule) -> GraphModule:
    """Make a converted program cheaper to simulate on a CPU without changing a single bit of
    what it computes from finite inputs (NaN aside). In a converted PT2E graph every activation
    goes through ``quantize_per_tensor`` → ``dequantize_per_tensor``, two ops implemented in
    Python (about 4,000 calls per SmolLM2 prefill call, most of its time). Here:

    1. dequantize nodes that read the same quantize node with the same parameters (PT2E gives
       every consumer its own) are merged into one;
    2. a quantize → dequantize pair whose input already lies on its grid is dropped: the input
       is a dequantize with the same parameters, through ops that only move values (views,
       transposes, slices, same-dtype casts, concats of such inputs). A code c dequantizes to
       v = fl((c - zp) · s), and fl(v · fl(1/s)) is within 3·2^-24·|c - zp| of c - zp, so it
       rounds back to c as long as the code range is below 2^21 (16-bit codes are): the pair
       gives v again;
    3. every other pair becomes five in-place aten ops on one temporary,
       ``t = x * (1/s); t.round_(); t.clamp_(qmin - zp, qmax - zp); t.mul_(s); t.add_(0.0)``:
       the same float32 operations as the pair (its integer round trip is exact), with the zero
       point folded into the bounds and ``+ 0.0`` turning the -0.0 a negative value that rounds
       to zero would give into the +0.0 the pair gives;
    4. ``_assert_tensor_metadata`` checks (the export's record of dtypes and devices) are dropped.

    Only for running: the lowering reads the q/dq structure, so programs are saved and exported
    as converted. ``tests/quant/test_quant_onegraph.py`` compares the logits bit for bit."""
    aten = torch.ops.aten
    graph = gm.graph
    for node in list(graph.nodes):  # 4.
        if node.op == "call_function" and node.target == aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)

    for node in list(graph.nodes):  # 1.
        if node.op != "call_function" or node.target is not _Q:
            continue
        kept: dict[Any, Node] = {}
        for user in list(node.users):
            if user.target is _DQ and user.args[0] is node and _qparams(user) is not None:
                key = (_qparams(user), tuple(sorted(user.kwargs.items(), key=lambda kv: kv[0])))
                if key in kept:
                    user.replace_all_uses_with(kept[key])
                    graph.erase_node(user)
                else:
                    kept[key] = user

    movers = {t for t in g_data_movers() if t not in (aten._to_copy.default,)}
    grid: dict[Node, tuple] = {}  # nodes whose float32 values lie on a grid (scale, zp, qmin, qmax, dtype)
    for node in graph.nodes:  # 2.
        if node.op != "call_function":
            continue
        if node.target is _DQ and _qparams(node) is not None:
            grid[node] = _qparams(node)
        elif node.target in movers and isinstance(node.args[0], Node) and node.args[0] in grid and _float32(node):
            grid[node] = grid[node.args[0]]
        elif node.target == aten.cat.default:
            grids = {grid.get(a) for a in node.args[0]}
            if len(grids) == 1 and None not in grids and _float32(node):
                grid[node] = grids.pop()
        if node.target is _Q and _qparams(node) is not None:
            params = _qparams(node)
            source = node.args[0]
            if grid.get(source) != params or params[3] - params[2] >= _CODE_RANGE or not _float32(source):
                continue
            for user in list(node.users):
                if user.target is _DQ and _qparams(user) == params and not user.kwargs.get("out_dtype"):
                    user.replace_all_uses_with(source)
                    graph.erase_node(user)
            if not node.users:
                graph.erase_node(node)

    for node in list(graph.nodes):  # 3.
        if node.op != "call_function" or node.target is not _Q or _qparams(node) is None:
            continue
        params = _qparams(node)
        scale, zp, qmin, qmax, _ = params
        users = list(node.users)
        if (not users or not _float32(node.args[0]) or qmax - qmin >= _CODE_RANGE
                or any(u.target is not _DQ or _qparams(u) != params or u.kwargs.get("out_dtype") for u in users)):
            continue
        with graph.inserting_before(node):
            t = graph.call_function(aten.mul.Tensor, (node.args[0], 1.0 / scale))
            t = graph.call_function(aten.round_.default, (t,))
            t = graph.call_function(aten.clamp_.default, (t, qmin - zp, qmax - zp))
            t = graph.call_function(aten.mul_.Tensor, (t, float(scale)))
            t = graph.call_function(aten.add_.Tensor, (t, 0.0))
        t.meta = dict(users[0].meta)
        for user in users:
            user.replace_all_uses_with(t)
            graph.erase_node(user)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def g_data_movers() -> set:
    return set(DATA_MOVERS) | {torch.ops.aten.alias.default}


def _constant(gm: torch.nn.Module, target: str) -> Any:
    """The attribute a get_attr target names (a dotted path, walked one name at a time)."""
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def drop_unused_tensors(gm: GraphModule) -> GraphModule:
    """Delete parameters and buffers no get_attr reads: after convert the float weights are
    replaced by folded integer constants but stay attached, and an export would save both."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, _ in named:
        if name in used:
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if hasattr(owner, attr):
            delattr(owner, attr)
    return gm
