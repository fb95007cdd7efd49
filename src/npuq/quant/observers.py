"""Observers: running min/max statistics that refuse NaN/Inf and say which tensor carried it.

docs/design.md §1: activations use a plain running min/max over all calibration data; weights a
per-channel min/max computed once (they are static). These are torchao's PT2E observers plus

- a finiteness check: a NaN or Inf that reaches an observer poisons its range (min/max
  propagate NaN and keep ±inf), so :func:`check_observers` (run by the calibration engines
  after each window batch) raises :class:`NonFiniteTensor` naming the first graph node, in
  graph order, whose observer saw one — where it entered. Checking after the batch instead
  of inside every observer call keeps a decode step free of ~1500 host syncs;
- :class:`LpbqObserver`, the 4-bit per-block weight observer with block scales re-quantized
  against a per-channel base scale (LPBQ).
"""

from __future__ import annotations

import torch
from torchao.quantization.pt2e import MinMaxObserver, PerChannelMinMaxObserver
from torchao.quantization.pt2e.observer import ObserverBase
from torchao.quantization.pt2e.utils import create_getattr_from_value

from npuq.errors import NpuqError
from npuq.quant.graph import module_path


class NonFiniteTensor(NpuqError):
    """A NaN or Inf reached an observer during calibration."""


def _non_finite(lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """NaN, a min of -inf or a max of +inf. (A never-called observer holds min +inf, max -inf.)"""
    return bool((lo.isnan() | hi.isnan() | (lo == float("-inf")) | (hi == float("inf"))).any())


def _raise_non_finite(observer: torch.nn.Module, lo: torch.Tensor, hi: torch.Tensor) -> None:
    names = getattr(observer, "observed", None) or ["(unnamed tensor)"]
    raise NonFiniteTensor(
        f"NaN or Inf reached the observer of {', '.join(names)} during calibration "
        f"(observed min {lo.min().item()}, max {hi.max().item()}); check the model weights and "
        "the calibration tokens (ids within the vocabulary)"
    )


class ActivationObserver(MinMaxObserver):
    """Per-tensor running min/max (torchao's MinMaxObserver, without its per-call bookkeeping)."""

    observed: list[str]

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        lo, hi = torch.aminmax(x_orig.detach().to(self.min_val.dtype))
        torch.minimum(lo, self.min_val, out=self.min_val)  # propagates NaN: check_observers sees it
        torch.maximum(hi, self.max_val, out=self.max_val)
        return x_orig


def check_observers(gm: torch.fx.GraphModule) -> None:
    """Raise :class:`NonFiniteTensor` for the first observer (graph order) holding NaN/Inf."""
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        obs = gm.get_submodule(node.target)
        if isinstance(obs, (MinMaxObserver, PerChannelMinMaxObserver)) and obs.min_val.numel():
            if _non_finite(obs.min_val, obs.max_val):
                _raise_non_finite(obs, obs.min_val, obs.max_val)


class ConstantObserver(ActivationObserver):
    """ActivationObserver for a constant tensor (embedding or RoPE table, RMSNorm weight) and
    the views gathered from it: it observes the first call only. The table's range contains
    every gathered row, and the table is the same at every step, so later calls would only
    recompute the same min/max over the whole table (per decode step, for the embedding)."""

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if bool(self.min_val <= self.max_val):  # already observed
            return x_orig
        return super().forward(x_orig)


class PerChannelWeightObserver(PerChannelMinMaxObserver):
    """Per-channel min/max of a static weight, computed once (docs/design.md §1: weights are
    static). The class name must contain "PerChannel": torchao only passes ``ch_axis`` to such
    observers."""

    observed: list[str]

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if self.min_val.numel():  # already observed: the weight has not changed
            return x_orig
        return self._forward(x_orig)


class LpbqPerChannelObserver(PerChannelWeightObserver):
    """4-bit weights (O, I) per block of ``block_size`` input channels, LPBQ-compressed scales.

    Per block b of output channel c: s_cb = max|w| / qmax. Per channel a base scale
    base_c = max_b s_cb / 2**scale_bits; each block scale is re-quantized to the integer
    k_cb = clamp(ceil(s_cb / base_c), 1, 2**scale_bits) (rounding up never clips a weight),
    so the effective scale is base_c · k_cb. ``calculate_qparams`` returns the per-channel
    base scale (what the bias is derived from); :meth:`block_qparams` the (O, I / block) scales.
    """

    def __init__(self, ch_axis: int = 0, block_size: int = 32, scale_bits: int = 4, **kwargs):
        super().__init__(ch_axis=ch_axis, **kwargs)
        self.block_size = block_size
        self.scale_bits = scale_bits
        self.register_buffer("block_absmax", torch.tensor([]))

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if self.block_absmax.numel():
            return x_orig
        super().forward(x_orig)
        w = x_orig.detach().float()
        if w.dim() != 2 or w.shape[1] % self.block_size:
            raise NpuqError(
                f"LPBQ needs a 2-D weight whose input size is a multiple of {self.block_size}; "
                f"{', '.join(getattr(self, 'observed', ['a weight']))} has shape {tuple(w.shape)}: use 16a4w for it"
            )
        absmax = w.abs().view(w.shape[0], -1, self.block_size).amax(dim=-1)  # (O, blocks)
        self.block_absmax.resize_(absmax.shape)
        self.block_absmax.copy_(absmax)
        return x_orig

    def block_qparams(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scales (O, blocks), base scale (O,), integer multipliers k (O, blocks))."""
        qmax = float(self.quant_max)
        steps = 2**self.scale_bits
        block_scale = torch.clamp(self.block_absmax / qmax, min=float(self.eps))  # (O, blocks)
        base = block_scale.amax(dim=1) / steps  # (O,)
        k = torch.clamp(torch.ceil(block_scale / base[:, None] - 1e-6), 1, steps)
        return base[:, None] * k, base, k

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = prefix + "block_absmax"  # an observer not yet run holds an empty buffer: size it first
        if key in state_dict:
            self.block_absmax.resize_(state_dict[key].shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def convert(self, model: torch.fx.GraphModule, observer_node: torch.fx.Node) -> None:
        """Replace the observer by torchao's per-block quantize_affine / dequantize_affine pair
        (torchao's convert calls this instead of inserting per-channel ops)."""
        scales, _, _ = self.block_qparams()
        block = (1, self.block_size)
        graph = model.graph
        with graph.inserting_before(observer_node):
            scale_node = create_getattr_from_value(model, graph, "_scale", scales.float(), None)
            zp_node = create_getattr_from_value(model, graph, "_zero_point", torch.zeros_like(scales, dtype=torch.int32), None)
            args = (block, scale_node, zp_node, self.dtype, self.quant_min, self.quant_max)
            q = graph.call_function(torch.ops.torchao.quantize_affine, (observer_node.args[0], *args), {})
            dq = graph.call_function(torch.ops.torchao.dequantize_affine, (q, *args), {"output_dtype": torch.float32})
        observer_node.replace_all_uses_with(dq)
        graph.erase_node(observer_node)


def pin_weight_scales(gm: torch.fx.GraphModule, scales: dict[str, torch.Tensor]) -> None:
    """Give the weight observers of the named linear layers precomputed scales.

    SeqMSE and GPTQ (npuq.optimize) choose each layer's scales (O,) and write weights that lie on
    that grid; setting the observer's range to ∓scale·qmax makes ``calculate_qparams`` return
    exactly those scales, and an observer that holds a range never looks at the weight again.
    LPBQ layers take (O, blocks) scales already in LPBQ form (base_c · k_cb, as
    npuq.optimize.seqmse.lpbq_scale makes them): ``block_qparams`` then gives them back exactly.
    """
    pinned = set()
    for module in gm.modules():
        lpbq = type(module) is LpbqPerChannelObserver
        if type(module) is not PerChannelWeightObserver and not lpbq:
            continue
        for label in getattr(module, "observed", []):
            path = label.removesuffix(".weight")
            if path not in scales:
                continue
            scale = scales[path].detach().float()
            if (scale.dim() == 2) != lpbq:
                raise ValueError(f"{path}: {'LPBQ' if lpbq else 'per-channel'} weight observer given scales of shape "
                                 f"{tuple(scale.shape)}")
            if lpbq:
                # block_qparams re-derives k = ceil(s_b / base - 1e-6) in float32, where s_b / base can
                # come out a few ulps above the integer k: blocks below the channel maximum are
                # stored 1e-5 smaller so that k comes back exactly (the scales then within 1e-6).
                top = scale.amax(dim=1, keepdim=True)
                shrink = torch.where(scale < top, 1 - 1e-5, 1.0)
                module.block_absmax.resize_(scale.shape).copy_(scale * shrink * float(module.quant_max))
                scale = top.squeeze(1)
            limit = scale * float(module.quant_max)  # (O,)
            module.min_val.resize_(limit.shape).copy_(-limit)
            module.max_val.resize_(limit.shape).copy_(limit)
            pinned.add(path)
    missing = sorted(set(scales) - pinned)
    if missing:
        raise ValueError(f"no per-channel weight observer for {', '.join(missing[:3])}")


def is_observer(module: torch.nn.Module) -> bool:
    return isinstance(module, ObserverBase)


def name_observers(gm: torch.fx.GraphModule) -> None:
    """Record on each observer the graph tensors it watches (for error messages and encodings)."""
    for module in gm.modules():
        if is_observer(module):
            module.observed = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and is_observer(gm.get_submodule(node.target)):
            obs = gm.get_submodule(node.target)
            src = node.args[0]
            label = src.target if src.op == "get_attr" else src.name
            path = module_path(src)
            text = f"{label} ({path})" if path and src.op != "get_attr" else str(label)
            if text not in obs.observed:
                obs.observed.append(text)
