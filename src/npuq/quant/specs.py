"""TensorFormat → PT2E quantization specs (pure functions; the quantizer decides where they go)."""

from __future__ import annotations

import functools
import math

import torch
from torch.fx import Node
from torchao.quantization.pt2e.quantizer import DerivedQuantizationSpec, QuantizationSpec

from npuq.errors import NpuqError
from npuq.models.decoder import MASK_VALUE
from npuq.quant.observers import ActivationObserver, ConstantObserver, LpbqPerChannelObserver, PerChannelWeightObserver
from npuq.quant.schemes import PerBlock, PerChannel, PerTensor, TensorFormat


@functools.lru_cache(maxsize=None)
def activation_spec(fmt: TensorFormat, constant: bool = False) -> QuantizationSpec:
    """Per-tensor running min/max; uint16 rides in int32 with range [0, 65535].

    ``constant``: for a static tensor (table, norm weight), observed once.
    """
    if not isinstance(fmt.granularity, PerTensor):
        raise ValueError(f"activation formats are per tensor, got {fmt.describe()}")
    unsigned_symmetric = fmt.symmetric and not fmt.signed
    return QuantizationSpec(
        dtype=fmt.torch_dtype,
        # uint8 symmetric: leave the range to torch's default so the zero point is 128, not 127.
        quant_min=None if unsigned_symmetric else fmt.quant_min,
        quant_max=None if unsigned_symmetric else fmt.quant_max,
        qscheme=fmt.qscheme,
        observer_or_fake_quant_ctr=(ConstantObserver if constant else ActivationObserver).with_args(eps=fmt.eps),
    )


@functools.lru_cache(maxsize=None)
def weight_spec(fmt: TensorFormat) -> QuantizationSpec:
    """Symmetric per-channel or LPBQ per-block (scales per output channel, axis 0) weight spec."""
    g = fmt.granularity
    if isinstance(g, PerBlock):
        ctr = LpbqPerChannelObserver.with_args(eps=fmt.eps, block_size=g.size, scale_bits=g.scale_bits)
        axis = 0
    elif isinstance(g, PerChannel):
        ctr = PerChannelWeightObserver.with_args(eps=fmt.eps)
        axis = g.axis
    else:
        raise ValueError(f"weights are quantized per channel or per block, got {fmt.describe()}")
    return QuantizationSpec(
        dtype=fmt.torch_dtype, quant_min=fmt.quant_min, quant_max=fmt.quant_max,
        qscheme=torch.per_channel_symmetric, ch_axis=axis, observer_or_fake_quant_ctr=ctr,
    )


def _derive_bias_qparams(observers: list) -> tuple[torch.Tensor, torch.Tensor]:
    act, weight = observers
    act_scale, _ = act.calculate_qparams()
    weight_scale, _ = weight.calculate_qparams()  # LPBQ: the per-channel base scale
    scale = (act_scale * weight_scale).to(torch.float32)
    return scale, torch.zeros_like(scale, dtype=torch.int32)


def bias_spec(linear: Node) -> DerivedQuantizationSpec:
    """int32, zero point 0, scale = input activation scale × weight scale (per output channel)."""
    x, w = linear.args[0], linear.args[1]
    return DerivedQuantizationSpec(
        derived_from=[(x, linear), (w, linear)],
        derive_qparams_fn=_derive_bias_qparams,
        dtype=torch.int32,
        quant_min=torch.iinfo(torch.int32).min,
        quant_max=torch.iinfo(torch.int32).max,
        qscheme=torch.per_channel_symmetric,
        ch_axis=0,
    )


def _same_qparams(observers: list) -> tuple[torch.Tensor, torch.Tensor]:
    return observers[0].calculate_qparams()


def copied_spec(source: Node, fmt: TensorFormat) -> DerivedQuantizationSpec:
    """The encoding of ``source``'s output, without observing anything itself.

    Used for KV-cache inputs and the cache concat: their encoding must equal the new entries'
    (the runner copies quantized outputs into the cache), and cache contents (including empty
    slots) must not reach an observer.
    """
    return DerivedQuantizationSpec(
        derived_from=[source],
        derive_qparams_fn=_same_qparams,
        dtype=fmt.torch_dtype,
        quant_min=fmt.quant_min,
        quant_max=fmt.quant_max,
        qscheme=fmt.qscheme,
    )


# The most keys one softmax row can have (cache plus new tokens): 2**17 covers every context the
# supported families declare (the longest, 131072).
MAX_KEYS = 2**17


def masked_margin(bits: int) -> float:
    """How far below the lowest attention score a masked entry must sit: a row of at most
    MAX_KEYS keys then gives its masked entries together at most e^-margin × MAX_KEYS of the
    weight of its largest score, half the step of a ``bits``-bit softmax output (1 / (2^bits - 1))
    — they round to nothing. 16 bits: 23.6; 8 bits: 17.9."""
    return math.log(MAX_KEYS) + math.log(2 * (2**bits - 1))


def _masked_range(scores: torch.nn.Module, bits: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) of ``scores + mask``: the scores' observed range widened below by the margin."""
    lo, hi = scores.min_val - masked_margin(bits), scores.max_val
    if torch.clamp(hi, min=0) - torch.clamp(lo, max=0) > -MASK_VALUE:  # the encoded range holds 0
        raise NpuqError(
            f"{where}: the attention scores span [{scores.min_val.item():.1f}, {hi.item():.1f}] on the calibration "
            f"text, more than the mask value {MASK_VALUE} can push a masked entry below (by "
            f"{masked_margin(bits):.1f}): masked keys would take weight. This model's attention needs a larger "
            "mask value (npuq.models.decoder.MASK_VALUE); please report it")
    return lo, hi


def _qparams(fmt: TensorFormat, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The qparams an activation observer of ``fmt`` gives for the range [lo, hi]."""
    spec = activation_spec(fmt)
    ref = spec.observer_or_fake_quant_ctr(dtype=spec.dtype, qscheme=spec.qscheme, quant_min=spec.quant_min,
                                          quant_max=spec.quant_max)
    ref.min_val.copy_(lo.reshape(ref.min_val.shape))
    ref.max_val.copy_(hi.reshape(ref.max_val.shape))
    return ref.calculate_qparams()


def _masked_scores_qparams(observers: list, fmt: TensorFormat, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _qparams(fmt, *_masked_range(observers[0], fmt.bits, where))


def _layer_mask_qparams(observers: list, fmt: TensorFormat, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    scale, _ = _masked_scores_qparams(observers, fmt, where)
    width = scale * (fmt.quant_max - fmt.quant_min)  # of the add's encoded range, which holds 0
    return _qparams(fmt, -width, torch.zeros_like(width))


def _derived(scores: Node, add: Node, fmt: TensorFormat, fn, where: str) -> DerivedQuantizationSpec:
    return DerivedQuantizationSpec(
        derived_from=[(scores, add)],
        derive_qparams_fn=functools.partial(fn, fmt=fmt, where=where),
        dtype=fmt.torch_dtype,
        quant_min=fmt.quant_min,
        quant_max=fmt.quant_max,
        qscheme=fmt.qscheme,
    )


def masked_scores_spec(scores: Node, add: Node, fmt: TensorFormat, where: str) -> DerivedQuantizationSpec:
    """The encoding of ``scores + mask`` (the softmax input), never observed itself: the scores'
    own range (their edge's observer) widened below by :func:`masked_margin`. With
    :func:`layer_mask_spec` a masked entry is at most the range's top minus its width — its
    lowest code: below every real score of its row by at least the margin, so it takes no
    weight, whatever the scores' magnitude. (Observed, the range held every masked entry: a
    mask of -255 let a row whose scores all lie below -255 attend to the empty cache slots
    instead, the whole 1.034x of Qwen2.5-Coder-1.5B at 16a8w; and a larger mask would have
    coarsened every layer's step.)"""
    return _derived(scores, add, fmt, _masked_scores_qparams, where)


def layer_mask_spec(scores: Node, add: Node, fmt: TensorFormat, where: str) -> DerivedQuantizationSpec:
    """The mask as one layer's ``scores + mask`` reads it: requantized to [-width, 0] of that
    add's output range (:func:`masked_scores_spec`), so 0 stays 0 and MASK_VALUE saturates to
    -width. The HTP adds two inputs at the resolution their scales allow together: a mask on
    its own encoding (-65504 over 65535 codes) beside scores of step 1e-3 cost the emulated
    graphs 25x their error bound; at the output's own width the two scales are equal."""
    return _derived(scores, add, fmt, _layer_mask_qparams, where)
