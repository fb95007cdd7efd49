"""Decode and prefill programs carry the calibrated encodings, and each KV-cache input's
encoding equals the matching K/V output's (the runner copies quantized outputs into the cache)."""

import collections
import functools

import pytest
import torch

from npuq.calibrate.encodings import kv_io_qparams
from npuq.testing.transfer import GraphMismatch, copy_observer_state
from torchao.quantization.pt2e import DerivedObserverOrFakeQuantize

from npuq.testing.tiny import TINY_CONFIGS, tiny_decoder
from npuq.quantize.pt2e import prepare_graph, quantize_model
from npuq.quant.recipe import RECIPES, Recipe
from npuq.runtime.runner import step_inputs

CONTEXT = 16


@functools.lru_cache(maxsize=None)
def _quantized(arch, mode, kv_bits):
    _, model = tiny_decoder(arch, seed=4, max_context=CONTEXT)
    ids = torch.randint(3, model.config.vocab_size, (2 * CONTEXT + 3,), generator=torch.Generator().manual_seed(5))
    return quantize_model(model, Recipe("16a8w", kv_bits=kv_bits), ids, context=CONTEXT, mode=mode, prefill_len=4)


def _qdq_params(gm):
    """Multiset of (scale, zero point, dtype) over the per-tensor quantize ops of a converted graph."""
    return collections.Counter(
        (round(float(n.args[1]), 12), int(n.args[2]), str(n.args[5]))
        for n in gm.graph.nodes if n.op == "call_function" and "quantize_per_tensor" in str(n.target)
        and "dequantize" not in str(n.target)
    )


@pytest.mark.parametrize("mode", ["onepass", "sequential"])
@pytest.mark.parametrize("kv_bits", [16, 8])
def test_kv_input_encodings_equal_kv_output_encodings(mode, kv_bits):
    qm = _quantized("llama", mode, kv_bits)
    L = qm.config.num_layers
    for program in (qm.decode, qm.prefill):
        pairs = kv_io_qparams(program, L)
        assert len(pairs) == 2 * L
        for name, enc_in, enc_out in pairs:
            assert enc_in == enc_out, name
            if kv_bits == 8:
                assert enc_out[1] == 128, f"{name}: uint8 symmetric has zero point 128, got {enc_out[1]}"
    assert kv_io_qparams(qm.decode, L) == kv_io_qparams(qm.prefill, L)


@pytest.mark.parametrize("mode", ["onepass", "sequential"])
def test_decode_and_prefill_carry_identical_encodings(mode):
    qm = _quantized("llama", mode, 16)
    assert _qdq_params(qm.decode) == _qdq_params(qm.prefill)


def test_kv8_puts_the_kv_path_on_uint8():
    qm = _quantized("llama", "onepass", 8)
    dtypes = {str(n.args[5]) for n in qm.decode.graph.nodes if "quantize_per_tensor" in str(n.target)}
    assert "torch.uint8" in dtypes and "torch.int32" in dtypes


def test_copy_refuses_graphs_of_different_models():
    _, llama = tiny_decoder("llama", max_context=CONTEXT)
    _, qwen3 = tiny_decoder("qwen3", max_context=CONTEXT)  # q/k norms: extra ops
    calib, _ = prepare_graph(llama, RECIPES["16a8w"], "calibrate", CONTEXT)
    decode, _ = prepare_graph(qwen3, RECIPES["16a8w"], "decode", CONTEXT)
    with pytest.raises(GraphMismatch):
        copy_observer_state(calib, decode)


def test_quantized_programs_run_as_a_device_would():
    """Prefill chunks + decode steps (the runner) give the same logits as prefill alone where
    both apply: encodings and cache round trips agree between the two programs."""
    qm = _quantized("llama", "onepass", 16)
    tokens = torch.randint(3, qm.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))
    from npuq.runtime.runner import StaticRunner

    mixed = StaticRunner(qm.config, {1: qm.decode, 4: qm.prefill}, CONTEXT).feed(tokens[0].tolist())
    steps = StaticRunner(qm.config, {1: qm.decode}, CONTEXT).feed(tokens[0].tolist())
    assert mixed.shape == (1, 12, qm.config.vocab_size)
    assert (mixed - steps).abs().max().item() < 1e-3 * steps.abs().max().item()


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_every_family_transfers_calibrate_to_decode(arch):
    """q/k norms (qwen3), NoPE layers (smollm3), sliding windows (gemma3), biases (qwen2),
    RoPE scaling (llama3.2): the calibrate graph's observers map onto the decode graph's."""
    _, model = tiny_decoder(arch, seed=1, max_context=CONTEXT)
    cfg = model.config
    calib, _ = prepare_graph(model, RECIPES["16a8w"], "calibrate", CONTEXT)
    decode, _ = prepare_graph(model, RECIPES["16a8w"], "decode", CONTEXT)
    ids = torch.randint(3, cfg.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        calib(*step_inputs(cfg, ids, 0, CONTEXT))
    copied = copy_observer_state(calib, decode)
    assert copied > 20 * cfg.num_layers
    for node in decode.graph.nodes:  # every stateful observer of decode now holds calibrated statistics
        if node.op == "call_module":
            obs = decode.get_submodule(node.target)
            if hasattr(obs, "min_val") and not isinstance(obs, DerivedObserverOrFakeQuantize):
                assert obs.min_val.numel() and bool((obs.min_val <= obs.max_val).all()), node.name
