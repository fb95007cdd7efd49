"""int32 biases that fit: widen a weight channel's scale where its bias would be clipped.

A linear layer's bias is stored as int32 codes with scale s_in · s_w,c (docs/design.md §1), so
bias channel c is representable only while |b_c| / (s_in · s_w,c) ≤ 2^31 − 1. Both scales come
from min/max ranges: s_in = range(x) / 65535 for a uint16 input, s_w,c = max|W_c| / qmax. The
condition therefore reads |b_c| ≤ (2^31 − 1) · range(x) · max|W_c| / (65535 · qmax), about
258 · range(x) · max|W_c| for 16-bit inputs and int8 weights (qmax 127), and 8 times less room
for int16 weights. A bias beyond that is clamped by the quantizer: the layer adds a different
constant to every token, with no warning.

It happens where a bias is large next to the products x·W it is added to. Qwen2's q/k
biases reach 145 in layer 0 of Qwen2.5-Coder-0.5B; folding a Hadamard rotation into the
weights (npuq.optimize.rotate) shrinks both range(x) (the pre-norm's gamma moves into the
weights and outliers are spread) and max|W_c| (a Hadamard spreads each row's largest
entries), so the room shrinks several times over while the biases stay (q/k outputs are not
rotated). Measured (16a8w, 1024 calibration tokens): unrotated 1 k_proj channel over the limit
(1.16x), rotated 7 k_proj and 2 q_proj channels (up to 3.5x), and with them a layer-0 k_proj
output SQNR of 1.5 dB that wrecked every later layer (docs/design.md §12).

The fix, after calibration and before convert: raise s_w,c just enough for b_c to fit,
s_w,c ← max(s_w,c, |b_c| / (s_in · (2^31 − 1)) · (1 + 2^-10)). The weights of that channel get
a coarser grid (fewer of their codes used); the activation grid, shared by every channel and
every reader of x, stays as it is. ONNX Runtime's QDQ quantizer for the QNN provider and
TFLite's converter make the same choice (raise the weight scale). The margin 2^-10 covers the
float32 roundings of s_in, s_w and their product (2^-24 each).

A scale pinned by SeqMSE/GPTQ (npuq.optimize) is raised the same way: that channel's weights,
rounded on the pinned grid, are then rounded again on the coarser one at convert. The bias
room depends on s_in, known only after calibration, while the search runs before it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.fx import GraphModule
from torchao.quantization.pt2e import DerivedObserverOrFakeQuantize

from npuq.quant.graph import attr_tensor
from npuq.quant.observers import LpbqPerChannelObserver, PerChannelWeightObserver
from npuq.quant.specs import _derive_bias_qparams

INT32_MAX = 2**31 - 1
MARGIN = 1 + 2**-10  # float32 rounding of the two scales and their product (module docstring)


@dataclass(frozen=True)
class WidenedBias:
    """One linear layer whose weight scales were raised so that its bias fits int32."""

    layer: str  # module path, e.g. "layers.0.self_attn.k_proj"
    channels: int  # output channels whose weight scale was raised
    max_ratio: float  # the largest factor a channel's scale was raised by

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bias_observers(gm: GraphModule):
    """(derived bias observer, bias tensor) for every int32 bias whose scale is derived from an
    activation and a per-channel weight observer (npuq.quant.specs.bias_spec)."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        obs = gm.get_submodule(node.target)
        if not isinstance(obs, DerivedObserverOrFakeQuantize) or obs.derive_qparams_fn is not _derive_bias_qparams:
            continue
        bias = attr_tensor(gm, node.args[0])
        if bias is not None:
            yield obs, bias.detach()


def fit_biases(gm: GraphModule) -> list[WidenedBias]:
    """Raise, in place, the weight scales of every calibrated linear layer whose int32 bias
    would be clipped (module docstring); returns what was raised. Call after calibration,
    before convert: the bias scale is derived from the raised weight scale at convert, so the
    codes fit by construction."""
    widened = []
    for obs, bias in _bias_observers(gm):
        act, weight = obs.obs_or_fqs
        if not isinstance(weight, PerChannelWeightObserver) or not weight.min_val.numel():
            continue
        act_scale = act.calculate_qparams()[0].double().flatten()  # (1,)
        weight_scale = weight.calculate_qparams()[0].double()  # (O,)
        needed = bias.double().abs().flatten() / (act_scale * INT32_MAX) * MARGIN  # (O,) smallest s_w that fits
        ratio = needed / weight_scale
        grow = ratio > 1
        if not bool(grow.any()):
            continue
        factor = torch.where(grow, ratio, torch.ones_like(ratio))
        with torch.no_grad():
            # symmetric: scale = max(|min|, |max|) / qmax, so scaling the range scales the scale
            weight.min_val.copy_((weight.min_val.double() * factor).to(weight.min_val.dtype))
            weight.max_val.copy_((weight.max_val.double() * factor).to(weight.max_val.dtype))
            if isinstance(weight, LpbqPerChannelObserver) and weight.block_absmax.numel():
                # every block of the channel by the same factor: the same integer multipliers k
                absmax = weight.block_absmax.double() * factor.unsqueeze(1)
                weight.block_absmax.copy_(absmax.to(weight.block_absmax.dtype))
        labels = getattr(weight, "observed", None) or ["a linear layer"]
        widened.append(WidenedBias(labels[0].removesuffix(".weight"), int(grow.sum()), float(ratio.max())))
    return widened
