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

import json
import math
import os
from json.encoder import encode_basestring_ascii as string
from typing import Any

import torch
from torch.fx import GraphModule, Node

from npuq.errors import NpuqError
from npuq.fsio import read_json
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


def encodings_json(encodings: dict[str, Any]) -> str:
    """``json.dumps(encodings, indent=1)``, character for character, in a fraction of its time.

    With ``indent`` set, ``json`` encodes value by value in Python (its C encoder only serves
    compact output): 2-3 s for the 17 MB of a 135M model's encodings. Here each list of numbers
    is joined in one go, with the same spellings (``float.__repr__``, ``int.__repr__``, and
    ``NaN``/``Infinity`` as ``json`` writes them), the same separators and the same escaping of
    strings (``json``'s own ``ensure_ascii`` encoder); lists of numbers go through ``json``'s C
    encoder (the spellings above) and are then split one number a line."""
    def scalar(v: Any) -> str:
        if v is True:
            return "true"
        if v is False:
            return "false"
        if v is None:
            return "null"
        if isinstance(v, int):
            return int.__repr__(v)
        if isinstance(v, float):
            if v != v:
                return "NaN"
            if v in (math.inf, -math.inf):
                return "Infinity" if v > 0 else "-Infinity"
            return float.__repr__(v)
        if isinstance(v, str):
            return string(v)
        raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")

    def value(v: Any, level: int) -> str:
        if isinstance(v, dict):
            if not v:
                return "{}"
            inner = "\n" + " " * (level + 1)
            items = (f"{string(k) if isinstance(k, str) else string(scalar(k))}: {value(x, level + 1)}" for k, x in v.items())
            return "{" + inner + ("," + inner).join(items) + "\n" + " " * level + "}"
        if isinstance(v, (list, tuple)):
            if not v:
                return "[]"
            inner = "\n" + " " * (level + 1)
            if set(map(type, v)) <= {int, float}:  # json's C encoder, then one item a line
                items = json.dumps(v)[1:-1].split(", ")
            else:
                items = (value(x, level + 1) for x in v)
            return "[" + inner + ("," + inner).join(items) + "\n" + " " * level + "]"
        return scalar(v)

    return value(encodings, 0)


_ENC_TYPES = ("PER_TENSOR", "PER_CHANNEL", "LPBQ")


def read_encodings(path: str | os.PathLike) -> dict[str, Any]:
    """encodings.json as :func:`collect_encodings` writes it, checked entry by entry: names,
    dtype and bit width, encoding type, and per-entry lists of finite scales (> 0), integer
    offsets and finite min/max of one common length. :class:`NpuqError` names the first problem."""
    where, again = f"{path}", "quantize the model again"
    data = read_json(path, "encodings", again)
    if not isinstance(data, dict) or not isinstance(data.get("version"), str):
        raise NpuqError(f"{where}: not an encodings file (an object with a 'version'); {again}")
    for section in ("activation_encodings", "param_encodings"):
        entries = data.get(section)
        if not isinstance(entries, list):
            raise NpuqError(f"{where}: {section!r} is missing or not a list; {again}")
        for i, enc in enumerate(entries):
            _check_encoding(enc, f"{where}: {section}[{i}]", again)
    return data


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:
    return (isinstance(v, float) or _is_int(v)) and math.isfinite(v)


def _check_encoding(enc: Any, where: str, again: str) -> None:
    if not isinstance(enc, dict):
        raise NpuqError(f"{where} is not an object; {again}")
    if not isinstance(enc.get("name"), str) or not enc["name"]:
        raise NpuqError(f"{where} has no tensor name; {again}")
    where = f"{where} ({enc['name'][:60]})"
    if not isinstance(enc.get("dtype"), str) or not _is_int(enc.get("bw")) or not 1 <= enc["bw"] <= 32:
        raise NpuqError(f"{where}: dtype/bw missing or out of range (bw 1 to 32); {again}")
    if enc.get("enc_type") not in _ENC_TYPES:
        raise NpuqError(f"{where}: enc_type {enc.get('enc_type')!r:.40} is not one of {', '.join(_ENC_TYPES)}; {again}")
    lists = {key: enc.get(key) for key in ("scale", "offset", "min", "max")}
    if not all(isinstance(v, list) and v for v in lists.values()) or len({len(v) for v in lists.values()}) != 1:
        raise NpuqError(f"{where}: scale, offset, min and max must be non-empty lists of one length; {again}")
    if not all(_is_finite(s) and s > 0 for s in lists["scale"]):
        raise NpuqError(f"{where}: every scale must be a finite number above 0; {again}")
    if not all(_is_int(o) for o in lists["offset"]) or not all(_is_finite(v) for v in lists["min"] + lists["max"]):
        raise NpuqError(f"{where}: offsets must be whole numbers and min/max finite numbers; {again}")


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
