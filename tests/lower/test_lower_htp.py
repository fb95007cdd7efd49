"""Lowered graphs on the QNN HTP backend (onnxruntime-qnn; CPU emulation on x86-64).

Sessions disable CPU fallback, so creating one proves every node runs on the HTP; the EP's
verbose log is also checked for compute ops that ran unquantized.
"""

import numpy as np
import onnx
import pytest
import torch

from conftest import lower_tiny
from qdq_noise import bounded_rms, rms, with_8bit_second_inputs, without_activation_rounding
from test_lower_writer import feeds_for, reference_inputs
from npuq.errors import NpuqError
from npuq.lower.qparams import quantize
from npuq.lower.onnx_writer import lower_program
from npuq.lower.registry import LowerOptions
from npuq.lower.target import QnnVersion, Target
from npuq.lower.ort import cpu_session, float_compute_units, htp_node_units, htp_session, qnn_available

pytestmark = pytest.mark.skipif(qnn_available() is not None, reason=str(qnn_available()))


# The emulator's error model. Its kernels are closed, so their arithmetic cannot be derived, only
# bounded by a stated model; an op-by-op comparison (every op fed the program's codes, as in
# test_lower_writer) cannot be made either: the emulator refuses that graph, with every
# requantization made an input and an output (QNN_COMMON_ERROR_MEM_ALLOC). The model: its ops
# compute in fixed point and requantize to the graph's encodings, each value before its rounding
# within HTP_CODES codes of the exact CPU value: 1 code for a plain op (an integer rescale
# rounds its accumulator once more than the exact float), 2 after a SiLU, where the HTP
# substitutes its own sigmoid (0.6-0.8 codes low, within 2 codes:
# test_silu_on_htp_within_two_codes). By the variance argument of qdq_noise, a point where the
# values differ by d before rounding adds at most (d² + 1/4) code² where the program's own
# rounding adds 1/12, through the same linearized ops; so the RMS of the HTP's difference at an
# output is at most sqrt(12 · Σ_points (d² + 1/4) · v_point), v_point the output noise variance
# that the point's own rounding causes in the program: with the SiLU outputs' share v_silu and
# the rest v_rest, sqrt(12 · (1.25 · v_rest + 4.25 · v_silu)) -- 3.9 to 7.1 times the
# program's noise RMS.
HTP_CODES = {"plain": 1, "silu": 2}


def _htp_vs_cpu(lg, cgm, calib, arch):
    """{"logits" / "kv": (RMS of the HTP's difference from the exact CPU run, its bound by the
    model above)}: logits in their output steps, KV in codes."""
    from qdq_noise import sigmoid_slack

    cpu, htp = cpu_session(lg.model), htp_session(lg.model, arch)
    cgm = _with_lowering_roundings(cgm, lg)
    silu = set(sigmoid_slack(cgm))
    smooth, silu_only = without_activation_rounding(cgm), without_activation_rounding(cgm, keep=silu)
    step = float(lg.outputs[0].encoding.scale) if lg.outputs[0].encoding is not None else _logits_step(lg)
    diff = {"logits": [], "kv": []}
    v_silu = {"logits": [], "kv": []}
    v_rest = {"logits": [], "kv": []}
    for inputs in calib:
        feeds = feeds_for(lg, inputs)
        ref_in = reference_inputs(lg, feeds)
        with torch.no_grad():
            ref, ideal, mid = ([r.numpy() for r in f(*ref_in)] for f in (cgm, smooth, silu_only))
        a, b = cpu.run(None, feeds), htp.run(None, feeds)
        diff["logits"].append((b[0] - a[0]).ravel() / step)
        v_silu["logits"].append((mid[0] - ideal[0]).ravel() / step)
        v_rest["logits"].append((ref[0] - mid[0]).ravel() / step)
        for spec, x, y, r, f, m in zip(lg.outputs[1:], a[1:], b[1:], ref[1:], ideal[1:], mid[1:]):
            s, zp = float(spec.encoding.scale), float(spec.encoding.zero_point)
            diff["kv"].append((y.astype(np.int64) - x.astype(np.int64)).ravel())
            v_silu["kv"].append(((m - f) / s).ravel())
            v_rest["kv"].append((quantize(r, spec.encoding) - (m / s + zp)).ravel())
    out = {}
    for k in diff:
        rest, sil = rms(np.concatenate(v_rest[k])) ** 2, rms(np.concatenate(v_silu[k])) ** 2
        out[k] = (rms(np.concatenate(diff[k])), bounded_rms(rest, sil, HTP_CODES["plain"], HTP_CODES["silu"]))
    return out


def _with_lowering_roundings(cgm, lg):
    """The program with the roundings the lowering adds made part of it (below v73: the 8-bit
    MatMul second inputs, qdq_noise.with_8bit_second_inputs)."""
    if any(n.kind == "matmul_second_input" and n.detail["dtype"] == "uint8" for n in lg.notes):
        return with_8bit_second_inputs(cgm)
    return cgm


def _logits_step(lg):
    """The scale of the DequantizeLinear that gives the (float) logits."""
    producer = {o: n for n in lg.model.graph.node for o in n.output}
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in lg.model.graph.initializer}
    return float(inits[producer["logits"].input[1]])


@pytest.mark.parametrize("family, mode", [("llama", "decode"), ("llama", "prefill"), ("smollm3", "prefill")])
def test_tiny_decoder_on_htp(tiny_programs, family, mode):
    """Bound: the RMS of the HTP's difference from the exact CPU run, logits and KV codes, within
    the model above (the old, tuned bound was 1 % of the largest logit and 655 KV codes).
    Measured (RMS against bound): logits 11.1 / 41 (llama decode), 12.5 / 48 (llama prefill),
    17.0 / 59 (smollm3 prefill) output steps; KV 8.4 / 27, 9.1 / 33, 13.3 / 48 codes: a margin
    of 3.2-3.9. Broken on purpose (once): the MatMuls' second inputs given a uint16 encoding
    (the same grid: zero point 32768 for int16's 0), which the EP silently narrows to uint8
    (docs/design.md §9), fails both llama cases (logits 110 against 41, 117 against 48); one
    weight matrix's scale 1 % high on the HTP's side only fails llama prefill (KV 34.8 against
    32.6) and passes llama decode (logits 34 against 41): a gain error of 1 % in one layer is
    at the edge of what this check resolves.
    """
    model, calib, cgm = tiny_programs(family, mode)
    r = _htp_vs_cpu(lower_tiny(model, cgm), cgm, calib, 73)
    for k, (got, bound) in r.items():
        assert got <= bound, (k, got, bound)


def test_every_compute_op_runs_quantized(tiny_programs, tmp_path):
    model, _, cgm = tiny_programs("llama", "decode")
    path = tmp_path / "decode.onnx"
    onnx.save(lower_tiny(model, cgm).model, path)
    units = htp_node_units(path, 73)
    assert sum(units.values()) > 50
    assert float_compute_units(units) == []


def test_older_arch_gets_8bit_second_input(tiny_programs):
    model, calib, cgm = tiny_programs("llama", "decode")
    lg = lower_tiny(model, cgm, Target(QnnVersion(2, 51, 0), "test", 69))
    assert {n.detail["dtype"] for n in lg.notes if n.kind == "matmul_second_input"} == {"uint8"}
    r = _htp_vs_cpu(lg, cgm, calib[:2], 69)
    for k, (got, bound) in r.items():  # the model of test_tiny_decoder_on_htp (88 / 564, KV 54 / 378)
        assert got <= bound, (k, got, bound)


def test_int16_second_input_needs_v73(tiny_programs):
    """The pattern gate is real: the v73 lowering does not compile for a v68 HTP."""
    model, _, cgm = tiny_programs("llama", "decode")
    lg = lower_tiny(model, cgm)
    with pytest.raises(NpuqError, match="rejected the graph"):
        htp_session(lg.model, 68)


@pytest.mark.parametrize("pattern, storage, bound", [
    ("legacy", "u16", 1), ("optimized", "u16", 1),
    ("optimized", "int8-rowscale", 2),  # the Mul by the row scale rounds on the HTP's side
])
def test_pcq_embedding_patterns_on_htp(pattern, storage, bound):
    from pt2e_tiny import quantize_module
    from test_lower_builders import Embed

    ids = [(torch.arange(48).reshape(4, 12),), (torch.randint(0, 48, (4, 12)),)]
    cgm = quantize_module(Embed(), ids)
    lg = lower_program(cgm, Target(QnnVersion(2, 51, 0), "test", 73), LowerOptions(pattern, storage),
                       input_names=["ids"], output_names=["out"], quantized_io={"out"})
    cpu, htp = cpu_session(lg.model), htp_session(lg.model, 73)
    for (x,) in ids:
        a = cpu.run(None, {"ids": x.numpy().astype(np.int32)})[0].astype(np.int64)
        b = htp.run(None, {"ids": x.numpy().astype(np.int32)})[0].astype(np.int64)
        assert np.abs(a - b).max() <= bound


def test_silu_on_htp_within_two_codes():
    """The HTP computes its sigmoid with its own rounding whatever output encoding the graph
    asks for: codes top out at 65534 and run 0.6-0.8 codes low on average (probed on
    onnxruntime-qnn 2.7.0 / QNN 2.51). So SiLU on the HTP stays within 2 codes of the PT2E
    program but about 1.3 codes low for large inputs, where the exact CPU graph is unbiased
    (test_lower_builders.test_silu_is_unbiased_at_the_top_of_a_wide_range)."""
    from test_lower_builders import silu_case

    x, lg, ref = silu_case()
    got = htp_session(lg.model, 73).run(None, {"x": x.numpy()})[0].astype(np.int64)
    d = (got - ref).ravel()
    assert np.abs(d).max() <= 2
