"""Per-layer quantization error: weight SQNR against an integer reference built from
encodings.json, and zero error when the "quantized" programs are the float model exported."""

import math

import pytest
import torch

from npuq.eval.layers import layer_errors, sqnr_db, worst
from npuq.testing.tiny import tiny_decoder
from npuq.quantize.artifact import load_artifact, save_artifact
from npuq.quantize.pt2e import quantize_model
from npuq.quant.recipe import RECIPES
from npuq.runtime.runner import example_inputs

CONTEXT, PREFILL = 32, 8


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    _, model = tiny_decoder("llama", seed=3, max_context=CONTEXT)
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(3, model.config.vocab_size, (3 * CONTEXT,), generator=g).tolist()
    qm = quantize_model(model, RECIPES["16a8w"], calib, context=CONTEXT, prefill_len=PREFILL)
    artifact = load_artifact(save_artifact(qm, tmp_path_factory.mktemp("layers") / "art"))
    ids = torch.randint(3, model.config.vocab_size, (2 * PREFILL,), generator=g).tolist()
    return model, artifact, ids


def test_sqnr_by_hand():
    ref = torch.tensor([3.0, 4.0])
    assert sqnr_db(ref, torch.tensor([3.0, 4.5])) == pytest.approx(10 * math.log10(25 / 0.25))
    assert sqnr_db(ref, ref.clone()) is None


def test_weight_sqnr_equals_the_integer_reference(quantized):
    model, artifact, ids = quantized
    errors = layer_errors(model, artifact.graphs(), artifact.config, CONTEXT, ids)
    linears = [p for p, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(e.path for e in errors) == sorted(linears)
    encodings = {e["name"]: e for e in artifact.encodings["param_encodings"]}
    checked = 0
    for e in errors:
        enc = encodings.get(f"{e.path}.weight")
        assert enc is not None and enc["enc_type"] == "PER_CHANNEL", e.path  # lm head included
        w = dict(model.named_modules())[e.path].weight.detach().double()
        scale = torch.tensor(enc["scale"], dtype=torch.float64)[:, None]
        codes = torch.clamp(torch.round(w / scale), -127, 127)  # symmetric int8, narrow range
        expected = 10 * math.log10(float((w**2).sum()) / float(((codes * scale - w) ** 2).sum()))
        assert e.weight_sqnr_db == pytest.approx(expected, rel=1e-4), e.path
        checked += 1
    assert checked == 2 * 7 + 1
    # 16-bit activations, 8-bit weights on a random model: errors are real but small
    outputs = [e.output_sqnr_db for e in errors]
    assert all(o is not None and 10 < o < 90 for o in outputs), outputs
    assert worst(errors, 3) == sorted(errors, key=lambda e: e.weight_sqnr_db or math.inf)[:3]


def test_float_programs_show_no_error(quantized):
    model, _, ids = quantized
    graphs = {}
    for mode, ar_len in (("decode", 1), ("prefill", PREFILL)):
        inputs = example_inputs(model.config, mode, CONTEXT, ar_len)
        graphs[ar_len] = torch.export.export(model, inputs).module()
    errors = layer_errors(model, graphs, model.config, CONTEXT, ids)
    assert len(errors) == 2 * 7 + 1
    for e in errors:
        assert e.output_sqnr_db is None or e.output_sqnr_db > 100, e
        assert e.weight_sqnr_db is None, e
