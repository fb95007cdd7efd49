"""The SeqMSE/GPTQ driver on a tiny model: shared Gram groups, grid-exact weights, lower error."""

import torch

from npuq.models.tiny import tiny_decoder
from npuq.optimize.driver import WeightSpec, collect_grams, optimize_weights
from npuq.runtime.runner import forward_logits


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _windows(vocab, n=3, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, T), generator=g) for _ in range(n)]


def test_grams_are_shared_by_layers_reading_the_same_input():
    _, model = tiny_decoder("llama")
    names = _linears(model)
    windows = _windows(model.config.vocab_size)
    group_of, grams = collect_grams(model, windows, names)
    assert group_of["layers.0.self_attn.q_proj"] == group_of["layers.0.self_attn.k_proj"] == group_of["layers.0.self_attn.v_proj"]
    assert group_of["layers.0.mlp.gate_proj"] == group_of["layers.0.mlp.up_proj"]
    assert group_of["layers.0.self_attn.o_proj"] != group_of["layers.0.self_attn.q_proj"]
    # Independent reference: the input of up_proj captured directly.
    captured = []
    h = model.layers[1].mlp.up_proj.register_forward_pre_hook(lambda m, a: captured.append(a[0].reshape(-1, a[0].shape[-1])))
    for w in windows:
        forward_logits(model, w)
    h.remove()
    x = torch.cat(captured).double()
    assert torch.allclose(grams[group_of["layers.1.mlp.up_proj"]].double(), x.T @ x, rtol=1e-5, atol=1e-4)


def test_optimized_weights_lie_on_the_grid_and_reduce_the_error():
    _, model = tiny_decoder("qwen3", seed=2)
    names = _linears(model)
    specs = {n: WeightSpec(bits=4) for n in names}
    results, timings = optimize_weights(model, _windows(model.config.vocab_size), specs, seq_mse=20,
                                        rounding="gptq", rank=None, progress=False)
    for name in names:
        r = results[name]
        w = dict(model.named_modules())[name].weight
        assert r.codes.abs().max() <= 7
        assert torch.allclose(w, r.codes.float() * r.scale.unsqueeze(1), atol=0)
        assert r.loss <= r.loss_minmax * (1 + 1e-5)
    assert set(timings) == {"collect_seconds", "seq_mse_seconds", "rounding_seconds"}
