"""A bits-per-weight budget: each layer's weight format chosen from measured sensitivity
(``--bits-per-weight``, docs/design.md §15).

Every quantized weight (the linear layers, lm head included, and the embedding table) can take
one of a few formats (:data:`LINEAR_FORMATS`, :data:`EMBEDDING_FORMATS`). Its sensitivity to a
format is the Fisher-weighted output error of rounding it so, summed over the calibration
windows::

    s(layer, format) = ½ Σ_tokens Σ_outputs g² · Δz²

where Δz = x · ΔWᵀ is the change of the layer's output when only its weight is rounded to the
format (min/max scales, nearest rounding: what the observers give; SeqMSE and GPTQ shrink it
later) and g is the gradient of the windows' next-token loss with respect to that output (the
diagonal empirical Fisher, as BRECQ weights block outputs): ΔLoss ≈ s to second order. One
forward and backward per window measures every layer and format at once.

The layers' losses add up, so choosing formats is a knapsack: minimise Σ s subject to Σ bits ≤
B × parameters. :func:`allocate` solves it the convex-hull greedy way: each layer starts at its
cheapest format; the upgrade with the largest loss saved per bit that still fits is taken, and
the layer moves along the lower convex hull of its (bits, loss) points, until nothing fits.
"""

from __future__ import annotations

import heapq
import re
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch

from npuq.device import device_of
from npuq.errors import NpuqError
from npuq.models.decoder import in_part
from npuq.models.stream import StreamedDecoder
from npuq.optimize.seqmse import fake_quantize, lpbq_scale, minmax_scale
from npuq.quant.recipe import Recipe, Rule
from npuq.quant.schemes import PerBlock, get_scheme
from npuq.runtime.runner import step_inputs
from npuq.quant.size import (EMBEDDING, LINEAR, WeightTensor, layer_size, model_weights, recipe_layer_sizes,
                             total_size)

LINEAR_FORMATS = ("16a4w", "16a4w_block", "16a8w")  # 4-bit per channel, LPBQ, 8-bit per channel
EMBEDDING_FORMATS = ("pcq4", "pcq8", "shared")  # int4 / int8 per row, or the 16-bit activation format
RECIPE_FILE = "recipe.json"  # inside the artifact


@dataclass(frozen=True)
class Option:
    """One format of one layer: its size and measured sensitivity."""

    format: str
    bits: int  # code bits of the whole tensor
    loss: float


@dataclass(frozen=True)
class BudgetReport:
    """What ``--bits-per-weight`` chose (config.json's ``budget``)."""

    target_bits: float  # the budget: mean code bits per weight at most
    bits_per_weight: float  # of the choice
    estimated_loss: float  # Σ sensitivity of the chosen formats (nats, second-order estimate)
    tokens: int  # calibration tokens the sensitivity was measured on
    seconds: float
    formats: dict[str, int]  # weights per chosen format
    recipe_file: str = RECIPE_FILE

    def describe(self) -> str:
        counts = ", ".join(f"{n} {f}" for f, n in sorted(self.formats.items()))
        return (f"budget {self.target_bits:g} bits per weight: chose {self.bits_per_weight:.4f} ({counts}; estimated "
                f"loss {self.estimated_loss:.4g} nats on {self.tokens} tokens, {self.seconds:.1f} s)")


def formats_of(w: WeightTensor) -> tuple[str, ...]:
    """The formats ``w`` may take: LPBQ only where its blocks divide the input size."""
    if w.kind == EMBEDDING:
        return EMBEDDING_FORMATS
    block = get_scheme("16a4w_block").weight.granularity
    assert isinstance(block, PerBlock)
    return tuple(f for f in LINEAR_FORMATS if f != "16a4w_block" or w.cols % block.size == 0)


def rounded(weight: torch.Tensor, fmt: str, act_bits: int = 16) -> torch.Tensor:
    """``weight`` as format ``fmt`` stores it (min/max scales, nearest rounding), as float."""
    w = weight.detach().float()
    if fmt in ("pcq4", "pcq8"):
        bits = 4 if fmt == "pcq4" else 8
        return fake_quantize(w, minmax_scale(w, bits), bits)
    if fmt == "shared":  # the activation format: unsigned affine per tensor, range including 0
        levels = 2**act_bits - 1
        lo, hi = min(w.min().item(), 0.0), max(w.max().item(), 0.0)
        scale = max((hi - lo) / levels, 1e-12)
        zero = round(-lo / scale)
        return (torch.clamp(torch.round(w / scale) + zero, 0, levels) - zero) * scale
    weight_fmt = get_scheme(fmt).weight
    g = weight_fmt.granularity
    if isinstance(g, PerBlock):
        scale = lpbq_scale(w, weight_fmt.bits, g.size, g.scale_bits, weight_fmt.eps)
    else:
        scale = minmax_scale(w, weight_fmt.bits)
    return fake_quantize(w, scale, weight_fmt.bits)


class _Sensitivity:
    """The sensitivities of ``weights`` (module docstring), accumulated by hooks while a forward
    and backward run: :meth:`watching` attaches them to the modules of ``model`` named there."""

    def __init__(self, weights: Sequence[WeightTensor], act_bits: int) -> None:
        self.act_bits = act_bits
        self.sens = {w.path: dict.fromkeys(formats_of(w), 0.0) for w in weights}
        self.weights = {w.path: w for w in weights}

    @contextmanager
    def watching(self, model: Any, paths: Iterable[str]) -> Iterator[None]:
        modules = dict(model.named_modules())

        def delta(w: WeightTensor, fmt: str) -> torch.Tensor:
            """ΔW, made when needed (a few times the cost of reading the weight; holding every
            layer's for all windows would take three times the model)."""
            weight = modules[w.path].weight.detach()
            return rounded(weight, fmt, self.act_bits) - weight.float()

        def hook(w: WeightTensor):
            def accumulate(x: torch.Tensor, g: torch.Tensor) -> None:
                g2 = g.detach().float().square()
                for fmt in self.sens[w.path]:
                    d = delta(w, fmt)
                    dz = d[x] if w.kind == EMBEDDING else x.float() @ d.T
                    self.sens[w.path][fmt] += 0.5 * float((g2 * dz.square()).sum())

            def fn(_module, args, out):
                x = args[0].detach()
                if w.kind == EMBEDDING:  # the graph that needs gradients starts here
                    out = out.detach().requires_grad_()
                out.register_hook(lambda g: accumulate(x, g))
                return out

            return fn

        handles = [modules[p].register_forward_hook(hook(self.weights[p])) for p in paths]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


def _next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")


def measure_sensitivity(model: Any, rows: Iterable[torch.Tensor], weights: Sequence[WeightTensor],
                        act_bits: int = 16, parts: Sequence[tuple[int, int]] | None = None
                        ) -> tuple[dict[str, dict[str, float]], int]:
    """(layer path → format → sensitivity (module docstring), tokens scored) over ``rows``
    (1-D token windows) on the float ``model``, where it is; a StreamedDecoder is measured
    ``parts`` (first, end) at a time (:func:`_measure_streamed`; None: all its layers at once)."""
    sensitivity = _Sensitivity(weights, act_bits)
    if isinstance(model, StreamedDecoder):
        parts = parts or ((0, model.config.num_layers),)
        return sensitivity.sens, _measure_streamed(model, parts, rows, sensitivity)
    device = device_of(model)
    params = [p for p in model.parameters()]
    grads = [p.requires_grad for p in params]
    tokens = 0
    try:
        for p in params:
            p.requires_grad_(False)
        with sensitivity.watching(model, sensitivity.weights):
            for row in rows:
                ids = row.reshape(1, -1).to(device)
                if ids.shape[1] < 2:
                    continue
                with torch.enable_grad():
                    logits = model(*step_inputs(model.config, ids, 0, ids.shape[1]))[0]
                    _next_token_loss(logits, ids).backward()
                tokens += ids.shape[1] - 1
    finally:
        for p, g in zip(params, grads):
            p.requires_grad_(g)
    return sensitivity.sens, tokens


def _measure_streamed(model: StreamedDecoder, parts: Sequence[tuple[int, int]], rows: Iterable[torch.Tensor],
                      sensitivity: _Sensitivity) -> int:
    """Every window's forward and backward through a model read from disk ``parts`` at a time
    (each part read twice): a forward keeps the hidden states
    entering each part, then the parts run again last to first with gradients, each from the
    hidden states it took and back from the gradient the part after it returned, its weights
    watched meanwhile. The same ops as the whole model's forward and backward (the steps of
    npuq.models.stream), so the same sensitivities. Returns the tokens scored."""
    skeleton, cfg = model.skeleton, model.config
    ids = [row.reshape(1, -1) for row in rows if row.numel() >= 2]
    steps = [step_inputs(cfg, x, 0, x.shape[1]) for x in ids]
    extras = [skeleton.rope_and_masks(mask, positions) for _, mask, positions in steps]
    entering: list[list[torch.Tensor | None]] = [[None] * len(ids) for _ in parts]

    def run(first: int, end: int, r: int, h: torch.Tensor | None) -> torch.Tensor:
        if first == 0:
            h = skeleton.embed(ids[r])
        for i in range(first, end):
            h = skeleton.block(i, h, extras[r])[0]
        return h

    with torch.no_grad():
        for k, (first, end) in enumerate(parts[:-1]):
            with model.resident_part(first, end):
                for r in range(len(ids)):
                    entering[k + 1][r] = run(first, end, r, entering[k][r])
    grads: list[torch.Tensor | None] = [None] * len(ids)
    for k in reversed(range(len(parts))):
        first, end = parts[k]
        watched = [w.path for w in sensitivity.weights.values()
                   if (first == 0 if w.kind == EMBEDDING else in_part(w.path, first, end, cfg.num_layers))]
        with model.resident_part(first, end), sensitivity.watching(skeleton, watched):
            for r in range(len(ids)):
                with torch.enable_grad():
                    h = None if first == 0 else entering[k][r].requires_grad_()
                    out = run(first, end, r, h)
                    if end == cfg.num_layers:
                        _next_token_loss(skeleton.head(out), ids[r]).backward()
                    else:
                        out.backward(grads[r])
                grads[r] = None if first == 0 else h.grad
                entering[k][r] = None
    return sum(x.shape[1] - 1 for x in ids)


def lower_hull(options: Sequence[Option]) -> list[Option]:
    """The options on the lower convex hull of (bits, loss), cheapest first; a dearer option
    that does not lose less is dropped."""
    best: dict[int, Option] = {}
    for o in options:
        if o.bits not in best or o.loss < best[o.bits].loss:
            best[o.bits] = o
    hull: list[Option] = []
    for o in sorted(best.values(), key=lambda o: o.bits):
        if hull and o.loss >= hull[-1].loss:
            continue
        while len(hull) >= 2:  # the middle point lies on or above the chord: not on the hull
            a, b = hull[-2], hull[-1]
            if (b.loss - a.loss) * (o.bits - a.bits) >= (o.loss - a.loss) * (b.bits - a.bits):
                hull.pop()
            else:
                break
        hull.append(o)
    return hull


def allocate(options: dict[str, Sequence[Option]], budget_bits: float) -> dict[str, Option]:
    """One option per layer with Σ bits ≤ ``budget_bits`` and the least Σ loss the greedy walk
    along each layer's lower convex hull finds (module docstring)."""
    hulls = {path: lower_hull(opts) for path, opts in options.items()}
    at = {path: 0 for path in hulls}
    used = sum(h[0].bits for h in hulls.values())
    if used > budget_bits:
        raise NpuqError(f"the smallest formats already take {used} bits, more than the budget's {budget_bits:.0f}")
    heap: list[tuple[float, int, str]] = []

    def push(path: str) -> None:
        h, i = hulls[path], at[path]
        if i + 1 < len(h):
            saved = (h[i].loss - h[i + 1].loss) / (h[i + 1].bits - h[i].bits)
            heapq.heappush(heap, (-saved, len(heap), path))

    for path in hulls:
        push(path)
    while heap:
        _, _, path = heapq.heappop(heap)
        h, i = hulls[path], at[path]
        step = h[i + 1].bits - h[i].bits
        if used + step > budget_bits:
            continue  # does not fit: the rest of this layer's hull costs more per step
        used += step
        at[path] = i + 1
        push(path)
    return {path: hulls[path][at[path]] for path in hulls}


def choice_recipe(base: Recipe, choice: dict[str, str], weights: Sequence[WeightTensor], name: str) -> Recipe:
    """A recipe giving each weight its chosen format: the commonest linear format as the default,
    one exact-path rule per linear layer that differs, the table's mode as ``embedding``; the
    base's KV cache and rotation kept (:meth:`Recipe.with_formats`)."""
    linear = [w for w in weights if w.kind == LINEAR]
    counts = Counter(choice[w.path] for w in linear)
    default = max(LINEAR_FORMATS, key=lambda f: (counts.get(f, 0), -LINEAR_FORMATS.index(f)))
    rules = tuple(Rule(choice[w.path], op="linear", path=re.escape(w.path), priority=1)
                  for w in linear if choice[w.path] != default)
    embedding = next((choice[w.path] for w in weights if w.kind == EMBEDDING), "shared")
    return base.with_formats(default, rules, embedding, None, name)


def check_budget_base(base: Recipe) -> None:
    """The recipe ``--bits-per-weight`` starts from must have 16-bit activations, as every format it chooses."""
    if base.scheme.activation.bits != 16:
        raise NpuqError(f"--bits-per-weight chooses among 16-bit activation formats ({', '.join(LINEAR_FORMATS)}); "
                        f"the recipe {base.name!r} has {base.scheme.activation.bits}-bit activations: drop --scheme "
                        f"{base.default} or pick a 16a* scheme")


def budget_recipe(model: Any, base: Recipe, rows: Sequence[torch.Tensor], bits_per_weight: float, *,
                  progress: bool = False, parts: Sequence[tuple[int, int]] | None = None) -> tuple[Recipe, BudgetReport]:
    """The recipe whose weights take at most ``bits_per_weight`` code bits on average with the
    least measured loss (module docstring), and what it chose. ``base``: its KV cache and rotation
    are kept; its activations must be 16-bit (every format chosen from is a 16-bit activation one).
    A StreamedDecoder is measured ``parts`` at a time (:func:`measure_sensitivity`)."""
    check_budget_base(base)
    start = time.perf_counter()
    weights = model_weights(model.skeleton if isinstance(model, StreamedDecoder) else model)
    if not weights:
        raise NpuqError("--bits-per-weight: the model has no linear or embedding weights")
    params = sum(w.params for w in weights)
    smallest = total_size(layer_size(w, formats_of(w)[0]) for w in weights).bits_per_weight
    if bits_per_weight < smallest:
        raise NpuqError(f"--bits-per-weight {bits_per_weight:g} is below {smallest:g}, the smallest this model takes "
                        "(every weight at 4 bits)")
    if progress:
        print(f"budget: measuring each weight's sensitivity to {', '.join(LINEAR_FORMATS)} (embedding: "
              f"{', '.join(EMBEDDING_FORMATS)})", file=sys.stderr, flush=True)
    sens, tokens = measure_sensitivity(model, rows, weights, base.scheme.activation.bits, parts)
    options = {w.path: [Option(f, layer_size(w, f, base).bits, sens[w.path][f]) for f in formats_of(w)]
               for w in weights}
    chosen = allocate(options, bits_per_weight * params)
    choice = {path: o.format for path, o in chosen.items()}
    recipe = choice_recipe(base, choice, weights, f"budget-{bits_per_weight:g}")
    size = total_size(recipe_layer_sizes(recipe, weights))
    report = BudgetReport(
        target_bits=float(bits_per_weight), bits_per_weight=size.bits_per_weight,
        estimated_loss=sum(o.loss for o in chosen.values()), tokens=tokens, seconds=time.perf_counter() - start,
        formats=dict(sorted(Counter(("embedding:" if w.kind == EMBEDDING else "") + choice[w.path]
                                    for w in weights).items())),
    )
    if progress:
        print(report.describe(), file=sys.stderr, flush=True)
    return recipe, report

