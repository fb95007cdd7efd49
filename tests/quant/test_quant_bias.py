"""int32 biases that do not fit their scale s_in · s_w (npuq.quant.bias): the weight scale of
that channel is raised instead of the bias being clamped.

The planted bias is 4x the largest one the unraised scales can hold, computed here from the
float model alone: s_in from the range of the layer's input over the calibration windows (an
affine uint16 range always contains 0), s_w = max|W_c| / qmax. Without the fix the program's
bias is clamped to a quarter of its value (error 3x the bias); with it, the program's bias is
the float bias to within half a bias step, and the layer output keeps its SQNR.
"""

import copy

import pytest
import torch

from npuq.calibrate.split import split_windows
from npuq.eval.layers import LINEAR, layer_errors, module_path
from npuq.testing.tiny import tiny_decoder
from npuq.optimize.rotate import rotate_model
from npuq.quant.bias import INT32_MAX
from npuq.quant.recipe import load_recipe
from npuq.quantize.pt2e import quantize_model
from npuq.runtime.runner import forward_logits

CONTEXT, PREFILL = 16, 4
LAYER = "layers.0.self_attn.k_proj"


def _calib(vocab: int) -> torch.Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(3))  # every token once: 16 windows


def _room(model, calib, path: str, qmax: int) -> torch.Tensor:
    """(O,) the largest |bias| per channel that fits int32 at the scales min/max calibration gives."""
    linear = model.get_submodule(path)
    lo, hi = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    seen = []
    hook = linear.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().double()))
    for row in split_windows(calib, CONTEXT).rows():
        forward_logits(model, row.unsqueeze(0))
    hook.remove()
    for x in seen:
        lo, hi = torch.minimum(lo, x.min()), torch.maximum(hi, x.max())
    s_in = (hi - lo) / 65535
    s_w = linear.weight.detach().double().abs().amax(dim=1) / qmax
    return INT32_MAX * s_in * s_w


def _program_bias(gm, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized bias, its per-channel scale) of the linear node of ``path`` in a program."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is LINEAR and module_path(n) == path:
            dq = n.args[2]
            codes, scale = (getattr(gm, a.target) for a in dq.args[:2])
            return codes.double() * scale.double(), scale.double()
    raise AssertionError(f"no linear node for {path}")


@pytest.mark.parametrize("scheme,qmax", [("16a8w", 127), ("16a16w", 32767)])
def test_a_bias_beyond_the_int32_range_is_kept(scheme, qmax):
    torch.manual_seed(0)
    _, model = tiny_decoder("qwen2", seed=1, max_context=64)
    rotate_model(model, seed=0)  # Qwen2's case: q/k biases stay, the weights and inputs around them shrink
    calib = _calib(model.config.vocab_size)
    room = _room(model, calib, LAYER, qmax)
    with torch.no_grad():
        bias = model.get_submodule(LAYER).bias
        bias[3], bias[5] = 4 * room[3], -4 * room[5]
    want = bias.detach().double().clone()
    qm = quantize_model(model, load_recipe(scheme).with_rotation("r1"), calib, context=CONTEXT, prefill_len=PREFILL)
    (fit,) = [f for f in qm.stats["bias_fit"] if f["layer"] == LAYER]
    assert fit["channels"] == 2 and 3.9 < fit["max_ratio"] < 4.1
    got, scale = _program_bias(qm.prefill, LAYER)
    assert ((got - want).abs() <= 0.5 * scale + 1e-6 * want.abs()).all()  # clamped, channel 3 would be 3x room off
    errors = {e.path: e.output_sqnr_db for e in layer_errors(model, qm.graphs(), qm.config, CONTEXT,
                                                             torch.randint(0, 256, (16,)).tolist())}
    assert errors[LAYER] > 30  # the raised channels keep 127 / 4 codes; clamped, the output SQNR is below 0 dB


def test_biases_that_fit_keep_the_min_max_weight_scales():
    _, model = tiny_decoder("qwen2", seed=1, max_context=64)
    calib = _calib(model.config.vocab_size)
    qm = quantize_model(copy.deepcopy(model), load_recipe("16a8w").with_rotation(None), calib, context=CONTEXT,
                        prefill_len=PREFILL)
    assert qm.stats["bias_fit"] == []
    weights = {e["name"]: e for e in qm.encodings["param_encodings"]}
    w = model.get_submodule(LAYER).weight.detach().double()
    assert torch.allclose(torch.tensor(weights[f"{LAYER}.weight"]["scale"], dtype=torch.float64),
                          w.abs().amax(dim=1) / 127, rtol=1e-6)
