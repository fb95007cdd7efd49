"""Encodings: the calibrated quantization parameters of every tensor, as QNN/AIMET lay them out.

One entry per observed tensor, in the spirit of AIMET's encodings format 1.0.0::

    {"name": "linear_3", "module": "layers.0.self_attn.o_proj", "dtype": "uint16", "bw": 16,
     "enc_type": "PER_TENSOR", "is_sym": false, "axis": null,
     "scale": [3.1e-05], "offset": [-32768], "min": [-1.02], "max": [1.02]}

``offset`` is QNN's convention, the negated zero point (real = scale · (q + offset));
``min``/``max`` are the ends of the representable grid, scale · (qmin + offset) and
scale · (qmax + offset). Per-channel weights list one value per channel (``axis`` 0);
LPBQ weights add ``block_size``, the per-channel float base scale and the per-block integer
multipliers. Input-edge requantizations (the int16 second input of a matmul) are named
``producer->consumer``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx import GraphModule, Node

from npuq.quant import graph as g
from npuq.quant.observers import LpbqPerChannelObserver, is_observer

FORMAT_VERSION = "1.0.0"


def _dtype_name(obs: torch.nn.Module) -> tuple[str, int]:
    """("uint16", 16), ("int4", 4), ... from the observer's integer range."""
    qmin, qmax = int(obs.quant_min), int(obs.quant_max)
    if qmin < 0:  # symmetric narrow range [-(2^(b-1) - 1), 2^(b-1) - 1] or the full int32 range
        bits = math.ceil(math.log2(qmax + 1)) + 1
        return f"int{bits}", bits
    bits = math.ceil(math.log2(qmax + 1))
    return f"uint{bits}", bits


def observer_encoding(obs: torch.nn.Module) -> dict[str, Any]:
    """dtype, bw, enc_type, is_sym, axis, scale, offset, min, max of one observer's qparams."""
    scale, zero_point = obs.calculate_qparams()
    scale = scale.detach().double().flatten()
    zp = zero_point.detach().double().flatten()
    dtype, bits = _dtype_name(obs)
    qmin, qmax = int(obs.quant_min), int(obs.quant_max)
    per_channel = obs.qscheme in (torch.per_channel_symmetric, torch.per_channel_affine)
    enc: dict[str, Any] = {
        "dtype": dtype,
        "bw": bits,
        "enc_type": "PER_CHANNEL" if per_channel else "PER_TENSOR",
        "is_sym": obs.qscheme in (torch.per_tensor_symmetric, torch.per_channel_symmetric),
        "axis": int(obs.ch_axis) if per_channel else None,
        "scale": scale.tolist(),
        "offset": [int(-z) for z in zp.tolist()],
        "min": (scale * (qmin - zp)).tolist(),
        "max": (scale * (qmax - zp)).tolist(),
    }
    if isinstance(obs, LpbqPerChannelObserver):
        _, base, k = obs.block_qparams()
        enc.update(enc_type="LPBQ", block_size=obs.block_size, compressed_bw=obs.scale_bits,
                   per_channel_float_scale=base.double().tolist(), per_block_int_scale=k.int().tolist())
    return enc


def observed_tensors(gm: GraphModule) -> list[tuple[str, str, bool, torch.nn.Module]]:
    """(tensor name, module path, is_param, observer) for every observer call in graph order."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        obs = gm.get_submodule(node.target)
        if not is_observer(obs):
            continue
        src: Node = node.args[0]
        if src.op == "call_module":  # an input-edge requantization after the producer's own encoding
            while src.op == "call_module":
                src = src.args[0]
            consumers = sorted(u.name for u in node.users)
            name = f"{src.name}->{','.join(consumers)}"
        else:
            name = str(src.target) if src.op == "get_attr" else src.name
        out.append((name, g.module_path(src), src.op == "get_attr", obs))
    return out


def collect_encodings(gm: GraphModule) -> dict[str, Any]:
    """The encodings of a calibrated prepared graph (see the module docstring)."""
    acts, params, seen = [], [], set()
    for name, module, is_param, obs in observed_tensors(gm):
        if name in seen:
            continue
        seen.add(name)
        enc = {"name": name, "module": module, **observer_encoding(obs)}
        (params if is_param else acts).append(enc)
    return {"version": FORMAT_VERSION, "activation_encodings": acts, "param_encodings": params}


def _qparams_of_qdq(node: Node, gm: GraphModule) -> tuple[float, int]:
    """(scale, zero point) of a per-tensor quantize/dequantize node of a converted graph."""
    scale, zp = node.args[1], node.args[2]
    return float(scale), int(zp)


def kv_io_qparams(gm: GraphModule, num_layers: int) -> list[tuple[str, tuple[float, int], tuple[float, int]]]:
    """For each KV cache of a converted prefill/decode graph: (name, input (scale, zp),
    output (scale, zp)), read from the quantize node on the cache input and the dequantize
    node feeding the matching K/V output."""
    caches = g.cache_inputs(gm, num_layers)
    outs = g.graph_outputs(gm)[1:]
    if not caches:
        raise ValueError("the graph has no KV-cache inputs (a calibrate graph?)")
    result = []
    for i, (cache, out) in enumerate(zip(caches, outs)):
        q = next(u for u in cache.users if "quantize_per_tensor" in str(u.target))
        if "dequantize_per_tensor" not in str(out.target):
            raise ValueError(f"K/V output {i} is not dequantized from a quantized tensor: {out.target}")
        kind = "k" if i < num_layers else "v"
        result.append((f"{kind}_cache_{i % num_layers}", _qparams_of_qdq(q, gm), _qparams_of_qdq(out, gm)))
    return result
