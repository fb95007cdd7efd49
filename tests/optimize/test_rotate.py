"""Rotations folded into the weights (npuq.optimize.rotate): the same logits for every family in
every mode, weights that really changed, outlier channels spread out, SeqMSE/GPTQ and PT2E on
the rotated weights, and the exactness condition of RMSNorm that decides Gemma's case.

Tolerance. The rotated model differs from the original only by one fp32 rounding of each
rotated weight (products taken in float64; unit roundoff 6e-8) and the summation order of its
matmuls, a few extra roundings per layer. Measured on these tiny models (2-4 layers, hidden 64,
logits up to ~4): at most 1.3e-6 of the largest |logit| over every family, R1/R2 choice and
seeds 0 and 3, in the calibrate mode and through prefill + decode. TOL = 1e-5 relative leaves a
margin of ~7.5x, while a gamma left unfolded moves the logits by far more
(test_a_wrong_rotation_is_caught).

The bound, derived (test_rotation_adds_no_more_than_fp32_rounding): against the exact function
(the unrotated model in float64), the rotated fp32 model makes the same fp32 operations on
values of the same sizes (R is orthogonal: norms are kept) plus one rounding of each stored
weight, a relative error of at most u = 2^-24, no larger than one step of the roundings every
matmul already accumulates. To first order its error bound is therefore at most twice the
unrotated fp32 model's own error: |rot32 - ref64| <= 2 |ref32 - ref64|. In float64 the same
arithmetic scales by u64 / u32 = 2^-29, for two models: |rot64 - ref64| <= 4 * 2^-29 |ref32 -
ref64|, i.e. the algebra is exact. Measured on every family (R1, R1+R2, R2): rot32 0.85-1.3x
ref32's error, rot64 1.2e-15 to 1.6e-15 of the largest logit.

Quantized (test_rotated_16a8w_loses_no_layer): rotated 16a8w must keep every linear layer's
output SQNR within MARGIN_DB of unrotated 16a8w, calibrated on every token of the vocabulary
and scored on calibrated text: a token or context absent from calibration can exceed a
calibrated range of either model, differently in each basis, which is coverage, not rotation
(held-out tokens cost tiny SmolLM3's rotated layers.3.self_attn.v_proj 3.9 dB). 3 dB: for 16a8w the error is that of the weight
grids, whose noise power scales with the square of each row's maximum; a random (Gaussian) row
cannot be made flatter by a rotation, and the realised maximum of 64 Gaussian entries ranges
over about 2.0-2.9 standard deviations, a power ratio of 2.1 (3.2 dB). Measured worst: -1.7 dB
(tiny Qwen3, layers.1.self_attn.q_proj); the other families -0.9 to -1.5 dB.
"""

import copy

import pytest
import torch

from npuq.models.decoder import RMSNorm
from npuq.testing.tiny import TINY_CONFIGS, tiny_decoder
from npuq.optimize.rotate import DENSE_MAX, hadamard_matrix, rotate_model, rotation_matrix, rotation_operator
from npuq.models import decoder
from npuq.runtime.runner import StaticRunner, forward_logits, step_inputs

ARCHS = sorted(TINY_CONFIGS)
TOL = 1e-5  # relative to the largest |logit| (module docstring)
CHOICES = [(True, False), (True, True), (False, True)]  # (r1, r2)


def _tokens(vocab, shape, seed):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return (a - b).abs().max().item() / b.abs().max().item()


def _runner_logits(model, tokens, prefill_len):
    runner = StaticRunner(model.config, {1: model, prefill_len: model}, 32)
    out = [runner.feed(tokens[0, :17].tolist())]  # AR-N chunks (the last padded), then AR-1 steps
    out += [runner.feed([t]) for t in tokens[0, 17:].tolist()]
    return torch.cat(out, dim=1)


@pytest.fixture(scope="module", params=ARCHS)
def arch_model(request):
    return request.param, tiny_decoder(request.param, seed=1, max_context=64)[1]


@pytest.mark.parametrize("r1,r2", CHOICES)
def test_same_logits_in_every_mode(arch_model, r1, r2):
    arch, model = arch_model
    rotated = copy.deepcopy(model)
    report = rotate_model(rotated, seed=3, r1=r1, r2=r2)
    assert report.r2 == r2
    assert report.r1 == (r1 and arch != "gemma3")  # tiny Gemma's post-norm gammas are random: R1 is skipped
    tokens = _tokens(model.config.vocab_size, (2, 24), 0)
    assert _rel(forward_logits(rotated, tokens), forward_logits(model, tokens)) <= TOL
    tokens = _tokens(model.config.vocab_size, (1, 27), 2)
    for prefill_len in (4, 7):
        assert _rel(_runner_logits(rotated, tokens, prefill_len), _runner_logits(model, tokens, prefill_len)) <= TOL


def test_the_weights_really_change(arch_model):
    arch, model = arch_model
    rotated = copy.deepcopy(model)
    report = rotate_model(rotated, r1=True, r2=True)
    before, after = model.state_dict(), rotated.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    v, o = "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight"
    assert {v, o} <= changed
    assert (after[v] - before[v]).abs().max() > 0.1 * before[v].abs().max()
    if arch == "gemma3":
        assert not report.r1 and "sandwich" in report.r1_skipped
        assert "embed_tokens.weight" not in changed and "layers.0.self_attn.q_proj.weight" not in changed
        return
    cfg = model.config
    assert report.r1 and report.r1_skipped is None and report.r1_matrix.startswith("randomized hadamard")
    assert report.folded_norms == 2 * cfg.num_layers + 1
    for k in ("embed_tokens.weight", "lm_head.weight", "layers.0.self_attn.q_proj.weight",
              "layers.0.mlp.gate_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert k in changed, k
    for i in range(cfg.num_layers):  # gamma folded out of every pre-norm (Qwen3's q/k norms untouched)
        assert torch.equal(after[f"layers.{i}.input_layernorm.weight"], torch.ones(cfg.hidden_size))
        assert torch.equal(after[f"layers.{i}.post_attention_layernorm.weight"], torch.ones(cfg.hidden_size))
        if cfg.qk_norm:
            assert torch.equal(after[f"layers.{i}.self_attn.q_norm.weight"], before[f"layers.{i}.self_attn.q_norm.weight"])
    assert torch.equal(after["norm.weight"], torch.ones(cfg.hidden_size))
    if cfg.qkv_bias:  # q/k outputs are not rotated: their biases stay; v's follows R2
        assert torch.equal(after["layers.0.self_attn.q_proj.bias"], before["layers.0.self_attn.q_proj.bias"])
        assert "layers.0.self_attn.v_proj.bias" in changed
    # tied models come back untied: the head has its own (different) rotated weight
    assert rotated.lm_head.weight.data_ptr() != rotated.embed_tokens.weight.data_ptr()
    assert report.untied == cfg.tie_word_embeddings and not rotated.config.tie_word_embeddings
    assert not torch.allclose(after["lm_head.weight"], after["embed_tokens.weight"])


def test_a_wrong_rotation_is_caught():
    """The logit check can fail: leaving one norm's gamma in place (or skipping one o_proj) breaks it."""
    _, model = tiny_decoder("llama", seed=1)
    tokens = _tokens(model.config.vocab_size, (2, 24), 0)
    ref = forward_logits(model, tokens)
    broken = copy.deepcopy(model)
    rotate_model(broken)
    with torch.no_grad():
        broken.layers[0].input_layernorm.weight.copy_(model.layers[0].input_layernorm.weight)
    assert _rel(forward_logits(broken, tokens), ref) > 100 * TOL


def test_rmsnorm_invariance_needs_an_all_equal_gamma():
    """The condition of the module docstring, on npuq's own RMSNorm: RMSNorm(x R) = RMSNorm(x) R
    for gamma = c·1, and not for any other gamma (why Gemma's post-norms block R1)."""
    n = 64
    rot, _ = rotation_matrix(n, torch.Generator().manual_seed(0))
    rot = rot.float()
    x = torch.randn(8, n) * 3
    norm = RMSNorm(n, 1e-6)
    with torch.no_grad():
        norm.weight.fill_(1.7)
        assert torch.allclose(norm(x @ rot), norm(x) @ rot, atol=1e-5)
        norm.weight.copy_(1 + 0.1 * torch.randn(n))
        assert (norm(x @ rot) - norm(x) @ rot).abs().max() > 1e-2


def test_gemma_gets_r1_when_every_post_norm_gamma_is_all_equal():
    _, model = tiny_decoder("gemma3", seed=1)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.post_attention_layernorm.weight.fill_(0.8 + 0.1 * i)
            layer.post_feedforward_layernorm.weight.fill_(1.3 - 0.1 * i)
    rotated = copy.deepcopy(model)
    report = rotate_model(rotated, r1=True, r2=True)
    assert report.r1 and report.r2 and report.folded_norms == 2 * model.config.num_layers + 1
    assert torch.equal(rotated.layers[0].pre_feedforward_layernorm.weight, torch.ones(model.config.hidden_size))
    assert torch.equal(rotated.layers[0].post_attention_layernorm.weight, model.layers[0].post_attention_layernorm.weight)
    tokens = _tokens(model.config.vocab_size, (1, 30), 4)  # longer than the sliding window (6)
    assert _rel(forward_logits(rotated, tokens), forward_logits(model, tokens)) <= TOL


@pytest.mark.parametrize("n", [1, 2, 16, 64, 12, 20, 28, 36, 576, 640, 896, 1152])
def test_hadamard_matrices(n):
    h, how = hadamard_matrix(n)
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)) and bool((h.abs() == 1).all()), how
    rot, _ = rotation_matrix(n, torch.Generator().manual_seed(1))
    assert torch.allclose(rot.T @ rot, torch.eye(n, dtype=torch.float64), atol=1e-12)


def test_sizes_without_a_hadamard_get_a_random_orthogonal_matrix():
    assert hadamard_matrix(18) is None and hadamard_matrix(100) is None
    rot, how = rotation_matrix(100, torch.Generator().manual_seed(0))
    assert how.startswith("random orthogonal")
    assert torch.allclose(rot.T @ rot, torch.eye(100, dtype=torch.float64), atol=1e-12)


def test_same_seed_same_rotation_other_seed_other_rotation():
    _, model = tiny_decoder("qwen2", seed=1)
    a, b, c = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    rotate_model(a, seed=5, r2=True)
    rotate_model(b, seed=5, r2=True)
    rotate_model(c, seed=6, r2=True)
    for w in ("layers.1.self_attn.o_proj.weight", "layers.1.self_attn.q_proj.weight"):
        assert torch.equal(a.state_dict()[w], b.state_dict()[w])
        # another seed is another rotation, not the same one with some channels' signs flipped
        # (which would leave every per-channel and per-block weight scale as it was)
        assert not torch.allclose(a.state_dict()[w].abs(), c.state_dict()[w].abs())


def _column_ratio(w):
    norms = w.norm(dim=0)
    return (norms.max() / norms.mean()).item()


def test_an_outlier_channel_is_spread_out():
    # One post-norm activation channel 40x the others, planted through input_layernorm's gamma.
    _, model = tiny_decoder("llama", seed=1)
    with torch.no_grad():
        model.layers[0].input_layernorm.weight[5] = 40.0
    gamma = model.layers[0].input_layernorm.weight.detach().clone()
    folded = model.layers[0].self_attn.q_proj.weight.detach() * gamma  # the same layer, gamma folded, unrotated
    rotated = copy.deepcopy(model)
    rotate_model(rotated)
    w_rot = rotated.layers[0].self_attn.q_proj.weight.detach()
    assert _column_ratio(folded) > 15  # the outlier column dominates
    assert _column_ratio(w_rot) < 1.5 < _column_ratio(folded) / 10
    # and the activations q_proj reads lose their outlier channel too
    seen = {}
    tokens = _tokens(model.config.vocab_size, (2, 32), 0)
    for tag, m in (("float", model), ("rotated", rotated)):
        hook = m.layers[0].self_attn.q_proj.register_forward_pre_hook(
            lambda _m, a, tag=tag: seen.__setitem__(tag, a[0].reshape(-1, a[0].shape[-1]).abs().amax(0)))
        forward_logits(m, tokens)
        hook.remove()
    ratio = {k: (v.max() / v.mean()).item() for k, v in seen.items()}
    assert ratio["float"] > 10 and ratio["rotated"] < 2
    # 4-bit per-channel nearest rounding of that layer: a smaller output error once rotated
    from npuq.optimize.seqmse import fake_quantize, minmax_scale

    def rtn_error(w, x):
        q = fake_quantize(w.float(), minmax_scale(w.float(), 4), 4)
        return ((x @ (w - q).T).norm() / (x @ w.T).norm()).item()

    x = torch.randn(256, model.config.hidden_size)  # normalised inputs (gamma is in both weights)
    assert rtn_error(w_rot, x) < 0.5 * rtn_error(folded, x)


def test_seqmse_and_gptq_run_on_rotated_weights():
    from npuq.calibrate.split import split_windows
    from npuq.optimize.driver import RecoveryOptions
    from npuq.optimize.recovery import optimize_for_recipe
    from npuq.quant.recipe import load_recipe

    _, model = tiny_decoder("qwen2", seed=1)  # biases on q/k/v (v's rotated by R2)
    rotate_model(model, r1=True, r2=True)
    calib = _tokens(model.config.vocab_size, (4 * 32,), 3)
    scales, summary = optimize_for_recipe(model, load_recipe("16a4w"), split_windows(calib, 32),
                                          RecoveryOptions(seq_mse=20, weight_rounding="gptq"), progress=False)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(scales) == sorted(linears)
    for name, s in scales.items():
        assert torch.isfinite(s).all() and (s > 0).all(), name
        w = model.get_submodule(name).weight
        codes = w / s.unsqueeze(1)
        assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 7 + 1e-4, name
    assert summary.layers == len(linears) and summary.output_error_reduction > 0.2


def test_the_quantizer_takes_a_rotated_untied_model():
    """PT2E export, calibration and convert accept the untied lm head; the quantized rotated
    model tracks the float original."""
    from npuq.quant.recipe import load_recipe
    from npuq.quantize.pt2e import quantize_model

    _, model = tiny_decoder("llama", seed=1, max_context=64)  # tied embeddings
    rotated = copy.deepcopy(model)
    rotate_model(rotated, r1=True, r2=True)
    calib = _tokens(model.config.vocab_size, (4 * 32,), 3)
    qm = quantize_model(rotated, load_recipe("16a8w"), calib, context=32, prefill_len=4)
    assert qm.config.tie_word_embeddings is False
    tokens = _tokens(model.config.vocab_size, (1, 16), 0)
    ref = forward_logits(model, tokens)
    assert (qm.logits(tokens) - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def _logits64(model, tokens):
    """Logits in the model's own dtype, as float64."""
    inputs = step_inputs(model.config, tokens, 0, tokens.shape[1])
    dtype = next(model.parameters()).dtype
    inputs = [i.to(dtype) if torch.is_floating_point(i) else i for i in inputs]
    with torch.no_grad():
        return model(*inputs)[0].double()


def _rmsnorm_in_its_dtype(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


@pytest.mark.parametrize("r1,r2", CHOICES)
def test_rotation_adds_no_more_than_fp32_rounding(arch_model, r1, r2, monkeypatch):
    """The derived bound of the module docstring, against the unrotated model in float64."""
    arch, model = arch_model
    tokens = _tokens(model.config.vocab_size, (2, 24), 0)
    rotated = copy.deepcopy(model)
    rotate_model(rotated, seed=3, r1=r1, r2=r2)
    ref32, rot32 = _logits64(model, tokens), _logits64(rotated, tokens)
    # npuq's RMSNorm computes in fp32 whatever its input (as the checkpoints' code does): the
    # float64 reference runs it in float64
    monkeypatch.setattr(decoder.RMSNorm, "forward", _rmsnorm_in_its_dtype)
    model64 = copy.deepcopy(model).double()
    rotated64 = copy.deepcopy(model).double()
    rotate_model(rotated64, seed=3, r1=r1, r2=r2)
    ref64, rot64 = _logits64(model64, tokens), _logits64(rotated64, tokens)
    own = (ref32 - ref64).abs().max().item()  # the fp32 model's own rounding error
    assert 0 < own < 1e-5 * ref64.abs().max().item()
    assert (rot32 - ref64).abs().max().item() <= 2 * own
    assert (rot64 - ref64).abs().max().item() <= 4 * 2.0**-29 * own


MARGIN_DB = 3.0  # module docstring


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gemma3"])  # tiny Gemma: R1 is skipped (above)
def test_rotated_16a8w_loses_no_layer(arch):
    from npuq.eval.layers import layer_errors
    from npuq.quant.recipe import load_recipe
    from npuq.quantize.pt2e import quantize_model

    torch.manual_seed(0)
    _, model = tiny_decoder(arch, seed=1, max_context=64)
    vocab = model.config.vocab_size
    calib = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))  # every token, 16 windows
    scored = calib[:32].tolist()  # calibrated text: layer ranges cover it in both bases (docstring)
    sqnr = {}
    for rotate in (None, "r1"):
        m = copy.deepcopy(model)
        if rotate:
            rotate_model(m, seed=0)
        qm = quantize_model(m, load_recipe("16a8w").with_rotation(rotate), calib, context=16, prefill_len=4)
        sqnr[rotate] = {e.path: e.output_sqnr_db for e in layer_errors(m, qm.graphs(), qm.config, 16, scored)}
    assert sqnr[None].keys() == sqnr["r1"].keys() and len(sqnr[None]) == 7 * model.config.num_layers + 1
    worst = min(sqnr[None], key=lambda p: sqnr["r1"][p] - sqnr[None][p])
    assert sqnr["r1"][worst] >= sqnr[None][worst] - MARGIN_DB, (worst, sqnr["r1"][worst], sqnr[None][worst])


@pytest.mark.parametrize("n", [1536, 2048, 3584])  # Qwen2.5-1.5B, -3B, -7B: above DENSE_MAX, applied by structure
def test_structured_rotation_is_the_dense_randomized_hadamard(n):
    assert n > DENSE_MAX
    rotor, how = rotation_operator(n, torch.Generator().manual_seed(2))
    assert rotor.dense is None and "hadamard" in how
    h = hadamard_matrix(n)[0]
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))  # ±1 entries: exact in float64
    dense = rotor.signs.unsqueeze(1) * h / n**0.5  # diag(s)·H/√n, the matrix the structure stands for
    x = torch.randn(64, n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    # each output is a sum of n terms of |x|/√n: float64 rounding stays below n·2⁻⁵² of its magnitude
    bound = n * 2.0**-52 * x.abs().sum(dim=1, keepdim=True) / n**0.5
    assert ((rotor.right(x) - x @ dense).abs() <= bound).all()
    w = torch.randn(n, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    assert ((rotor.left_t(w) - dense.T @ w).abs() <= n * 2.0**-52 * w.abs().sum(dim=0) / n**0.5).all()
