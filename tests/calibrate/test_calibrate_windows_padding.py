"""No padded position ever reaches an observer, and bad calibration input fails clearly."""

import pytest
import torch

from npuq.calibrate.engines import calibrate_onepass, calibrate_sequential
from npuq.calibrate.split import split_windows
from npuq.errors import NpuqError
from npuq.testing.tiny import tiny_decoder
from npuq.quant.observers import NonFiniteTensor, is_observer
from npuq.quantize.pt2e import prepare_graph, quantize_model
from npuq.quant.recipe import RECIPES
from npuq.runtime.runner import step_inputs

CONTEXT = 16


@pytest.fixture(scope="module")
def model():
    return tiny_decoder("llama", seed=3, max_context=CONTEXT)[1]


def test_split_windows_whole_windows_and_a_tail():
    ids = torch.arange(2 * CONTEXT + 5)
    w = split_windows(ids, CONTEXT)
    assert w.full.shape == (2, CONTEXT) and w.tail.shape == (1, 5)
    assert torch.equal(torch.cat([w.full.flatten(), w.tail.flatten()]), ids)  # every token once, nothing added
    assert w.tokens == ids.numel()
    assert split_windows(torch.arange(2 * CONTEXT), CONTEXT).tail is None


def test_text_shorter_than_one_window_is_an_error(model):
    with pytest.raises(NpuqError, match=r"15 tokens, shorter than one window of 16"):
        split_windows(torch.arange(CONTEXT - 1), CONTEXT)
    with pytest.raises(NpuqError, match="shorter than one window"):
        quantize_model(model, RECIPES["16a8w"], torch.arange(CONTEXT - 1), context=CONTEXT)


class Recorder:
    """Wraps a prepared graph module; keeps every call's inputs (other attributes pass through)."""

    def __init__(self, module):
        self.inner, self.calls = module, []

    def __call__(self, tokens, mask, positions, *caches):
        self.calls.append((tokens.clone(), mask.clone(), positions.clone(), len(caches)))
        return self.inner(tokens, mask, positions, *caches)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_onepass_forwards_carry_only_real_tokens(model):
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (3 * CONTEXT + 7,), generator=torch.Generator().manual_seed(0))
    graph, _ = prepare_graph(model, RECIPES["16a8w"], "calibrate", CONTEXT)
    rec = Recorder(graph)
    calibrate_onepass(rec, cfg, split_windows(ids, CONTEXT), batch_size=2)
    assert [tuple(c[0].shape) for c in rec.calls] == [(2, CONTEXT), (1, CONTEXT), (1, 7)]
    assert torch.equal(torch.cat([c[0].flatten() for c in rec.calls]), ids)
    for tokens, mask, positions, n_caches in rec.calls:
        T = tokens.shape[1]
        assert n_caches == 0
        # the mask is purely causal: no key is masked for being padding
        assert torch.equal(mask, step_inputs(cfg, tokens, 0, T)[1])
        assert (mask[0, 0].diagonal() == 0).all() and (mask[0, 0].tril() == 0).all()
        assert torch.equal(positions[0], torch.arange(T, dtype=torch.int32))


def test_sequential_steps_cover_each_token_once(model):
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (CONTEXT + 3,), generator=torch.Generator().manual_seed(1))
    graph, _ = prepare_graph(model, RECIPES["16a8w"], "decode", CONTEXT)
    rec = Recorder(graph)
    calibrate_sequential(rec, cfg, split_windows(ids, CONTEXT), CONTEXT)
    assert torch.equal(torch.cat([c[0].flatten() for c in rec.calls]), ids)
    positions = [int(c[2][0, 0]) for c in rec.calls]
    assert positions == list(range(CONTEXT)) + list(range(3))  # each window starts from an empty cache


def _state(gm):
    return {n.target: {k: v.clone() for k, v in gm.get_submodule(n.target).state_dict().items()}
            for n in gm.graph.nodes if n.op == "call_module" and is_observer(gm.get_submodule(n.target))}


def test_padding_would_change_observers(model):
    """Why the tail is never padded: the published padded variant moves observer ranges."""
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (CONTEXT + 6,), generator=torch.Generator().manual_seed(2))
    windows = split_windows(ids, CONTEXT)
    ours, _ = prepare_graph(model, RECIPES["16a8w"], "calibrate", CONTEXT)
    calibrate_onepass(ours, cfg, windows)
    padded, _ = prepare_graph(model, RECIPES["16a8w"], "calibrate", CONTEXT)
    tail = torch.cat([windows.tail, torch.zeros(1, CONTEXT - 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        padded(*step_inputs(cfg, windows.full, 0, CONTEXT))
        padded(*step_inputs(cfg, tail, 0, CONTEXT, n_real=6))  # pads masked, but still computed
    a, b = _state(ours), _state(padded)
    changed = [k for k in a if any(not torch.equal(a[k][s], b[k][s]) for s in a[k])]
    assert changed


def test_nan_reaching_an_observer_names_the_node():
    _, model = tiny_decoder("llama", seed=3, max_context=CONTEXT)
    with torch.no_grad():
        model.layers[1].self_attn.o_proj.weight.fill_(3e38)  # finite, but its output overflows to inf
    ids = torch.randint(3, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    with pytest.raises(NonFiniteTensor, match=r"NaN or Inf reached the observer of linear_\d+ \(layers\.1\.self_attn\.o_proj\)"):
        quantize_model(model, RECIPES["16a8w"], ids, context=CONTEXT)


def test_unknown_mode_and_bad_prefill(model):
    ids = torch.arange(CONTEXT)
    with pytest.raises(NpuqError, match="unknown calibration mode 'fast'"):
        quantize_model(model, RECIPES["16a8w"], ids, context=CONTEXT, mode="fast")
    with pytest.raises(NpuqError, match="prefill length 16 must be"):
        quantize_model(model, RECIPES["16a8w"], ids, context=CONTEXT, prefill_len=CONTEXT)
