"""A minimal, test-only PT2E quantizer and a converted tiny decoder program.

It stands in for npuq's real quantizer so the lowering can be developed and tested on its
own. It produces the standard ``quantized_decomposed`` representation the real one does:
uint16 activations carried as int32 over [0, 65535], int8 (or int4-in-int8) symmetric
per-channel weights, int32 bias derived from activation × weight scales, a per-row (PCQ)
or per-tensor uint16 embedding table. Data-movement ops share their input's encoding, so the
K/V cache inputs end up with the encoding of the matching new-entry outputs, as a device
runner needs.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from torchao.quantization.pt2e.observer import MinMaxObserver, PerChannelMinMaxObserver
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import (
    DerivedQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
    SharedQuantizationSpec,
)

aten = torch.ops.aten

ACT_U16 = QuantizationSpec(
    dtype=torch.int32, quant_min=0, quant_max=65535, qscheme=torch.per_tensor_affine,
    observer_or_fake_quant_ctr=MinMaxObserver.with_args(dtype=torch.int32, quant_min=0, quant_max=65535),
)


# Second input of an activation x activation matmul: int16 symmetric (docs/design.md §1).
ACT_I16 = QuantizationSpec(
    dtype=torch.int16, quant_min=-32767, quant_max=32767, qscheme=torch.per_tensor_symmetric,
    observer_or_fake_quant_ctr=MinMaxObserver.with_args(
        dtype=torch.int16, quant_min=-32767, quant_max=32767, qscheme=torch.per_tensor_symmetric),
)


def weight_spec(bits: int) -> QuantizationSpec:
    qmax = 2 ** (bits - 1) - 1
    return QuantizationSpec(
        dtype=torch.int8, quant_min=-qmax, quant_max=qmax, qscheme=torch.per_channel_symmetric, ch_axis=0,
        observer_or_fake_quant_ctr=PerChannelMinMaxObserver.with_args(
            dtype=torch.int8, quant_min=-qmax, quant_max=qmax, qscheme=torch.per_channel_symmetric, ch_axis=0),
    )


# Ops whose output is a rearrangement of their first input: they share its encoding.
SHARING = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.cat.default, aten.to.dtype,
    aten.alias.default, aten.clone.default, aten.expand.default, aten.index.Tensor, aten.select.int,
}
SKIP = {aten._assert_tensor_metadata.default}


def _is_float(n) -> bool:
    return isinstance(n, Node) and "val" in n.meta and getattr(n.meta["val"], "dtype", None) == torch.float32


class TinyQuantizer(Quantizer):
    """Annotates every float op of a static decoder; ``embedding`` is "pcq" or "per_tensor".

    ``norm="fused"`` treats each RMSNorm as one op, as npuq's quantizer does (input, weight
    and output quantized, internals float); ``"per_op"`` quantizes every op inside it too.
    """

    def __init__(self, weight_bits: int = 8, embedding: str = "pcq", norm: str = "fused"):
        super().__init__()
        self.weight = weight_spec(weight_bits)
        self.embedding = embedding
        self.norm = norm

    def annotate(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        from npuq.lower.patterns import match_patterns

        norms = match_patterns(gm.graph) if self.norm == "fused" else {}
        internal = {n for m in norms.values() for n in m.internal}
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target in SKIP or not _is_float(node) or node in internal:
                continue
            if node in norms:
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={norms[node].weight: ACT_U16}, output_qspec=ACT_U16, _annotated=True)
                continue
            inputs = [a for a in node.args if _is_float(a)]
            if node.target is aten.cat.default:
                inputs = [a for a in node.args[0] if _is_float(a)]
            qmap = {}
            out = ACT_U16
            if node.target is aten.linear.default:
                x, w = node.args[0], node.args[1]
                qmap = {x: ACT_U16, w: self.weight}
                if len(node.args) > 2 and node.args[2] is not None:
                    def derive(obs):
                        act, wt = obs
                        s_a, _ = act.calculate_qparams()
                        s_w, _ = wt.calculate_qparams()
                        s = (s_a * s_w).to(torch.float32)
                        return s, torch.zeros_like(s, dtype=torch.int32)
                    qmap[node.args[2]] = DerivedQuantizationSpec(
                        derived_from=[(x, node), (w, node)], derive_qparams_fn=derive, dtype=torch.int32,
                        quant_min=-(2**31), quant_max=2**31 - 1, qscheme=torch.per_channel_symmetric, ch_axis=0)
            elif node.target is aten.embedding.default:
                table = node.args[0]
                qmap = {table: self.weight if self.embedding == "pcq" else ACT_U16}
                if self.embedding != "pcq":
                    out = SharedQuantizationSpec((table, node))
            elif node.target is aten.matmul.default:
                a, b = node.args[0], node.args[1]
                qmap = {a: ACT_U16, b: ACT_I16}
            elif node.target in SHARING:
                first = inputs[0]
                qmap = {first: ACT_U16}
                for other in inputs[1:]:
                    qmap[other] = SharedQuantizationSpec((first, node))
                out = SharedQuantizationSpec((first, node))
            else:
                qmap = {a: ACT_U16 for a in inputs}
            node.meta["quantization_annotation"] = QuantizationAnnotation(
                input_qspec_map=qmap, output_qspec=out, _annotated=True)
        return gm

    def validate(self, model: torch.fx.GraphModule) -> None:
        pass


def converted_tiny(name: str = "llama", mode: str = "decode", context: int = 16, ar_len: int = 4,
                   weight_bits: int = 8, embedding: str = "pcq", calib_steps: int = 4, seed: int = 0,
                   norm: str = "fused"):
    """(decoder, calibration inputs, converted GraphModule) for a tiny model of family ``name``.

    Calibration runs the graph on random tokens, cache lengths and cache contents. Compare
    backends on these same inputs: outside the calibrated ranges values saturate, and the
    HTP and the CPU provider saturate intermediate results differently.
    """
    from npuq.testing.tiny import tiny_decoder
    from npuq.runtime.runner import example_inputs

    _, model = tiny_decoder(name, seed=seed, max_context=context)
    example = example_inputs(model.config, mode, context, ar_len=ar_len)
    gm = torch.export.export(model, example).module()
    prepared = prepare_pt2e(gm, TinyQuantizer(weight_bits, embedding, norm))
    g = torch.Generator().manual_seed(seed)
    calib = [calibration_inputs(model, example, g) for _ in range(calib_steps)]
    with torch.no_grad():
        for inputs in calib:
            prepared(*inputs)
    return model, calib, convert_pt2e(prepared)


def calibration_inputs(model, example, g: torch.Generator):
    """Random inputs shaped like ``example``: tokens, a random number of cached positions
    (mask and positions to match) and random cache contents."""
    from npuq.runtime.runner import step_inputs

    batch, T = example[0].shape
    context = example[1].shape[-1]
    n_past = int(torch.randint(0, context - T + 1, (1,), generator=g)) if len(example) > 3 else 0
    tokens = torch.randint(0, model.config.vocab_size, (batch, T), generator=g)
    tokens, mask, positions = step_inputs(model.config, tokens, n_past, context)
    caches = tuple(torch.randn(c.shape, generator=g) * 0.5 for c in example[3:])
    return (tokens, mask, positions, *caches)


def quantize_module(module: torch.nn.Module, calib: list[tuple], **options) -> torch.fx.GraphModule:
    """Export ``module`` on calib[0], annotate with TinyQuantizer(**options), calibrate, convert."""
    gm = torch.export.export(module, calib[0]).module()
    prepared = prepare_pt2e(gm, TinyQuantizer(**options))
    with torch.no_grad():
        for inputs in calib:
            prepared(*inputs)
    return convert_pt2e(prepared)
