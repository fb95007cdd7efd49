"""Per-layer quantization error: where in the network the quantized programs part from float.

The same tokens run through the float decoder and through the quantized programs, both driven
by :class:`npuq.runtime.runner.StaticRunner` with the same prefill chunks, and every linear
layer's output is compared:

- ``output_sqnr_db``: signal-to-quantization-noise ratio of the layer's output, 10·log10 of
  Σy² / Σ(ŷ − y)² over all tokens and channels. It includes the quantization of the layer's
  input activations and everything accumulated in earlier layers, so it falls with depth; a
  sharp drop marks the layer that does the damage.
- ``weight_sqnr_db``: the same ratio for the layer's weights alone (the dequantized weight
  constant of the program against the float weight): the error the weight grid adds.

In the programs a linear layer is the ``aten.linear`` node whose ``nn_module_stack`` names the
module, which is how the two sides are paired.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch
from torch.fx import GraphModule, Interpreter, Node

from npuq.data.corpora import corpus_tokens
from npuq.models.config import ModelConfig
from npuq.optimize.rotate import rotate_as
from npuq.quant.graph import attr_tensor
from npuq.runtime.context import ExecutionContext
from npuq.runtime.runner import PartChain, StaticRunner, release

LINEAR = torch.ops.aten.linear.default


@dataclass
class LayerError:
    path: str  # module path, e.g. "layers.3.mlp.down_proj"
    output_sqnr_db: float | None  # None: no difference at all
    weight_sqnr_db: float | None  # None: exact weights, or the weight is not a constant

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float | None:
    """10·log10(Σ ref² / Σ (approx − ref)²) in float64; None when the two are identical."""
    ref = reference.detach().double()
    noise = float(((approx.detach().double() - ref) ** 2).sum())
    signal = float((ref**2).sum())
    if noise == 0.0:
        return None
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def module_path(node: Node) -> str | None:
    """The innermost module path recorded for a node by torch.export."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return list(stack.values())[-1][0]


class _Recorder(Interpreter):
    """Runs a program and keeps every linear node's output, by module path, in call order."""

    def __init__(self, gm: GraphModule, outputs: dict[str, list[torch.Tensor]]):
        super().__init__(gm)
        self.outputs = outputs

    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.op == "call_function" and n.target is LINEAR:
            path = module_path(n)
            if path is not None:
                self.outputs.setdefault(path, []).append(result.detach())
        return result


def linear_weights(gm: GraphModule) -> dict[str, torch.Tensor]:
    """Module path → the (dequantized, constant) weight its linear node multiplies by."""
    weights = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is LINEAR:
            path, w = module_path(n), attr_tensor(gm, n.args[1])
            if path is not None and w is not None:
                weights[path] = w
    return weights


def layer_errors(
    model: torch.nn.Module,
    graphs: dict[int, GraphModule],
    cfg: ModelConfig,
    context: int,
    token_ids: Sequence[int],
) -> list[LayerError]:
    """Error of every linear layer of ``graphs`` (ar_len → quantized program) against the float
    ``model`` on ``token_ids``, in the programs' execution order.

    ``token_ids`` is cut to whole prefill chunks, so no padded position is compared.
    """
    prefill = max(graphs)
    ids = list(token_ids)[: max(prefill, len(token_ids) // prefill * prefill)]
    if len(ids) > context:
        ids = ids[: context // prefill * prefill or context]

    reference: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            hooks.append(module.register_forward_hook(
                lambda _m, _i, out, path=path: reference.setdefault(path, []).append(out.detach())))
    try:
        StaticRunner(cfg, {k: model for k in graphs}, context).feed(ids)
    finally:
        for h in hooks:
            h.remove()

    quantized: dict[str, list[torch.Tensor]] = {}
    StaticRunner(cfg, {k: _recording(g, quantized) for k, g in graphs.items()}, context).feed(ids)

    floats = dict(model.named_modules())
    weight_sqnr = {}
    for program in _parts(graphs[prefill]):  # one part read at a time (one read on demand is dropped after)
        for path, weight in linear_weights(_module(program)).items():
            weight_sqnr[path] = sqnr_db(floats[path].weight, weight)
        release(program)
    errors = []
    for path, outs in quantized.items():
        refs = reference.get(path)
        if refs is None or len(refs) != len(outs):
            raise ValueError(f"{path}: {len(outs)} quantized calls but {len(refs or [])} float ones")
        errors.append(LayerError(path, sqnr_db(torch.cat([r.flatten() for r in refs]),
                                               torch.cat([o.flatten() for o in outs])), weight_sqnr.get(path)))
    return errors


def _parts(program: Any) -> tuple[Any, ...]:
    return program.programs if isinstance(program, PartChain) else (program,)


def _module(program: Any) -> GraphModule:
    """The GraphModule a program runs (an artifact's part read on demand: read now)."""
    read = getattr(program, "graph_module", None)
    return program if read is None else read()


class _Recording:
    """A program (or a chain of parts, part by part) run by :class:`_Recorder`: what the runner
    calls, keeping every linear node's output in ``outputs``."""

    def __init__(self, program: Any, outputs: dict[str, list[torch.Tensor]]):
        self.program, self.outputs = program, outputs

    def __call__(self, *args: torch.Tensor) -> Any:
        return _Recorder(_module(self.program), self.outputs).run(*args)

    def release(self) -> None:
        release(self.program)


def _recording(program: Any, outputs: dict[str, list[torch.Tensor]]) -> Any:
    if isinstance(program, PartChain):
        return PartChain(program.layers, [_Recording(p, outputs) for p in program.programs], in_turn=program.in_turn,
                         residency=program.residency)  # the decode and prefill chains still decide together
    return _Recording(program, outputs)


def worst(errors: Sequence[LayerError], n: int = 5) -> list[LayerError]:
    """The ``n`` layers with the lowest weight SQNR (where the weight grid does the most damage)."""
    ranked = [e for e in errors if e.weight_sqnr_db is not None]
    return sorted(ranked, key=lambda e: e.weight_sqnr_db)[:n]


@dataclass(frozen=True)
class LayersOptions:
    """What the per-layer comparison runs on: the first ``tokens`` tokens of ``corpus``'s eval split."""

    corpus: str = "builtin"
    tokens: int = 32  # one prefill chunk of the default length


@dataclass(frozen=True)
class LayersInputs:
    tokenizer: Any
    model: torch.nn.Module  # the float model as loaded (left as it is)
    rotation: dict[str, Any] | None  # the RotationReport the quantize stage folded into the graphs' weights
    graphs: dict[int, GraphModule]  # ar_len → quantized program
    config: ModelConfig
    context: int


@dataclass(frozen=True)
class LayersResult:
    tokens: int
    layers: tuple[LayerError, ...]  # in the programs' execution order


def run_layers(options: LayersOptions, inputs: LayersInputs, ctx: ExecutionContext) -> LayersResult:
    """:func:`layer_errors` of the quantized graphs against the float model in their basis: with a
    rotation, against a rotated copy of the float model (same seed, so the same matrices); the
    float model given is never changed."""
    ids = corpus_tokens(inputs.tokenizer, options.corpus, options.tokens, split="eval")
    model = inputs.model
    if inputs.rotation:
        model = copy.deepcopy(model)
        rotate_as(model, inputs.rotation)
    with ctx.scope("prefill"):
        errors = layer_errors(model, inputs.graphs, inputs.config, inputs.context, ids)
    return LayersResult(len(ids), tuple(errors))
