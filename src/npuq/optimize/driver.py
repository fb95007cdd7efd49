"""Apply SeqMSE and GPTQ to every quantized linear layer of a float StaticDecoder.

The driver works on the float model before export: it runs the calibration windows once to
collect each layer's input Gram matrix XᵀX (layers that read the same tensor, q/k/v and
gate/up, share one), searches the scales and rounds the weights layer by layer, and writes the
rounded weights back as float values that lie exactly on the chosen grid. The returned scales
are what the PT2E weight observers must report, so the artifact carries exactly these
integers (per-channel or per-block int4/int8, unchanged format).

Everything runs where the model is (Gram matrices, search, rounding); the windows move there.
The returned scales and codes are CPU tensors, whatever device computed them.

Layer inputs come from the float model (``inputs="float"``: one forward, every Gram at once) or
from the model being quantized (``inputs="quantized"``, as GPTQ's reference code does): the
decoder is walked block by block on cached hidden states, and within a block group by group
(q/k/v, o, gate/up, down, then the lm head), so each group's Gram matrix is collected after
every group before it has been rounded and written back. A group's collection pass stops at
the group's last input (a cheap exception), and each block's output is computed once, so the
whole walk costs a few forwards, not one per layer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from npuq.device import device_of
from npuq.errors import NpuqError
from npuq.optimize.gptq import GptqOptions
from npuq.optimize.seqmse import (
    GRANULARITIES,
    GramFactor,
    lpbq_scale,
    minmax_scale,
    quantize_codes,
    seq_mse_search,
)
from npuq.runtime.runner import forward_logits

ROUNDINGS = ("nearest", "gptq")
INPUTS = ("float", "quantized")
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


def collect_grams(model: nn.Module, windows: Iterable[torch.Tensor], names: list[str]) -> tuple[dict[str, int], list[torch.Tensor]]:
    """Accumulate XᵀX (I, I) of each named linear layer's input over ``windows`` (each (B, T) tokens),
    on the model's device.

    Returns (layer → group index, Gram per group). Consecutive layers called on the very same
    tensor (q/k/v, gate/up) form one group and their input is counted once.
    """
    modules = dict(model.named_modules())
    group_of: dict[str, int] = {}
    grams: list[torch.Tensor] = []
    last: dict[str, object] = {"input": None, "group": None}

    def hook(name):
        def fn(_module, args):
            x = args[0]
            shared = x is last["input"]
            if name not in group_of:
                group_of[name] = last["group"] if shared else len(grams)
                if not shared:
                    grams.append(torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64, device=x.device))
            if not shared:
                flat = x.detach().reshape(-1, x.shape[-1]).double()
                grams[group_of[name]].addmm_(flat.T, flat)
            last["input"], last["group"] = x, group_of[name]

        return fn

    device = device_of(model)
    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        for tokens in windows:
            last["input"] = None
            forward_logits(model, tokens.to(device))
    finally:
        last["input"] = None
        for h in handles:
            h.remove()
    missing = [n for n in names if n not in group_of]
    if missing:
        raise ValueError(f"layers never ran during calibration: {', '.join(missing[:3])}")
    return group_of, [g.float() for g in grams]


class _Stop(Exception):
    """Ends a forward early: the hooks have seen what they need."""


@contextmanager
def _identity_layers(model: nn.Module, record: list):
    """Replace each decoder block's forward by the identity that appends (block index, args,
    kwargs) to ``record``; the forward stops before the final norm (nothing after it is needed)."""
    layers = list(model.layers)

    def stub(i):
        def forward(h, *args, **kwargs):
            record.append((i, h, args, kwargs))
            return (h, None, None)

        return forward

    def stop(_module, _args):
        raise _Stop

    for i, layer in enumerate(layers):
        layer.forward = stub(i)
    handle = model.norm.register_forward_pre_hook(stop)
    try:
        yield
    finally:
        handle.remove()
        for layer in layers:
            del layer.forward


def _block_inputs(model: nn.Module, windows: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """(hidden state entering block 0 per window, [per block: (args, kwargs) after the hidden
    state, per window]), from one forward whose blocks are the identity: the embedding, RoPE
    tables and masks are exactly what the model's own forward gives each block."""
    hidden: list[torch.Tensor] = []
    extra: list[list[tuple]] = [[] for _ in model.layers]
    for tokens in windows:
        record: list = []
        with _identity_layers(model, record):
            try:
                forward_logits(model, tokens)
            except _Stop:
                pass
        hidden.append(record[0][1])
        for i, _h, args, kwargs in record:
            extra[i].append((args, kwargs))
    return hidden, extra


def _collect_group(
    modules: dict[str, nn.Module], pending: list[str], run: Callable[[int], object], n_windows: int
) -> tuple[list[str], torch.Tensor]:
    """The next group of ``pending`` layers to run and its Gram matrix XᵀX (float64).

    The group is the first pending layer called in a forward plus the pending layers called
    right after it on the very same tensor (q/k/v, gate/up). ``run(w)`` runs window w; its
    forward stops once the group's input is seen (at the next pending layer, or when every
    pending layer belongs to the group).
    """
    state: dict = {}
    found: list[str] = []
    gram: list[torch.Tensor] = []

    def hook(name):
        def fn(_module, args):
            x = args[0]
            if state["x"] is None:
                state["x"] = x
                flat = x.detach().reshape(-1, x.shape[-1]).double()
                if not gram:
                    gram.append(torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float64, device=flat.device))
                gram[0].addmm_(flat.T, flat)
            elif x is not state["x"]:
                raise _Stop
            state["members"].append(name)
            if len(state["members"]) == len(pending):
                raise _Stop

        return fn

    handles = [modules[n].register_forward_pre_hook(hook(n)) for n in pending]
    try:
        for w in range(n_windows):
            state.update(x=None, members=[])
            try:
                with torch.no_grad():
                    run(w)
            except _Stop:
                pass
            if w == 0:
                found = list(state["members"])
                if not found:
                    raise ValueError(f"layers never ran during calibration: {', '.join(pending[:3])}")
            elif state["members"] != found:
                raise RuntimeError(f"layers ran in a different order in calibration window {w}: "
                                   f"{state['members']} instead of {found}")
    finally:
        state.clear()
        for h in handles:
            h.remove()
    return found, gram[0]


def sequential_groups(
    model: nn.Module, windows: Iterable[torch.Tensor], names: list[str]
) -> Iterator[tuple[list[str], torch.Tensor]]:
    """Yield (group of layers, Gram matrix (I, I) float32) in execution order, each Gram computed
    from the inputs the model *as it stands* gives that group.

    The caller rewrites a group's weights before asking for the next group, so every Gram sees
    the rounding of all groups before it. The decoder blocks run one at a time on hidden
    states cached per window; the lm head (and any layer outside the blocks) comes last, on the
    final norm of the last block's output.
    """
    device = device_of(model)
    windows = [w.to(device) for w in windows]
    modules = dict(model.named_modules())
    path_of = {id(m): p for p, m in modules.items()}
    hidden, extra = _block_inputs(model, windows)
    left = list(names)
    for i, layer in enumerate(model.layers):
        prefix = path_of[id(layer)] + "."
        pending = [n for n in left if n.startswith(prefix)]
        states = hidden

        def run(w, layer=layer, i=i, states=states):
            args, kwargs = extra[i][w]
            return layer(states[w], *args, **kwargs)

        while pending:
            group, gram = _collect_group(modules, pending, run, len(windows))
            yield group, gram.float()
            pending = [n for n in pending if n not in group]
            left = [n for n in left if n not in group]
        with torch.no_grad():
            hidden = [run(w)[0] for w in range(len(windows))]

    def head(w, states=hidden):
        return model.lm_head(model.norm(states[w]))

    while left:
        group, gram = _collect_group(modules, left, head, len(windows))
        yield group, gram.float()
        left = [n for n in left if n not in group]


def optimize_weights(
    model: nn.Module,
    windows: list[torch.Tensor],
    specs: dict[str, WeightSpec],
    options: RecoveryOptions,
    rank: int | None = 64,
    progress: bool = True,
) -> tuple[dict[str, OptimizedWeight], dict[str, float]]:
    """Optimise every layer in ``specs`` (module path → WeightSpec) and write its weights back.

    ``options.seq_mse`` None keeps min/max scales; GPTQ rounding replaces nearest rounding.
    Layer inputs "float" fit every layer to the float model's inputs; "quantized" to the inputs
    the partly quantized model gives it (:func:`sequential_groups`).
    Returns (per-layer results, {"collect_seconds", "seq_mse_seconds", "rounding_seconds"}).
    """
    seq_mse, granularity, inputs = options.seq_mse, options.seq_mse_granularity, options.layer_inputs
    timings = {"collect_seconds": 0.0, "seq_mse_seconds": 0.0, "rounding_seconds": 0.0}
    names = list(specs)
    if inputs == "float":
        start = time.perf_counter()
        group_of, grams = collect_grams(model, windows, names)
        timings["collect_seconds"] = time.perf_counter() - start
        stages: Iterator = ((name, grams[group_of[name]], group_of[name]) for name in names)
    else:
        stages = ((name, gram, g) for g, (group, gram) in enumerate(sequential_groups(model, windows, names))
                  for name in group)
    factors: dict[int, GramFactor] = {}
    modules = dict(model.named_modules())
    results: dict[str, OptimizedWeight] = {}
    bar = tqdm(total=len(names), desc="weights", unit="layer", disable=not progress, leave=False)
    while True:
        t = time.perf_counter()
        stage = next(stages, None)  # with quantized inputs: runs the next collection pass
        if inputs == "quantized":
            timings["collect_seconds"] += time.perf_counter() - t
        if stage is None:
            break
        name, gram, group = stage
        spec = specs[name]
        weight = modules[name].weight.detach().float()
        t0 = time.perf_counter()
        if spec.scale_bits is not None:  # LPBQ: block scales by the backend's rule, SeqMSE scales each channel's base
            scale = lpbq_scale(weight, spec.bits, spec.block_size, spec.scale_bits, spec.eps)
            loss_minmax = float("nan")
            if seq_mse:
                if group not in factors:
                    factors[group] = GramFactor.from_gram(gram, rank)
                found = seq_mse_search(weight, factors[group], spec.bits, seq_mse, granularity, spec.block_size, rank,
                                       block_scale=scale)
                scale, loss_minmax = found.scale, found.loss_minmax
        elif seq_mse:
            if spec.block_size is None:
                if group not in factors:
                    factors[group] = GramFactor.from_gram(gram, rank)
                source = factors[group]
            else:
                source = gram
            found = seq_mse_search(weight, source, spec.bits, seq_mse, granularity, spec.block_size, rank)
            scale, loss_minmax = found.scale, found.loss_minmax
        else:
            scale = minmax_scale(weight, spec.bits, spec.block_size)
            loss_minmax = float("nan")
        t1 = time.perf_counter()
        if options.gptq is not None:
            codes = options.gptq.codes(weight, gram, scale, spec.bits)
        else:
            codes = quantize_codes(weight, scale, spec.bits).to(torch.int8)
        t2 = time.perf_counter()
        timings["seq_mse_seconds"] += t1 - t0
        timings["rounding_seconds"] += t2 - t1
        dequant = _dequantize(codes, scale)
        err = weight - dequant
        loss = torch.einsum("oi,ij,oj->", err, gram, err).item()
        if not seq_mse:
            nearest = weight - _dequantize(quantize_codes(weight, scale, spec.bits), scale)
            loss_minmax = torch.einsum("oi,ij,oj->", nearest, gram, nearest).item()
        with torch.no_grad():
            modules[name].weight.copy_(dequant)
        results[name] = OptimizedWeight(scale.cpu(), codes.cpu(), loss_minmax, loss)
        bar.update(1)
    bar.close()
    return results, timings


def _dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if scale.dim() == 2:
        O, I = codes.shape
        return (codes.float().view(O, scale.shape[1], -1) * scale.unsqueeze(-1)).view(O, I)
    return codes.float() * scale.unsqueeze(1)
