"""Test helper: the quantization noise of a converted PT2E program, from its step sizes.

Shared by the tests whose bounds are derived from the quantization arithmetic (issue #18)
rather than tuned: the lowering tests (an implementation against the program's own rounding
noise) and the accuracy tests (quantized against float, predicted from the steps).

Two models, both stated where they are used:

* Requantization noise. Rounding to a grid of step Δ adds an error uniform on ±Δ/2: variance
  1/12 code². A second implementation of the same program whose value before a rounding lies
  within d codes of the program's differs after it by d + e, E[e] = 0, Var(e) <= 1/4, so
  E[(d + e)²] <= d² + 1/4 where the program's own rounding adds 1/12. Both reach the outputs
  through the same (linearized) ops, so the RMS of the output difference is at most
  sqrt(12 · (d² + 1/4)) times the RMS of the program's own activation noise, or per class of
  points :func:`bounded_rms` (the noise measured with :func:`without_activation_rounding`).

* Signal to noise. Quantizing a signal of mean power P on a grid of step Δ adds noise of power
  Δ²/12 (plus whatever the grid's range clips): an SQNR of 10·log10(P / (Δ²/12)). Through a
  network the points' noises pass through the ops' gains (a softmax turns an absolute score
  error into a relative probability error), which a sum of per-point ratios misses:
  :func:`modelled_logits` runs the program with that noise model at every point instead.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import torch
import torchao.quantization.quant_primitives  # noqa: F401  (registers torch.ops.quantized_decomposed)

QD = torch.ops.quantized_decomposed
REQUANT = (QD.quantize_per_tensor.default, QD.quantize_per_tensor.tensor)
DEQUANT = (QD.dequantize_per_tensor.default, QD.dequantize_per_tensor.tensor)

# How far apart the float results of torch and ONNX Runtime may lie before a requantization,
# in codes of its 16-bit output (a value is at most 2^16 codes from the zero point). Both
# compute the same ops in float32 and differ only in the order and blocking of their sums, FMA
# use and the polynomials of exp / sigmoid: differences of rounding-error size. On an n-term
# dot product (n <= 96 here) each side is off by at most (n+1)·2^-24 of Σ|a·b|, so they differ
# by 0.76 code at worst when that sum is at full range; typically by √n·2^-24 of it
# (independent rounding errors): 0.04 code.
FLOAT_DIFF_MAX = 0.76
FLOAT_DIFF_TYPICAL = 0.04


def rms(x) -> float:
    x = x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    return float(np.sqrt(np.mean(np.square(x.astype(np.float64)))))


def without_activation_rounding(cgm, keep=()):
    """A copy of the program with every activation quantize → dequantize pair replaced by a clamp
    to its range (the weights stay quantized): the PT2E program minus its activation rounding
    noise, the clipping of values outside a calibrated range kept. The requantizations named in
    ``keep`` stay."""
    gm = copy.deepcopy(cgm)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in REQUANT and n.name not in keep:
            x, scale, zp, qmin, qmax = n.args[:5]
            for u in list(n.users):
                if u.target in DEQUANT:
                    if isinstance(scale, torch.fx.Node):
                        u.replace_all_uses_with(x)
                        continue
                    with gm.graph.inserting_after(u):
                        c = gm.graph.call_function(torch.ops.aten.clamp.default,
                                                   (x, (qmin - zp) * float(scale), (qmax - zp) * float(scale)))
                    u.replace_all_uses_with(c)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def sigmoid_slack(cgm):
    """{requantization after a SiLU: the most its ONNX spelling may move the value, in codes}.

    PT2E rounds SiLU once, at its output; ONNX computes x · sigmoid(x) with the sigmoid
    re-encoded in between (sigmoid_encoding), off by at most half a sigmoid step: the product
    by at most max|x| · step / 2."""
    from npuq.lower.builders.elementwise import sigmoid_encoding
    from npuq.lower.qparams import Encoding

    slack = {}
    for n in cgm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.silu.default:
            dq = n.args[0]
            scale, zp, qmin, qmax = dq.args[1:5]
            x_enc = Encoding.per_tensor(scale, zp, qmin, qmax)
            x_max = max(abs(qmin - zp), abs(qmax - zp)) * scale
            for q in n.users:
                if q.target in REQUANT:
                    slack[q.name] = x_max * float(sigmoid_encoding(x_enc).scale) / 2 / q.args[1]
    return slack


def bounded_rms(v_rest: float, v_silu: float, d_plain: float, d_silu: float) -> float:
    """The most the RMS of an implementation's output difference may be when its values before
    each rounding lie within ``d_plain`` codes of the program's, ``d_silu`` at SiLU outputs
    (module docstring: each point adds at most d² + 1/4 code² where the program's own rounding
    adds 1/12): sqrt(12 · ((d_plain² + 1/4) · v_rest + (d_silu² + 1/4) · v_silu)), where v_silu
    and v_rest are the output noise variances the program's own rounding causes at the SiLU
    outputs and everywhere else (:func:`without_activation_rounding` with ``keep``)."""
    return math.sqrt(12 * ((d_plain**2 + 0.25) * v_rest + (d_silu**2 + 0.25) * v_silu))


def with_8bit_second_inputs(cgm):
    """The program with the rounding the lowering adds below HTP v73 made part of it: each
    activation × activation MatMul's second input re-encoded at 8 bits over its range (the
    matmul builder's uint8 encoding, docs/design.md §9), a rounding 256 times coarser than the
    program's own there, so that its noise counts in the shares of :func:`bounded_rms`."""
    from npuq.lower.qparams import Encoding, affine_for_range

    gm = copy.deepcopy(cgm)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.matmul.default:
            b = n.args[1]
            if not (isinstance(b, torch.fx.Node) and b.target is QD.dequantize_per_tensor.default):
                continue
            enc = Encoding.per_tensor(*b.args[1:5])
            if enc.bits != 16:
                continue
            enc = affine_for_range(*enc.range(), 8)
            args = (float(enc.scale), int(enc.zero_point), 0, 255, torch.uint8)
            with gm.graph.inserting_before(n):
                q = gm.graph.call_function(QD.quantize_per_tensor.default, (b, *args))
                dq = gm.graph.call_function(QD.dequantize_per_tensor.default, (q, *args))
            n.args = (n.args[0], dq, *n.args[2:])
    gm.recompile()
    return gm


# --------------------------------------------------------------------------- weights
def reference_weight(w, qmax, block=None):
    """(dequantized weight, scale per element) by an integer reference written from
    docs/design.md §1, not from npuq's code: symmetric per output channel, scale = max|w| / qmax,
    codes = clamp(round(w / scale), ±qmax); LPBQ: per block of ``block`` inputs
    s_b = max|w_b| / qmax, base = max_b s_b / 16, block scale = base · clamp(ceil(s_b / base), 1, 16)."""
    if block is None:
        scale = (w.abs().amax(dim=1, keepdim=True) / qmax).expand_as(w)
    else:
        O, I = w.shape
        s_b = w.abs().view(O, I // block, block).amax(-1) / qmax  # (O, blocks)
        base = s_b.amax(1, keepdim=True) / 16
        scale = (base * torch.clamp(torch.ceil(s_b / base), 1, 16)).repeat_interleave(block, dim=1)
    codes = torch.clamp(torch.round(w / scale), -qmax, qmax)
    return codes * scale, scale


# --------------------------------------------------------------------------- signal to noise
def constant(gm, node):
    """Evaluate a node whose inputs are all constants (get_attr) in a converted graph."""
    if isinstance(node, (list, tuple)):
        return type(node)(constant(gm, n) for n in node)
    if not isinstance(node, torch.fx.Node):
        return node
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return obj
    assert node.op == "call_function", node
    return node.target(*constant(gm, node.args), **{k: constant(gm, v) for k, v in node.kwargs.items()})


def _step(gm, n):
    """The step per element of a dequantized constant (weight, table, gamma); None for any other
    node and for int32 biases (their step is input step × weight step)."""
    if n.op != "call_function" or not isinstance(n.args[0], torch.fx.Node) or n.args[0].op != "get_attr":
        return None
    t = str(n.target)
    if "dequantize_per_tensor" in t:
        codes, scale, zp, qmin, qmax = constant(gm, n.args[:5])
        step = torch.full(codes.shape, float(scale))
    elif "dequantize_per_channel" in t:
        codes, scale, zp, axis, qmin, qmax = constant(gm, n.args[:6])
        shape = [1] * codes.dim()
        shape[axis] = -1
        step = scale.reshape(shape).expand(codes.shape)
    elif "dequantize_affine" in t:
        codes, block, scale = constant(gm, n.args[:3])
        qmin = n.args[5]
        step = scale
        for d, b in enumerate(block):
            step = step.repeat_interleave(b, dim=d) if b > 1 else step
    else:
        return None
    return None if qmin <= -(2**31) else step.float()


def _evaluate(gm, n):
    return n.target(*constant(gm, n.args), **{k: constant(gm, v) for k, v in n.kwargs.items()})


# Ops that only move data: a requantization of their output to their input's encoding rounds
# nothing (a KV cache read back, a transpose, a concat of equally encoded parts ...).
_MOVES = {"view", "reshape", "_unsafe_view", "transpose", "permute", "unsqueeze", "squeeze", "slice", "cat",
          "to", "alias", "clone", "expand", "index", "select", "contiguous"}


def _rounds_nothing(q) -> bool:
    todo, seen = [q.args[0]], set()
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder":  # a cache input: the program's own earlier output, on its grid
            continue
        if x.op != "call_function":
            return False
        if x.target in DEQUANT:
            if tuple(x.args[1:3]) != tuple(q.args[1:3]):
                return False
        elif getattr(x.target, "__name__", "").split(".")[0] in _MOVES:
            todo.extend(a for a in (x.args[0] if isinstance(x.args[0], (list, tuple)) else x.args[:1])
                        if isinstance(a, torch.fx.Node))
        else:
            return False
    return True


def _off_grid(codes):
    """1 where a value lies off its grid, 0 where it lies on it: a value on the grid (a zero
    embedding row, an exact constant) rounds to itself, and a norm over an all-zero row would
    blow the model's noise up to unit size (rsqrt(eps) = 1000)."""
    return ((codes - codes.round()).abs() > 1e-4).to(codes.dtype)


class _NoiseModel(torch.fx.Interpreter):
    """Runs a program with every rounding replaced by its noise model: an activation
    requantization by clamp(x) + U(-Δ/2, Δ/2) (none on values already on the grid), a constant
    by its float value plus uniform noise of its own step (likewise) (``weights``: {dequantize node name: that noisy value}). A
    requantization that rounds nothing (``exact``) only clamps."""

    def __init__(self, gm, weights, g):
        super().__init__(gm)
        self.weights, self.g, self.modelled = weights, g, {}

    def run_node(self, n):
        if n.op == "call_function" and n.name in self.weights:
            return self.weights[n.name]
        if n.op == "call_function" and n.target in REQUANT:
            x = self.env[n.args[0]]
            scale, zp, qmin, qmax = (float(a) for a in n.args[1:5])
            x = x.clamp((qmin - zp) * scale, (qmax - zp) * scale)
            if n.name not in self.exact:
                x = x + _off_grid(x / scale + zp) * (torch.rand(x.shape, generator=self.g) - 0.5) * scale
            self.modelled[n.name] = x
        if n.op == "call_function" and n.target in DEQUANT and getattr(n.args[0], "target", None) in REQUANT:
            return self.modelled[n.args[0].name]
        return super().run_node(n)


class _Modelled:
    def __init__(self, gm, weights, g):
        self.gm, self.weights, self.g = gm, weights, g
        self.exact = {n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in REQUANT
                      and _rounds_nothing(n)}

    def __call__(self, *args):
        run = _NoiseModel(self.gm, self.weights, self.g)
        run.exact = self.exact
        return run.run(*args)


def float_constants(gm, float_model):
    """{dequantize node name: (parameter name, float value, step per element)}: each quantized constant of
    the program matched to the parameter of ``float_model`` it lies within half a step of."""
    params = [(k, p.detach().float()) for k, p in (*float_model.named_parameters(), *float_model.named_buffers())]
    out = {}
    for n in gm.graph.nodes:
        step = _step(gm, n)
        if step is None:
            continue
        wq = _evaluate(gm, n)
        for k, p in params:
            if p.shape == wq.shape and bool(((p - wq).abs() <= step / 2 + 1e-6 * p.abs().max()).all()):
                out[n.name] = (k, p, step)
                break
        else:
            raise AssertionError(f"no float parameter matches the constant {n.name} {tuple(wq.shape)}")
    return out


def modelled_logits(qm, float_model, tokens, seed=0):
    """The logits of QuantizedModel ``qm`` with every rounding replaced by its noise model
    (:class:`_NoiseModel`): what the step sizes alone predict, the gains of every op included.
    Each quantized constant gets one noise draw, shared by the decode and prefill programs."""
    import dataclasses

    g = torch.Generator().manual_seed(seed)
    noisy, weights = {}, {}
    for gm in (qm.decode, qm.prefill):
        weights[gm] = {}
        for name, (k, p, step) in float_constants(gm, float_model).items():
            key = (k, step.shape, float(step.double().sum()))  # a tied table is two constants
            if key not in noisy:
                noisy[key] = p + _off_grid(p / step) * (torch.rand(p.shape, generator=g) - 0.5) * step
            weights[gm][name] = noisy[key]
    model = dataclasses.replace(qm, decode=_Modelled(qm.decode, weights[qm.decode], g),
                                prefill=_Modelled(qm.prefill, weights[qm.prefill], g))
    with torch.no_grad():
        return model.logits(tokens)
