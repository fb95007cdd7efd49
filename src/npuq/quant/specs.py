"""TensorFormat → PT2E quantization specs (pure functions; the quantizer decides where they go)."""

from __future__ import annotations

import functools

import torch
from torch.fx import Node
from torchao.quantization.pt2e.quantizer import DerivedQuantizationSpec, QuantizationSpec

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
