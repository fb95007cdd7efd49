"""Every tensor npuq builds follows the device of its inputs, shown without a GPU.

torch's lazy TorchScript backend (``torch._lazy``, part of the CPU builds) is a second device
whose tensors hold real values and which refuses a CPU tensor mixed into an op ("Input tensor
is not a lazy tensor"), as CUDA does; it also trips the CPU device that torch.export bakes into
a graph's ``_assert_tensor_metadata`` checks, as CUDA does. So a mask, cache, position table,
token batch, Gram matrix or search grid built on the CPU instead of the input's device fails
here as it would on a GPU, and every result is compared with the CPU run.

Limits: the lazy backend says nothing about CUDA numerics or speed (the CUDA tests in
test_device_cli.py cover those where a GPU exists), and it is slow (each materialisation
compiles a graph, and ops it lacks, such as aminmax, fall back to the CPU one by one), so
the inputs here are a few tokens and the sequential calibration engine, whose only
device-specific code is the StaticRunner tested below, is not run on it.
"""

import copy
import dataclasses

import pytest
import torch

from npuq.data.corpora import Document
from npuq.eval.perplexity import evaluate_model
from npuq.models import LoadedModel
from npuq.testing.tiny import tiny_decoder
from npuq.optimize.driver import RecoveryOptions, WeightSpec, optimize_weights
from npuq.optimize.gptq import gptq_codes
from npuq.optimize.seqmse import minmax_scale
from npuq.quantize.passes import fold_constant_dequant
from npuq.quantize.pt2e import quantize_model
from npuq.quant.recipe import RECIPES
from npuq.runtime.runner import StaticRunner, forward_logits

CONTEXT = 8


@pytest.fixture(scope="module")
def lazy():
    try:
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        (torch.ones(1, device="lazy") + 1).cpu()
    except (ImportError, RuntimeError) as exc:  # a build without it: nothing to run on
        pytest.skip(f"torch's lazy TorchScript backend is not available: {exc}")
    return torch.device("lazy", 0)


def _tokens(shape, seed=0):
    return torch.randint(3, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: the sliding-window mask channel too
def test_forward_and_runner_follow_the_tokens(lazy, arch):
    _, model = tiny_decoder(arch, seed=3, max_context=CONTEXT)
    on_device = copy.deepcopy(model).to(lazy)
    tokens = _tokens((2, 6))
    reference = forward_logits(model, tokens)
    assert torch.allclose(forward_logits(on_device, tokens.to(lazy)).cpu(), reference, atol=1e-5)

    # a prefill chunk of 4 (the second one padded) and decode steps, KV cache written on the device
    graphs = {1: on_device, 4: on_device}
    runner = StaticRunner(model.config, graphs, CONTEXT, device=lazy)
    ids = tokens[0].tolist()
    logits = torch.cat([runner.feed(ids[:5]), runner.feed(ids[5:6])], dim=1)
    assert logits.device == lazy and {k.device for k in runner.k + runner.v} == {lazy}
    cpu_runner = StaticRunner(model.config, {1: model, 4: model}, CONTEXT)
    expected = torch.cat([cpu_runner.feed(ids[:5]), cpu_runner.feed(ids[5:6])], dim=1)
    assert torch.allclose(logits.cpu(), expected, atol=1e-5)
    assert torch.allclose(expected[0], reference[0], atol=1e-5)  # and the runner agrees with one forward


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i + 3 for i in range(200)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def test_perplexity_scores_on_the_device(lazy):
    hf, model = tiny_decoder("llama", seed=4, max_context=CONTEXT)
    tokenizer = _word_tokenizer()
    words = [f"w{int(i)}" for i in _tokens((20,), seed=5) % 200]
    docs = [Document("a", " ".join(words[:11])), Document("b", " ".join(words[11:]))]

    def loaded(m):
        return LoadedModel("tiny", "tiny", m.config, hf.config, m, lambda: tokenizer)

    cpu = evaluate_model(loaded(model), docs, CONTEXT, batch_size=2)
    on_device = evaluate_model(loaded(copy.deepcopy(model)), docs, CONTEXT, batch_size=2, device=lazy)
    assert (cpu.device, on_device.device) == ("cpu", "lazy:0")
    assert on_device.tokens == cpu.tokens == 20 and on_device.windows == cpu.windows
    assert on_device.word_perplexity == pytest.approx(cpu.word_perplexity, rel=1e-5)


@pytest.fixture(scope="module")
def calibration():
    _, model = tiny_decoder("llama", seed=1, max_context=CONTEXT)
    ids = _tokens((2 * CONTEXT,))  # two whole windows: one forward of batch 2
    return model, ids, quantize_model(model, RECIPES["16a8w"], ids, context=CONTEXT, prefill_len=4)


def test_calibration_on_the_device_gives_the_cpu_encodings(lazy, calibration):
    model, ids, cpu = calibration
    on_device = quantize_model(model, RECIPES["16a8w"], ids, context=CONTEXT, prefill_len=4, device=lazy)
    assert on_device.stats["device"] == "lazy:0" and cpu.stats["device"] == "cpu"
    acts = zip(cpu.encodings["activation_encodings"], on_device.encodings["activation_encodings"])
    for a, b in acts:
        assert a["name"] == b["name"]
        assert b["scale"] == pytest.approx(a["scale"], rel=1e-5), a["name"]
        assert max(abs(x - y) for x, y in zip(a["offset"], b["offset"])) <= 1, a["name"]  # a rounding apart at most
    assert on_device.encodings["param_encodings"] == cpu.encodings["param_encodings"]  # same weights, same min/max
    # the programs come back to the CPU: an artifact made on any device loads anywhere
    for gm in (on_device.decode, on_device.prefill):
        assert {t.device.type for t in [*gm.parameters(), *gm.buffers()]} == {"cpu"}
        assert all(n.kwargs.get("device", torch.device("cpu")) == torch.device("cpu") for n in gm.graph.nodes)


def test_quantized_programs_run_on_the_device(lazy, calibration):
    """The converted programs moved with QuantizedModel.to: their baked-in device checks follow
    (without that, every dtype cast raises "Tensor device mismatch! Expected: cpu"). The lazy
    backend runs the same ops in fp32 with its own kernels, so before each requantization its
    values lie within rounding error of the CPU's (FLOAT_DIFF_TYPICAL codes, tests/qdq_noise.py)
    and now and then one rounds to the neighbouring code: the logits may differ by what
    qdq_noise.bounded_rms allows for that, from the program's own rounding noise. (Measured:
    RMS 1.6e-5 against a bound of 3.4e-4; 52 of 1536 logits differ, by 8.6e-5 at most; a score grid 10x finer since the masked
    entries left the softmax input's range made such flips likelier than the 1e-6 this test
    asked before.)"""
    from qdq_noise import FLOAT_DIFF_TYPICAL, bounded_rms, rms, without_activation_rounding

    _, _, cpu = calibration
    qm = copy.deepcopy(cpu)
    qm.decode, qm.prefill = fold_constant_dequant(qm.decode), fold_constant_dequant(qm.prefill)  # as load_artifact does
    tokens = _tokens((1, 6), seed=2)
    expected = qm.logits(tokens)
    ideal = dataclasses.replace(qm, decode=without_activation_rounding(qm.decode),
                                prefill=without_activation_rounding(qm.prefill)).logits(tokens)
    code = qm.decode.code
    logits = qm.to(lazy).logits(tokens.to(lazy))
    assert logits.device == lazy
    assert rms(logits.cpu() - expected) <= bounded_rms(rms(expected - ideal) ** 2, 0.0, FLOAT_DIFF_TYPICAL, 0.0)
    assert qm.to("cpu").decode.code == code  # moving back restores the graph exactly
    assert torch.equal(qm.logits(tokens), expected)


def test_seq_mse_and_gptq_follow_the_weights(lazy):
    _, model = tiny_decoder("llama", seed=2, max_context=CONTEXT)
    specs = {n: WeightSpec(bits=4) for n in ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
                                             "layers.1.mlp.down_proj")}
    windows = [_tokens((1, CONTEXT))]
    cpu, _ = optimize_weights(copy.deepcopy(model), windows, specs, RecoveryOptions(4, layer_inputs="float"), rank=None,
                              progress=False)
    on_device, _ = optimize_weights(copy.deepcopy(model).to(lazy), windows, specs, RecoveryOptions(4, layer_inputs="float"),
                                    rank=None, progress=False)
    for name in specs:
        r, c = on_device[name], cpu[name]
        assert r.scale.device.type == r.codes.device.type == "cpu"  # results come back to the host
        assert torch.allclose(r.scale, c.scale, rtol=1e-6) and torch.equal(r.codes, c.codes)
        assert r.loss == pytest.approx(c.loss, rel=1e-5)

    # GPTQ's column loop on the device (small: the lazy backend traces every column's ops)
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(8, 16, generator=g), torch.randn(32, 16, generator=g)
    gram, scale = x.T @ x, minmax_scale(w, 4)
    codes = gptq_codes(w.to(lazy), gram.to(lazy), scale.to(lazy), 4)
    assert codes.device == lazy and torch.equal(codes.cpu(), gptq_codes(w, gram, scale, 4))
