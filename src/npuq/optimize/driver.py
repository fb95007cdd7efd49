"""Apply SeqMSE and GPTQ to every quantized linear layer of a float StaticDecoder.

The driver works on the float model before export: it walks the decoder block by block on the
calibration windows' cached hidden states, collects each layer's input Gram matrix XᵀX (layers
that read the same tensor, q/k/v and gate/up, share one), searches the scales and rounds the
weights layer by layer, and writes the rounded weights back as float values that lie exactly on
the chosen grid. The returned scales are what the PT2E weight observers must report, so the
artifact carries exactly these integers (per-channel or per-block int4/int8, unchanged format).

The walk takes the whole model at once or a part (a run of blocks) at a time, in order, so a
model streamed from disk needs only the part walked in memory; the parts give the whole walk's
Grams, scales and codes, because every block sees the same inputs either way.

Everything runs where the model is (Gram matrices, search, rounding); the windows move there.
The returned scales and codes are CPU tensors, whatever device computed them.

Layer inputs come from the float model (``inputs="float"``: a block's Grams from one run of it,
before any of its layers is rounded) or from the model being quantized (``inputs="quantized"``,
as GPTQ's reference code does): within a block group by group (q/k/v, o, gate/up, down, then
the lm head after the last block), so each group's Gram matrix is collected after every group
before it has been rounded and written back. Each window's state is carried from one group's
input to the next through the decoder's own steps, so the whole walk costs one forward of the
model per window in either mode (one more, of the float model, with "asymmetric").

``inputs="asymmetric"`` (GPTAQ's asymmetric calibration, Li et al. 2025) fits each layer's
quantized output on the quantized model's inputs X̃ to the float layer's output on the float
model's inputs X: min_Q ||X Wᵀ - X̃ Qᵀ||². The walk then carries the float model's hidden states
beside the quantized ones and gives each group the shift (X - X̃)ᵀ X̃ besides H = X̃ᵀ X̃. Since
||X Wᵀ - X̃ Qᵀ||² = const + (W* - Q) H (W* - Q)ᵀ row by row, with W* = W + W (X - X̃)ᵀ X̃ H⁻¹ the
least-squares target, SeqMSE and GPTQ run unchanged on W* and H (:func:`asymmetric_target`
damps H strongly: a few thousand calibration tokens do not pin every direction of it).
Where no layer before has been rounded (X = X̃), W* = W and the result is the "quantized" one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from npuq.device import device_of
from npuq.errors import NpuqError
from npuq.models.decoder import in_part
from npuq.optimize.gptq import GptqOptions, damped
from npuq.optimize.seqmse import (
    GRANULARITIES,
    GramFactor,
    dequantize,
    fake_quantize,
    lpbq_scale,
    minmax_scale,
    quantize_codes,
    seq_mse_search,
)
from npuq.runtime.runner import step_inputs

ROUNDINGS = ("nearest", "gptq")
INPUTS = ("float", "quantized", "asymmetric")
MAX_BITS = 8  # codes are int8; wider weights (16-bit) round with an error far below 16-bit activations'


@dataclass(frozen=True)
class RecoveryOptions:
    """SeqMSE and GPTQ over a whole model; each field is the ``npuq quantize`` flag of the same
    name (``gptq``: its GPTQ flags). Checked once, on construction, where the defaults are filled
    in: layer inputs "quantized" (each layer sees the rounding of all before it), and GPTQ's own
    defaults (:class:`GptqOptions`) with GPTQ rounding."""

    seq_mse: int | None = None  # candidate scales per weight; None: min/max scales
    seq_mse_granularity: str = "channel"
    weight_rounding: str = "nearest"
    layer_inputs: str | None = None  # None: "quantized"
    gptq: GptqOptions | None = None  # with weight_rounding "gptq" only; None: GptqOptions()

    def __post_init__(self) -> None:
        if self.seq_mse is not None and self.seq_mse < 1:
            raise NpuqError(f"--seq-mse {self.seq_mse}: the number of candidate scales must be at least 1 "
                            "(the published default is 50)")
        if self.seq_mse_granularity not in GRANULARITIES:
            raise NpuqError(f"--seq-mse-granularity {self.seq_mse_granularity!r}: choose one of "
                            f"{', '.join(sorted(GRANULARITIES))}")
        if self.weight_rounding not in ROUNDINGS:
            raise NpuqError(f"--weight-rounding {self.weight_rounding!r}: choose one of {', '.join(ROUNDINGS)}")
        if self.layer_inputs is not None and self.layer_inputs not in INPUTS:
            raise NpuqError(f"--layer-inputs {self.layer_inputs!r}: choose one of {', '.join(INPUTS)}")
        if self.layer_inputs is not None and not self.recovers:
            raise NpuqError(f"--layer-inputs {self.layer_inputs} chooses what SeqMSE and GPTQ fit to, and neither "
                            "is on: add --seq-mse N and/or --weight-rounding gptq, or drop --layer-inputs")
        if self.gptq is not None and self.weight_rounding != "gptq":
            raise NpuqError("GPTQ's options apply to --weight-rounding gptq only")
        object.__setattr__(self, "layer_inputs", self.layer_inputs or "quantized")
        if self.weight_rounding == "gptq" and self.gptq is None:
            object.__setattr__(self, "gptq", GptqOptions())

    @property
    def recovers(self) -> bool:
        """SeqMSE or GPTQ is on."""
        return self.seq_mse is not None or self.weight_rounding != "nearest"


@dataclass(frozen=True)
class WeightSpec:
    """How one linear layer's weight is quantized: symmetric, ``bits`` wide, per channel or block.

    ``scale_bits`` set: LPBQ blocks, whose scales follow the backend's rule from the float
    weights (:func:`lpbq_scale`, floor ``eps``); SeqMSE then searches one multiplier of each
    channel's base scale (the LPBQ form is kept).
    """

    bits: int
    block_size: int | None = None
    scale_bits: int | None = None
    eps: float = 0.0

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= MAX_BITS:
            raise ValueError(f"weight bits must be 2..{MAX_BITS} (int8 codes), got {self.bits}")


@dataclass(frozen=True)
class OptimizedWeight:
    scale: torch.Tensor  # (O,) or (O, I / block_size)
    codes: torch.Tensor  # (O, I) int8, in [-qmax, qmax]
    loss_minmax: float  # calibration output error with min/max scales and nearest rounding
    loss: float  # the same error after optimisation


GRAM_ROWS = 4096  # input rows per float32 product of the Gram sums


def _add_products(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """total + aᵀb (float64; a new sum where total is None) for a few windows' rows a, b:
    multiplied in float32, summed in float64. Up to GRAM_ROWS rows lose ~3e-7 of the sum's
    largest entry in float32 (2e-7 for one window's 512); float64 products took 33 s of a profiled
    Qwen2.5-Coder-0.5B recovery, most of it on the 4864-wide down-projection inputs."""
    product = a.T @ b
    return product.double() if total is None else total.add_(product)


def _row_batches(xs: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The windows' rows, joined into batches of up to GRAM_ROWS rows (a window is never split):
    one product per 4096 rows instead of one per window took Qwen2.5-Coder-0.5B's 4864-wide Gram
    of 8 windows of 512 from 2.6 s to 1.4 s (fewer float64 additions; a deeper product)."""
    batch: list[torch.Tensor] = []
    rows = 0
    for x in xs:
        if batch and rows + len(x) > GRAM_ROWS:
            yield torch.cat(batch) if len(batch) > 1 else batch[0]
            batch, rows = [], 0
        batch.append(x)
        rows += len(x)
    if batch:
        yield torch.cat(batch) if len(batch) > 1 else batch[0]


Step = Callable[[dict], torch.Tensor]  # a window's state → the next group's input (updating the state)


def _block_steps(model: nn.Module, i: int) -> tuple[list[tuple[list[nn.Module], Step]], Callable[[dict], None]]:
    """Block ``i`` of a StaticDecoder as its groups of linear layers in the order the forward
    reads them (layers reading one tensor form a group), each with the step that computes the
    group's input from a window's state (``h`` the block input, ``x`` the previous group's
    input, ``rope`` the block's cos, sin and mask), and the step that writes the block output
    into ``h``. The steps are the decoder's own, DecoderLayer.forward's calls in its order, so
    each group's input is what a whole forward gives it with the groups before as they are."""
    layer = model.layers[i]
    attn, mlp = layer.self_attn, layer.mlp

    def mlp_input(st):
        st["h"] = layer.add_attention(st["h"], attn.o_proj(st["x"]))
        return layer.mlp_norm(st["h"])

    def output(st):
        st["h"] = layer.add_mlp(st["h"], mlp.down_proj(st["x"]))

    return ([([attn.q_proj, attn.k_proj, attn.v_proj], lambda st: layer.input_layernorm(st["h"])),
             ([attn.o_proj], lambda st: attn.heads(st["x"], *st["rope"])[0]),
             ([mlp.gate_proj, mlp.up_proj], mlp_input),
             ([mlp.down_proj], lambda st: mlp.hidden(st["x"]))], output)


def _inputs(states: list[dict], step: Step) -> list[torch.Tensor]:
    """``step`` on every window's state, its result kept as the state's "x"; returns each
    window's result as (tokens, I) float32 rows (views of it where it already is float32)."""
    xs = []
    with torch.no_grad():
        for st in states:
            x = st["x"] = step(st)
            xs.append(x.reshape(-1, x.shape[-1]).float())
    return xs


def _sums(xs: list[torch.Tensor], reference: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Gram X̃ᵀX̃ of the windows' inputs ``xs`` and, given each window's float input X
    (``reference``), the shift (X - X̃)ᵀX̃, else None; float64."""
    gram = shift = None
    references = None if reference is None else _row_batches(reference)  # batched as xs are
    for x in _row_batches(xs):
        gram = _add_products(gram, x, x)
        if references is not None:
            shift = _add_products(shift, next(references) - x, x)
    return gram, shift


class LayerWalk:
    """The layers' input Gram matrices, collected walking a StaticDecoder block by block on the
    calibration windows' cached hidden states: over the whole model at once, or part by part
    (layers first … end - 1, the parts in order), so that only the part walked needs its
    weights (a model streamed from disk: npuq.quantize.pt2e.quantize_model's ``recover``).

    The windows enter through the model's own steps (embed, RoPE tables and masks, each block in
    the steps of :func:`_block_steps`, the head), so every layer sees exactly what the model's
    forward gives it. A block's groups (q/k/v, o, gate/up, down) come in that order, each with
    the Gram of its input over all windows. ``inputs`` "float": all of a block's groups are
    collected before the caller rounds any, and the next block takes the float block's outputs
    (every Gram the float model's). "quantized": each group is collected after the groups
    before it were rounded and written back (the caller does that between groups), every
    window's state carried from one group's step to the next, so a block costs one forward per
    window (re-running the block up to each group's input cost ~2.5; Qwen2.5-Coder-0.5B: ~80 s
    of a 396 s recovery). "asymmetric": as "quantized", and before the block's first group is
    rounded one float run of the block on the float model's hidden states (kept beside the
    quantized ones) records every group's float input, whose shift from the quantized input
    comes with the group. The lm head comes after the last block, on its output.
    """

    def __init__(self, windows: list[torch.Tensor], inputs: str) -> None:
        if inputs not in INPUTS:
            raise ValueError(f"layer inputs {inputs!r}: choose one of {', '.join(INPUTS)}")
        self.windows, self.inputs = windows, inputs
        self.states: list[dict] = []  # per window: "h" hidden states, "extra" RoPE tables and masks, ...
        self.float_states: list[dict] = []  # "asymmetric": the float model's
        self.next = 0  # the first layer of the next part

    def groups(self, model: nn.Module, first: int, end: int,
               names: list[str]) -> Iterator[tuple[list[str], torch.Tensor, torch.Tensor | None]]:
        """Yield (group of layers, Gram (I, I) float32, shift (I, I) float64 or None) of ``names``,
        the layers of blocks first … end - 1 (and of the head where ``end`` is the last block's),
        in execution order; the shift only with inputs "asymmetric"."""
        L = model.config.num_layers
        if first != self.next or not first < end <= L:
            raise ValueError(f"layers {first}..{end - 1}: the walk is at layer {self.next} of {L}")
        inside = {n for n in names if in_part(n, first, end, L)}
        if len(inside) != len(names):
            raise ValueError(f"not in layers {first}..{end - 1}: {', '.join(sorted(set(names) - inside)[:3])}")
        name_of = {id(m): n for n, m in model.named_modules() if n in inside}
        plan = [(i, *_block_steps(model, i)) for i in range(first, end)]
        if end == L:
            plan.append((None, [([model.lm_head], lambda st: model.norm(st["h"]))], None))
        reached = {name_of[id(m)] for _, steps, _ in plan for group, _ in steps for m in group if id(m) in name_of}
        if reached != inside:
            raise ValueError("not a block's q/k/v/o/gate/up/down projection nor the lm head: "
                             + ", ".join(sorted(inside - reached)[:3]))
        if first == 0:
            device = device_of(model.embed_tokens)
            self.states = []
            with torch.no_grad():
                for tokens in self.windows:
                    tokens, mask, positions = step_inputs(model.config, tokens.to(device), 0, tokens.shape[1])
                    self.states.append({"h": model.embed(tokens), "extra": model.rope_and_masks(mask, positions)})
            self.float_states = [dict(st) for st in self.states] if self.inputs == "asymmetric" else []
        for i, steps, output in plan:
            if i is not None:
                for st in self.states + self.float_states:
                    st["rope"] = model.block_rope_and_mask(i, st["extra"])
            yield from self._block([([name_of[id(m)] for m in group if id(m) in name_of], step)
                                    for group, step in steps], output)
        if end == L:
            self.states, self.float_states = [], []
        self.next = end % L

    def _block(self, groups: list[tuple[list[str], Step]],
               output: Callable[[dict], None] | None) -> Iterator[tuple[list[str], torch.Tensor, torch.Tensor | None]]:
        """One block (the head: ``output`` None) of the walk, as the class docstring says."""
        # A group none of whose layers is optimised (one the recipe leaves unquantized) only moves
        # the state on: no Gram is summed for it.
        if self.inputs == "float":  # every Gram from the float run, before any layer is rounded
            grams = []
            for names, step in groups:
                xs = _inputs(self.states, step)
                if names:
                    grams.append((names, _sums(xs)[0]))
            _output(self.states, output)
            yield from ((names, gram.float(), None) for names, gram in grams)
            return
        reference = None
        if self.inputs == "asymmetric":  # the float model's inputs, before any of these layers is rounded
            reference = [_inputs(self.float_states, step) for _, step in groups]
            _output(self.float_states, output)
        for g, (names, step) in enumerate(groups):
            xs = _inputs(self.states, step)
            if names:
                gram, shift = _sums(xs, None if reference is None else reference[g])
                yield names, gram.float(), shift
        _output(self.states, output)


def _output(states: list[dict], output: Callable[[dict], None] | None) -> None:
    if output is not None:
        with torch.no_grad():
            for st in states:
                output(st)


def sequential_groups(
    model: nn.Module, windows: Iterable[torch.Tensor], names: list[str], inputs: str = "quantized"
) -> Iterator[tuple[list[str], torch.Tensor, torch.Tensor | None]]:
    """:meth:`LayerWalk.groups` over the whole model (the windows move to its device)."""
    walk = LayerWalk(list(windows), inputs)
    yield from walk.groups(model, 0, model.config.num_layers, names)


@dataclass
class _Group:
    """What the layers reading one input share (q/k/v, gate/up): its Gram matrix, the asymmetric
    shift, and the factors made from them, each once, when a member first needs it."""

    gram: torch.Tensor
    shift: torch.Tensor | None
    rank: int | None

    @functools.cached_property
    def low_rank(self) -> GramFactor:
        return GramFactor.from_gram(self.gram, self.rank)

    @functools.cached_property
    def target_factor(self) -> torch.Tensor:
        """The Cholesky factor of the damped H of :func:`asymmetric_target`."""
        return torch.linalg.cholesky(damped(self.gram, ASYMMETRIC_DAMP))


class WeightOptimizer:
    """SeqMSE and/or GPTQ, layer by layer, over a decoder walked whole or part by part
    (:class:`LayerWalk`; ``options.layer_inputs`` says which inputs). Each :meth:`part` call
    optimises the layers of its part, writes their weights back on the chosen grid and returns
    their results; :attr:`results` and :attr:`timings` ({"collect_seconds",
    "seq_mse_seconds", "rounding_seconds"}) accumulate over the parts."""

    def __init__(self, windows: list[torch.Tensor], options: RecoveryOptions, rank: int | None = 64,
                 progress: bool = True) -> None:
        self.walk = LayerWalk(windows, options.layer_inputs)
        self.options, self.rank, self.progress = options, rank, progress
        self.timings = {"collect_seconds": 0.0, "seq_mse_seconds": 0.0, "rounding_seconds": 0.0}
        self.results: dict[str, OptimizedWeight] = {}

    def part(self, model: nn.Module, first: int, end: int, specs: dict[str, WeightSpec]) -> dict[str, OptimizedWeight]:
        """Optimise the layers ``specs`` (module path → WeightSpec) of layers first … end - 1 (and
        the head where ``end`` is the last), in place; returns their results."""
        modules = dict(model.named_modules())
        groups = self.walk.groups(model, first, end, list(specs))
        results: dict[str, OptimizedWeight] = {}
        bar = tqdm(total=len(specs), desc="weights", unit="layer", disable=not self.progress, leave=False)
        while True:
            t = time.perf_counter()
            step = next(groups, None)  # runs the next collection pass
            self.timings["collect_seconds"] += time.perf_counter() - t
            if step is None:
                break
            names, gram, shift = step
            group = _Group(gram, shift, self.rank)
            for name in names:
                results[name] = self._layer(name, modules[name], specs[name], group)
                bar.update(1)
        bar.close()
        self.results.update(results)
        return results

    def _layer(self, name: str, module: nn.Module, spec: WeightSpec, group: _Group) -> OptimizedWeight:
        seq_mse, granularity, rank = self.options.seq_mse, self.options.seq_mse_granularity, self.rank
        gram = group.gram
        weight = module.weight.detach().float()
        t0 = time.perf_counter()
        if group.shift is not None:  # "asymmetric": quantize the least-squares target instead
            weight = _shifted(weight, group.shift, group.target_factor)
        if spec.scale_bits is not None:  # LPBQ: block scales by the backend's rule, SeqMSE scales each channel's base
            scale = lpbq_scale(weight, spec.bits, spec.block_size, spec.scale_bits, spec.eps)
            loss_minmax = float("nan")
            if seq_mse:
                found = seq_mse_search(weight, group.low_rank, spec.bits, seq_mse, granularity, spec.block_size, rank,
                                       block_scale=scale)
                scale, loss_minmax = found.scale, found.loss_minmax
        elif seq_mse:
            source = group.low_rank if spec.block_size is None else gram
            found = seq_mse_search(weight, source, spec.bits, seq_mse, granularity, spec.block_size, rank)
            scale, loss_minmax = found.scale, found.loss_minmax
        else:
            scale = minmax_scale(weight, spec.bits, spec.block_size)
            loss_minmax = float("nan")
        t1 = time.perf_counter()
        if self.options.gptq is not None:
            codes = self.options.gptq.codes(name, weight, gram, scale, spec.bits)
        else:
            codes = quantize_codes(weight, scale, spec.bits).to(torch.int8)
        t2 = time.perf_counter()
        self.timings["seq_mse_seconds"] += t1 - t0
        self.timings["rounding_seconds"] += t2 - t1
        dequant = dequantize(codes, scale)
        err = weight - dequant
        loss = torch.einsum("oi,ij,oj->", err, gram, err).item()
        if not seq_mse:
            nearest = weight - fake_quantize(weight, scale, spec.bits)
            loss_minmax = torch.einsum("oi,ij,oj->", nearest, gram, nearest).item()
        # The parameter takes new memory rather than being written in place: a part streamed
        # from a float32 file holds tensors mapped from the file (npuq.models.stream).
        module.weight.data = dequant
        return OptimizedWeight(scale.cpu(), codes.cpu(), loss_minmax, loss)


def optimize_weights(
    model: nn.Module,
    windows: list[torch.Tensor],
    specs: dict[str, WeightSpec],
    options: RecoveryOptions,
    rank: int | None = 64,
    progress: bool = True,
) -> tuple[dict[str, OptimizedWeight], dict[str, float]]:
    """Optimise every layer in ``specs`` (module path → WeightSpec) of the whole ``model`` and
    write its weights back (:class:`WeightOptimizer`, one part).

    ``options.seq_mse`` None keeps min/max scales; GPTQ rounding replaces nearest rounding.
    Returns (per-layer results, {"collect_seconds", "seq_mse_seconds", "rounding_seconds"}).
    """
    optimizer = WeightOptimizer(windows, options, rank, progress)
    results = optimizer.part(model, 0, model.config.num_layers, specs)
    return results, optimizer.timings


ASYMMETRIC_DAMP = 1.0  # bench/accuracy.py, SmolLM2-135M 16a4w R1: 0.01 overfits the calibration text (docs/design.md §5)


def asymmetric_target(weight: torch.Tensor, gram: torch.Tensor, shift: torch.Tensor,
                      damp: float = ASYMMETRIC_DAMP) -> torch.Tensor:
    """W* = W + W S (H + λI)⁻¹ (float32, like ``weight`` (O, I)): the weight that, on the quantized
    model's inputs X̃, best gives the float layer's output on the float inputs X, in the (ridge)
    least-squares sense; ``gram`` H = X̃ᵀX̃, ``shift`` S = (X - X̃)ᵀX̃. λ is ``damp`` × the mean
    diagonal of H: a correction fitted to a few thousand calibration tokens must not follow their
    weak directions (GPTQ's 1 % made held-out text worse); inputs never seen (zero diagonal) are
    held at weight 1. S = 0 gives W exactly; damp 0, the exact least-squares weight."""
    return _shifted(weight, shift, torch.linalg.cholesky(damped(gram, damp)))


def _shifted(weight: torch.Tensor, shift: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """W + W S H⁻¹ for ``chol`` the Cholesky factor of the damped H (float32, like ``weight``).
    In float64: in float32 the Qwen2.5-Coder-0.5B LPBQ artifact's held-out scores moved by 3-6 %
    (prose KLD 0.135 → 0.140) and the run saved nothing measurable (406 s, then 427 s)."""
    W = weight.double()
    correction = torch.cholesky_solve((W @ shift.double()).T, chol).T  # W S H⁻¹ (H symmetric)
    return (W + correction).float()


