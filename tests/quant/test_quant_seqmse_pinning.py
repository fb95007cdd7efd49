"""SeqMSE/GPTQ scales reach the artifact: pinned observers report exactly the chosen encodings."""

import pytest
import torch

from npuq.calibrate.split import split_windows
from npuq.errors import NpuqError
from npuq.testing.tiny import tiny_decoder
from npuq.quantize.pt2e import quantize_model
from npuq.quant.recipe import load_recipe
from npuq.optimize.driver import RecoveryOptions
from npuq.optimize.gptq import GptqOptions
from npuq.optimize.recovery import optimize_for_recipe
from npuq.runtime.runner import forward_logits


def _tokens(vocab, n, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _sqnr(ref, x):
    return 10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum()).item()


@pytest.mark.parametrize("rounding", ["nearest", "gptq"])
def test_optimized_scales_land_in_the_encodings(rounding):
    _, model = tiny_decoder("llama", seed=4, max_context=32)
    float_model = tiny_decoder("llama", seed=4, max_context=32)[1]
    recipe = load_recipe("16a4w")
    tokens = _tokens(model.config.vocab_size, 96)
    windows = split_windows(tokens, 32)
    scales, summary = optimize_for_recipe(model, recipe, windows, RecoveryOptions(seq_mse=20, weight_rounding=rounding),
                                          progress=False)
    assert summary.layers == len(scales) and summary.output_error_reduction > 0
    qm = quantize_model(model, recipe, tokens, context=32, weight_scales=scales)
    params = {e["name"]: e for e in qm.encodings["param_encodings"]}
    for path, scale in scales.items():
        got = torch.tensor(params[f"{path}.weight"]["scale"], dtype=torch.float32)
        live = scale > 1e-6  # an all-zero row (the padding token's) takes the observer's eps floor
        assert torch.allclose(got[live], scale[live], rtol=1e-6), path
        assert (got[~live] < 1e-4).all()
    # The programs carry exactly the optimised weights: against the float model holding those
    # weights, only the 16-bit activation rounding remains (compare 16a8w's ~31 dB vs float).
    held_out = _tokens(model.config.vocab_size, 24, seed=9).unsqueeze(0)
    assert _sqnr(forward_logits(model, held_out), qm.logits(held_out)) > 25
    # ... while plain min/max 4-bit weights are far from them (the check above is not vacuous).
    plain = quantize_model(float_model, recipe, tokens, context=32)
    assert _sqnr(forward_logits(model, held_out), plain.logits(held_out)) < 20


def test_bad_candidate_count_is_refused():
    _, model = tiny_decoder("llama", max_context=32)
    windows = split_windows(_tokens(model.config.vocab_size, 64), 32)
    with pytest.raises(NpuqError, match="at least 1"):
        optimize_for_recipe(model, load_recipe("16a4w"), windows, RecoveryOptions(seq_mse=0), progress=False)


def test_sixteen_bit_weights_are_left_alone_and_a_recipe_of_only_those_is_refused():
    from npuq.quant.recipe import Recipe, Rule

    _, model = tiny_decoder("llama", seed=2, max_context=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    windows = split_windows(_tokens(model.config.vocab_size, 64), 32)
    mixed = Recipe("16a4w", (Rule("16a16w", op="linear", path=r"layers\.\d+\.mlp\.down_proj", priority=1),))
    scales, _ = optimize_for_recipe(model, mixed, windows, RecoveryOptions(weight_rounding="gptq"), progress=False)
    after = model.state_dict()
    down = [k for k in before if "down_proj.weight" in k]
    assert down and all(torch.equal(before[k], after[k]) for k in down)  # 16-bit: kept as they are
    assert not any("down_proj" in path for path in scales)
    assert not torch.equal(before["layers.0.mlp.up_proj.weight"], after["layers.0.mlp.up_proj.weight"])  # 4-bit: rounded
    with pytest.raises(NpuqError, match="do not apply to recipe '16a16w'.*drop"):
        optimize_for_recipe(model, load_recipe("16a16w"), windows, RecoveryOptions(weight_rounding="gptq"),
                            progress=False)


@pytest.mark.parametrize("options, message", [
    ({"seq_mse": None, "weight_rounding": "nearest", "layer_inputs": "float", "act_order": True}, "add --weight-rounding gptq"),
    ({"seq_mse": None, "weight_rounding": "nearest", "layer_inputs": "quantized", "act_order": False}, "neither is on"),
    ({"seq_mse": 0, "weight_rounding": "gptq", "layer_inputs": "float", "act_order": False}, "at least 1"),
    ({"seq_mse": None, "weight_rounding": "stochastic", "layer_inputs": "float", "act_order": False}, "choose one of"),
])
def test_recovery_options_that_do_not_fit_together_are_refused(options, message):
    from npuq.quantize.stage import QuantizeOptions

    with pytest.raises(NpuqError, match=message):
        QuantizeOptions(**options)
    both = QuantizeOptions(seq_mse=50, weight_rounding="gptq", layer_inputs="quantized", act_order=True)  # all fine
    assert both.recovery == RecoveryOptions(50, "channel", "gptq", "quantized", GptqOptions(act_order=True))


def test_lpbq_scales_follow_the_observer_rule():
    from npuq.optimize.seqmse import lpbq_scale
    from npuq.quant.observers import LpbqPerChannelObserver

    g = torch.Generator().manual_seed(5)
    weight = torch.randn(16, 128, generator=g) * torch.rand(16, 128, generator=g).pow(4)
    weight[3] = 0.0  # an all-zero row: the eps floor
    obs = LpbqPerChannelObserver(block_size=32, scale_bits=4, eps=1e-4 / 14, dtype=torch.int8, quant_min=-7,
                                 quant_max=7, qscheme=torch.per_channel_symmetric)
    obs(weight)
    expected, _, _ = obs.block_qparams()
    assert torch.allclose(lpbq_scale(weight, 4, 32, 4, eps=1e-4 / 14), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("seq_mse", [None, 20])
def test_lpbq_blocks_land_in_the_encodings(seq_mse):
    # GPTQ alone, and SeqMSE (one multiplier per channel base) + GPTQ, on 16a4w_block: the
    # artifact's LPBQ encodings (float base × integer k) are exactly the scales chosen.
    _, model = tiny_decoder("llama", seed=4, max_context=32)
    recipe = load_recipe("16a4w_block")
    tokens = _tokens(model.config.vocab_size, 96)
    scales, summary = optimize_for_recipe(model, recipe, split_windows(tokens, 32),
                                          RecoveryOptions(seq_mse, weight_rounding="gptq"), progress=False)
    assert summary.output_error_reduction > 0 and all(s.dim() == 2 for s in scales.values())
    qm = quantize_model(model, recipe, tokens, context=32, weight_scales=scales)
    params = {e["name"]: e for e in qm.encodings["param_encodings"]}
    for path, scale in scales.items():
        enc = params[f"{path}.weight"]
        assert enc["enc_type"] == "LPBQ"
        got = torch.tensor(enc["per_channel_float_scale"]).unsqueeze(1) * torch.tensor(enc["per_block_int_scale"])
        # An all-zero channel (the pad row of a tied table) has codes 0 at any scale: the
        # observer's eps floor picks its own, which changes no dequantized value. Compare the rest.
        live = dict(model.named_modules())[path].weight.detach().abs().amax(dim=1) > 0
        assert torch.allclose(got.float()[live], scale[live], rtol=1e-5), path
    # Against the model holding these weights only the 16-bit activation rounding remains
    # (23-31 dB on this random model, by the weights the options pick); the float weights'
    # 4-bit error alone would leave under 10 dB.
    held_out = _tokens(model.config.vocab_size, 24, seed=9).unsqueeze(0)
    assert _sqnr(forward_logits(model, held_out), qm.logits(held_out)) > 20
