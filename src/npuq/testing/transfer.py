"""Copy calibrated observer state from one prepared graph to another of the same model.

The calibrate graph (T = ctx, no cache, dynamic batch/length) and the decode/prefill graphs
(fixed T, KV-cache inputs) are traces of the same module, so their nodes come in the same
order with the same ops and module paths. Two differences are allowed, both on the KV path:

- prefill/decode graphs have cache placeholders and cache concats ``cat([cache, new])``; a
  cache concat stands for its ``new`` input (it holds the same values plus the cache) and a
  cache placeholder for nothing: the quantizer derives both encodings from ``new``'s observer
  (derived observers hold no state and are not copied);
- a graph exported with dynamic shapes has extra symbolic-size nodes, which are skipped;
- data movers (view, transpose, slice, alias, to, ...) are not aligned: the two traces may
  differ there (``mask[:, 0:1]`` is a slice with a symbolic batch, an alias with a static
  one), and a data mover carries its input's values and shares its input's observer.

Every other pair must agree on node kind, target and module path, or :func:`align` raises:
copying encodings between graphs that are not the same computation would be silently wrong.
Observers are then paired by (partner of the observed node, distance from it, consumers),
and the state of each source observer is loaded into the destination observer. Observers
shared by several tensors are one instance; each destination instance must map to exactly
one source instance, or the graphs' sharing differs and :class:`GraphMismatch` is raised.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e import DerivedObserverOrFakeQuantize

from npuq.quant import graph as g
from npuq.quant.observers import is_observer


class GraphMismatch(AssertionError):
    """Two graphs that should be the same computation are not (a bug, not a user error)."""


def _derived(module: torch.nn.Module) -> bool:
    """Observers that hold no statistics of their own: their qparams come from other observers
    of the same graph (bias from input × weight, KV-cache input from the new entries)."""
    return isinstance(module, DerivedObserverOrFakeQuantize)


def _observer(gm: GraphModule, node: Node) -> torch.nn.Module | None:
    if node.op != "call_module":
        return None
    mod = gm.get_submodule(node.target)
    return mod if is_observer(mod) else None


def _skipped(node: Node) -> bool:
    """Nodes left out of the alignment: no computation of their own, or present in one graph only."""
    if node.op in ("output", "call_module"):
        return True
    if node.op == "call_function":
        if node.target in g.IGNORED or node.target in g.DATA_MOVERS or g.is_cache_concat(node):
            return True
        return not isinstance(node.meta.get("val"), torch.Tensor)  # symbolic sizes
    return False


def _signature(node: Node) -> tuple:
    if node.op == "call_function":
        return (node.op, str(node.target), g.module_path(node))
    return (node.op, str(node.target))


def _computing_nodes(gm: GraphModule) -> list[Node]:
    nodes, placeholders = [], 0
    for n in gm.graph.nodes:
        if _skipped(n):
            continue
        if n.op == "placeholder":
            placeholders += 1
            if placeholders > 3:
                continue  # cache inputs (after tokens, mask, positions)
        nodes.append(n)
    return nodes


def align(src: GraphModule, dst: GraphModule) -> dict[Node, Node]:
    """Map every computing node of ``dst`` to its counterpart in ``src`` (see module docstring).

    Data movers, observers and cache concats are not aligned: :func:`canonical` resolves them
    to the computing node whose values they carry.
    """
    n_src, n_dst = _computing_nodes(src), _computing_nodes(dst)
    if len(n_src) != len(n_dst):
        raise GraphMismatch(f"graphs differ in size: {len(n_src)} source nodes vs {len(n_dst)} destination nodes")
    mapping: dict[Node, Node] = {}
    for s, d in zip(n_src, n_dst):
        if _signature(s) != _signature(d):
            raise GraphMismatch(f"node {d.name} {_signature(d)} has no counterpart: source has {s.name} {_signature(s)}")
        mapping[d] = s
    return mapping


def canonical(gm: GraphModule, node: Node) -> Node:
    """The computing node whose values ``node`` carries: through observers, data movers and
    (for cache concats) the new entries."""
    while True:
        if _observer(gm, node) is not None or (node.op == "call_function" and node.target in g.DATA_MOVERS):
            node = node.args[0]
        elif g.is_cache_concat(node):
            node = node.args[0][1]
        else:
            return node


def _observer_nodes(gm: GraphModule) -> list[tuple[Node, Node, int]]:
    """(observer call node, canonical observed node, observer hops between them)."""
    out = []
    for node in gm.graph.nodes:
        if _observer(gm, node) is None:
            continue
        depth, src = 0, node.args[0]
        while _observer(gm, src) is not None:
            depth, src = depth + 1, src.args[0]
        out.append((node, canonical(gm, src), depth))
    return out


def _consumers(gm: GraphModule, obs_node: Node) -> set[Node]:
    """The computing ops reading an observer's output (through observers and data movers)."""
    found, stack = set(), list(obs_node.users)
    while stack:
        u = stack.pop()
        if _skipped(u) and u.op != "output":
            stack.extend(u.users)
        else:
            found.add(u)
    return found


def _format(observer: torch.nn.Module) -> tuple:
    return tuple(getattr(observer, a, None) for a in ("dtype", "quant_min", "quant_max", "qscheme"))


def pair_observers(src: GraphModule, dst: GraphModule) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(source observer, destination observer) instance pairs covering every dst observer."""
    mapping = align(src, dst)
    by_target: dict[tuple[Node, int], dict[int, Node]] = defaultdict(dict)
    for obs, node, depth in _observer_nodes(src):
        if not _derived(_observer(src, obs)):
            by_target[(node, depth)].setdefault(id(_observer(src, obs)), obs)

    chosen: dict[int, tuple[torch.nn.Module, torch.nn.Module]] = {}
    unmatched: list[Node] = []
    for obs, node, depth in _observer_nodes(dst):
        d_mod = _observer(dst, obs)
        if _derived(d_mod):
            continue  # recomputed from its graph's own observers at convert time
        if node not in mapping:
            unmatched.append(obs)
            continue
        cands = list(by_target.get((mapping[node], depth), {}).values())
        if len(cands) > 1:
            want = {mapping.get(u) for u in _consumers(dst, obs)}
            cands = [c for c in cands if _consumers(src, c) & want]
        if len(cands) > 1:  # one tensor observed in two formats (a requantization): pick the same format
            cands = [c for c in cands if _format(_observer(src, c)) == _format(d_mod)]
        if len(cands) != 1:
            raise GraphMismatch(f"observer {obs.name} of {node.name} has {len(cands)} candidate source observers")
        s_mod = _observer(src, cands[0])
        prev = chosen.get(id(d_mod))
        if prev is not None and prev[0] is not s_mod:
            raise GraphMismatch(f"observer {obs.name} of {node.name} maps to two different source observers")
        chosen[id(d_mod)] = (s_mod, d_mod)
    for obs in unmatched:
        if id(_observer(dst, obs)) not in chosen:
            raise GraphMismatch(f"observer {obs.name} of {obs.args[0].name} shares no observer with a matched tensor")
    return list(chosen.values())


def copy_observer_state(src: GraphModule, dst: GraphModule) -> int:
    """Load every dst observer with its source partner's statistics; returns the number copied."""
    pairs = pair_observers(src, dst)
    for s_mod, d_mod in pairs:
        if type(s_mod) is not type(d_mod):
            raise GraphMismatch(f"observer types differ: {type(s_mod).__name__} vs {type(d_mod).__name__}")
        d_mod.load_state_dict(s_mod.state_dict())
    return len(pairs)
