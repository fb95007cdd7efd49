"""The static decoder gives Hugging Face transformers' logits, for every family and every mode."""

import pytest
import torch

from npuq.testing.tiny import TINY_CONFIGS, tiny_decoder
from npuq.runtime.runner import StaticRunner, forward_logits

ARCHS = sorted(TINY_CONFIGS)
TOL = 1e-4  # fp32, max abs difference of logits


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(input_ids=tokens).logits


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return tiny_decoder(request.param, seed=1, max_context=64)


def test_calibrate_mode_matches_transformers(pair):
    hf, model = pair
    tokens = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = forward_logits(model, tokens)
    ref = _hf_logits(hf, tokens)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("fast_path", [None, False], ids=["eager-fast-path", "static-layout"])
@pytest.mark.parametrize("prefill_len", [4, 7])
def test_chunked_prefill_then_decode_matches_transformers(pair, prefill_len, fast_path):
    """Both ways the runner drives the eager decoder: its fast path (filled cache slots, fused
    attention) and the static device layout with the exported graph's ops."""
    hf, model = pair
    context = 32
    tokens = torch.randint(0, model.config.vocab_size, (1, 27), generator=torch.Generator().manual_seed(2))
    runner = StaticRunner(model.config, {1: model, prefill_len: model}, context, fast_path=fast_path)
    # 17 prompt tokens through AR-N chunks (the last one padded), then 10 AR-1 decode steps.
    logits = [runner.feed(tokens[0, :17].tolist())]
    for t in tokens[0, 17:].tolist():
        logits.append(runner.feed([t]))
    ours = torch.cat(logits, dim=1)
    ref = _hf_logits(hf, tokens)
    assert (ours - ref).abs().max().item() <= TOL


def test_sliding_window_layers_see_only_the_window():
    hf, model = tiny_decoder("gemma3", seed=3, max_context=64)
    assert model.config.sliding_window == 6 and model.mask_channels == 2
    # Longer than the window: the sliding layers must drop old keys exactly as transformers does.
    tokens = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(4))
    ours = forward_logits(model, tokens)
    ref = _hf_logits(hf, tokens)
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("mode", ["calibrate", "prefill", "decode"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_mode_exports(arch, mode):
    from npuq.runtime.runner import example_inputs

    _, model = tiny_decoder(arch, max_context=32)
    inputs = example_inputs(model.config, mode, context=32, ar_len=8)
    program = torch.export.export(model, inputs)
    eager = model(*inputs)
    exported = program.module()(*inputs)
    assert len(exported) == 1 + 2 * model.config.num_layers
    for a, b in zip(eager, exported):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-5)
