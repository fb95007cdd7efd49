"""The SeqMSE/GPTQ driver on a tiny model: shared Gram groups, grid-exact weights, lower error."""

import pytest
import torch

from npuq.testing.tiny import tiny_decoder
from npuq.optimize import driver
from npuq.optimize.driver import (
    WeightSpec,
    RecoveryOptions,
    optimize_weights,
    asymmetric_target,
    sequential_groups,
)
from npuq.optimize.gptq import GptqOptions, gptq_codes
from npuq.optimize.seqmse import fake_quantize, minmax_scale
from npuq.runtime.runner import forward_logits


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _windows(vocab, n=3, T=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, T), generator=g) for _ in range(n)]


def _forward_gram(model, name, windows):
    """Reference: XᵀX of layer ``name``'s input, captured by a hook over whole forwards."""
    captured = []
    h = dict(model.named_modules())[name].register_forward_pre_hook(
        lambda m, a: captured.append(a[0].reshape(-1, a[0].shape[-1])))
    for w in windows:
        forward_logits(model, w)
    h.remove()
    x = torch.cat(captured).double()
    return x.T @ x


@pytest.mark.parametrize("inputs", ["float", "quantized"])
def test_grams_are_shared_by_layers_reading_the_same_input(inputs):
    _, model = tiny_decoder("llama")
    names = _linears(model)
    windows = _windows(model.config.vocab_size)
    groups = {tuple(group): gram for group, gram, _ in sequential_groups(model, windows, names, inputs)}
    assert sorted(n for group in groups for n in group) == sorted(names)
    assert ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj") in groups
    assert ("layers.0.self_attn.o_proj",) in groups and ("layers.0.mlp.down_proj",) in groups
    gram = groups[("layers.1.mlp.gate_proj", "layers.1.mlp.up_proj")]
    assert torch.allclose(gram.double(), _forward_gram(model, "layers.1.mlp.up_proj", windows), rtol=1e-5, atol=1e-4)


def test_optimized_weights_lie_on_the_grid_and_reduce_the_error():
    _, model = tiny_decoder("qwen3", seed=2)
    names = _linears(model)
    specs = {n: WeightSpec(bits=4) for n in names}
    results, timings = optimize_weights(model, _windows(model.config.vocab_size), specs,
                                        RecoveryOptions(20, weight_rounding="gptq", layer_inputs="float",
                                                        gptq=GptqOptions(act_order=False)),
                                        rank=None, progress=False)
    for name in names:
        r = results[name]
        w = dict(model.named_modules())[name].weight
        assert r.codes.abs().max() <= 7
        assert torch.allclose(w, r.codes.float() * r.scale.unsqueeze(1), atol=0)
        assert r.loss <= r.loss_minmax * (1 + 1e-5)
    assert set(timings) == {"collect_seconds", "seq_mse_seconds", "rounding_seconds"}


def _rtn_(module, bits=4):
    """Round a linear layer's weight to nearest on its min/max grid, in place."""
    with torch.no_grad():
        w = module.weight
        w.copy_(fake_quantize(w.float(), minmax_scale(w.float(), bits), bits))


@pytest.mark.parametrize("arch, gram_rows", [("llama", None), ("gemma3", None), ("llama", 40)])
def test_sequential_grams_equal_the_float_ones_while_nothing_is_rounded(arch, gram_rows, monkeypatch):
    # Block by block on cached hidden states (gemma3: sliding-window masks, two RoPE tables)
    # must see exactly what one whole forward sees. gram_rows 40: the windows' rows (32, 32, 32, 7)
    # are summed in several products, one window alone and two joined.
    if gram_rows:
        monkeypatch.setattr(driver, "GRAM_ROWS", gram_rows)
    _, model = tiny_decoder(arch, seed=1)
    names = _linears(model)
    windows = _windows(model.config.vocab_size) + [torch.randint(0, model.config.vocab_size, (1, 7))]
    walked = list(sequential_groups(model, windows, names))
    order = []
    for group, gram, _ in walked:
        ref = _forward_gram(model, group[0], windows)
        assert torch.allclose(gram.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), group
        order += group
    # Float inputs, all of a block's groups from one run: nothing is rounded here, so the very same
    # inputs and sums, bit for bit.
    float_groups = list(sequential_groups(model, windows, names, "float"))
    assert [g for g, _, _ in float_groups] == [g for g, _, _ in walked]
    assert all(torch.equal(a, b) for (_, a, _), (_, b, _) in zip(float_groups, walked))
    assert sorted(order) == sorted(names)
    assert order[:4] == ["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj",
                         "layers.0.self_attn.o_proj"] and order[-1] == "lm_head"


@pytest.mark.parametrize("inputs", ["float", "quantized", "asymmetric"])
def test_walk_yields_only_the_layers_asked_for(inputs):
    # A recipe may leave some projections unquantized: their group is walked through, not yielded,
    # and every other group's Gram is still what a whole forward gives (nothing is rounded here).
    _, model = tiny_decoder("llama", seed=1)
    names = [n for n in _linears(model) if not n.endswith("o_proj")]
    windows = _windows(model.config.vocab_size)
    walked = list(sequential_groups(model, windows, names, inputs))
    assert sorted(n for group, _, _ in walked for n in group) == sorted(names)
    for group, gram, _ in walked:
        ref = _forward_gram(model, group[0], windows)
        assert torch.allclose(gram.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), group


def test_sequential_grams_see_the_rounding_of_every_earlier_group():
    _, model = tiny_decoder("llama", seed=3)
    _, reference = tiny_decoder("llama", seed=3)
    names = _linears(model)
    windows = _windows(model.config.vocab_size)
    float_grams = {group[0]: gram for group, gram, _ in sequential_groups(tiny_decoder("llama", seed=3)[1], windows, names,
                                                                        "float")}
    modules, ref_modules = dict(model.named_modules()), dict(reference.named_modules())
    seen = []
    for group, gram, _ in sequential_groups(model, windows, names):
        # Independent reference: a whole forward of a separate copy in which exactly the groups
        # before this one are rounded, the group's input captured by a hook.
        captured: list[torch.Tensor] = []
        h = ref_modules[group[0]].register_forward_pre_hook(lambda m, a, out=captured: out.append(a[0].reshape(-1, a[0].shape[-1])))
        for w in windows:
            forward_logits(reference, w)
        h.remove()
        x = torch.cat(captured).double()
        ref = x.T @ x
        assert torch.allclose(gram.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()), group
        seen.append((group[0], gram))
        for n in group:  # round this group in both models before asking for the next
            _rtn_(modules[n])
            _rtn_(ref_modules[n])
    # The first group reads the embedding only: its Gram is the float one; every later group's is not.
    for i, (first, gram) in enumerate(seen):
        fg = float_grams[first]
        rel = ((gram - fg).norm() / fg.norm()).item()
        assert (rel < 1e-6) if i == 0 else (rel > 1e-4), (first, rel)


def test_asymmetric_target_is_the_least_squares_weight():
    # W* = W + W S H⁻¹ against an independent least-squares solve of X̃ Qᵀ ≈ X Wᵀ (damp 0), and
    # the identity the driver rests on: ||X Wᵀ - X̃ Qᵀ||² - tr((W* - Q) H (W* - Q)ᵀ) is the same
    # for every Q, so rounding W* under H minimises the asymmetric loss.
    g = torch.Generator().manual_seed(0)
    N, I, O = 400, 24, 10
    xq = torch.randn(N, I, generator=g, dtype=torch.float64)
    x = xq + 0.1 * torch.randn(N, I, generator=g, dtype=torch.float64)
    w = torch.randn(O, I, generator=g, dtype=torch.float64)
    gram, shift = xq.T @ xq, (x - xq).T @ xq
    target = asymmetric_target(w.float(), gram, shift, damp=0.0).double()
    reference = torch.linalg.lstsq(xq, x @ w.T).solution.T
    assert (target - reference).abs().max() <= 1e-5 * reference.abs().max()  # float32 result
    target = asymmetric_target(w, gram, shift, damp=0.0).double()

    def gap(q):
        direct = (x @ w.T - xq @ q.T).pow(2).sum()
        e = target - q
        return (direct - torch.einsum("oi,ij,oj->", e, gram, e)).item()

    gaps = [gap(torch.randn(O, I, generator=g, dtype=torch.float64)) for _ in range(3)]
    assert max(gaps) - min(gaps) <= 1e-4 * abs(gaps[0])  # float32 rounding of W* enters only here
    assert torch.equal(asymmetric_target(w.float(), gram, torch.zeros_like(shift)), w.float())


@pytest.mark.parametrize("gram_rows", [None, 40])
def test_asymmetric_walk_gives_each_group_its_float_input_shift(gram_rows, monkeypatch):
    if gram_rows:  # each window's 32 rows a product of its own
        monkeypatch.setattr(driver, "GRAM_ROWS", gram_rows)
    _, model = tiny_decoder("llama", seed=3)
    _, reference = tiny_decoder("llama", seed=3)
    _, float_model = tiny_decoder("llama", seed=3)
    names = _linears(model)
    windows = _windows(model.config.vocab_size)
    modules, ref_modules = dict(model.named_modules()), dict(reference.named_modules())
    float_modules = dict(float_model.named_modules())

    def inputs(mods, name):
        captured: list[torch.Tensor] = []
        h = mods[name].register_forward_pre_hook(lambda m, a: captured.append(a[0].reshape(-1, a[0].shape[-1])))
        for w in windows:
            forward_logits(mods[""], w)
        h.remove()
        return torch.cat(captured).double()

    asym = sequential_groups(model, windows, names, "asymmetric")
    shifts = []
    for group, gram, shift in asym:
        # Independent references: whole forwards of the float model and of a copy in which exactly
        # the groups before this one are rounded.
        xq, x = inputs(ref_modules, group[0]), inputs(float_modules, group[0])
        ref_gram, ref_shift = xq.T @ xq, (x - xq).T @ xq
        assert torch.allclose(gram.double(), ref_gram, rtol=1e-5, atol=1e-5 * ref_gram.abs().max().item()), group
        assert shift.dtype == torch.float64
        assert torch.allclose(shift, ref_shift, rtol=1e-4, atol=1e-5 * ref_gram.abs().max().item()), group
        shifts.append(shift.norm().item() / gram.double().norm().item())
        for n in group:
            _rtn_(modules[n])
            _rtn_(ref_modules[n])
    # The first group reads the embedding, which nothing rounds: no shift; every later group's has one.
    assert shifts[0] == 0.0 and min(shifts[1:]) > 1e-4, shifts


def test_down_projections_take_their_own_damping():
    # GptqOptions.damp_down for the MLP down projections, damp for every other layer: each layer's
    # codes are gptq_codes' on the same (float) Gram at the damping of its kind, and the down
    # projections' differ from what the other damping gives them (so the choice is seen).
    _, model = tiny_decoder("llama", seed=4)
    _, reference = tiny_decoder("llama", seed=4)
    names = _linears(model)
    windows = _windows(model.config.vocab_size)
    grams = {n: gram for group, gram, _ in sequential_groups(reference, windows, names, "float") for n in group}
    options = GptqOptions(act_order=False, damp=0.1, damp_down=1.0)
    results, _ = optimize_weights(model, windows, {n: WeightSpec(bits=4) for n in names},
                                  RecoveryOptions(weight_rounding="gptq", layer_inputs="float", gptq=options),
                                  progress=False)
    downs = [n for n in names if n.endswith("mlp.down_proj")]
    assert downs and len(downs) < len(names)
    ref_modules = dict(reference.named_modules())
    changed = 0
    for name in names:
        w = ref_modules[name].weight.detach().float()
        scale = minmax_scale(w, 4)
        damp, other = (1.0, 0.1) if name in downs else (0.1, 1.0)
        assert torch.equal(results[name].codes, gptq_codes(w, grams[name], scale, 4, damp=damp)), name
        changed += name in downs and not torch.equal(results[name].codes, gptq_codes(w, grams[name], scale, 4, damp=other))
    assert changed == len(downs)
