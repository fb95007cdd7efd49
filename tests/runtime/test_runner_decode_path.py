"""The runner's routing (one token → the decode graph) and the eager decoder's fast path.

Generation feeds one token per step: it must go through the AR-1 graph, not a prefill chunk
padded with N - 1 dummies (N times the compute). The eager StaticDecoder is given only the
filled cache slots and runs fused attention; its logits and cache must be those of the static
device layout with the graph's own ops (within fp32 rounding), for every family; exported
programs must still get the static layout, and their graphs must not change.
"""

import pytest
import torch

from npuq.testing.tiny import TINY_CONFIGS, tiny_decoder
from npuq.runtime.runner import StaticRunner, example_inputs

ARCHS = sorted(TINY_CONFIGS)
CONTEXT = 32


def _tokens(n, vocab, seed=0):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Recorder:
    """A graph callable that records (T, cache length) of each call and runs ``model``."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, tokens, mask, positions, *caches):
        self.calls.append((tokens.shape[1], caches[0].shape[-1], mask.shape[-1]))
        return self.model(tokens, mask, positions, *caches)


def _cache_lengths(model):
    """Hook recording (T, cache slots given) of every forward of ``model``."""
    seen = []
    handle = model.register_forward_pre_hook(lambda _m, args: seen.append((args[0].shape[1], args[3].shape[-1])))
    return seen, handle


def test_single_tokens_go_through_the_decode_graph():
    _, model = tiny_decoder("llama", max_context=CONTEXT)
    rec = Recorder(model)
    runner = StaticRunner(model.config, {1: rec, 8: rec}, CONTEXT)
    ids = _tokens(14, model.config.vocab_size)
    runner.feed(ids[:10])  # a whole chunk, then a padded one of 2 real tokens
    for t in ids[10:]:
        runner.feed([t])  # generation steps
    assert [T for T, _, _ in rec.calls] == [8, 8, 1, 1, 1, 1]
    # not an eager StaticDecoder: the static device layout, C = ctx - T slots
    assert all(c == CONTEXT - T and s == CONTEXT for T, c, s in rec.calls)


def test_a_one_token_remainder_of_a_prompt_is_a_padded_prefill_chunk():
    """onnxruntime-genai's pipeline runs every chunk of a prompt through the prefill graph, so
    npuq's runner does too (runtime.runner.feed_schedule): the same calls, the same logits."""
    _, model = tiny_decoder("llama", max_context=CONTEXT)
    seen, handle = _cache_lengths(model)
    try:
        StaticRunner(model.config, {1: model, 8: model}, CONTEXT).feed(_tokens(17, model.config.vocab_size))
    finally:
        handle.remove()
    # the eager decoder sees only the filled slots: 0, then 8, then 16 cached entries
    assert seen == [(8, 0), (8, 8), (8, 16)]


def test_no_room_for_a_chunk_near_the_end_of_the_context_means_decode_steps():
    _, model = tiny_decoder("llama", max_context=CONTEXT)
    rec = Recorder(model)
    runner = StaticRunner(model.config, {1: rec, 8: rec}, CONTEXT)
    runner.feed(_tokens(CONTEXT, model.config.vocab_size))
    assert [T for T, _, _ in rec.calls] == [8, 8, 8, 8]
    rec.calls.clear()
    runner = StaticRunner(model.config, {1: rec, 8: rec}, CONTEXT)
    runner.feed(_tokens(28, model.config.vocab_size))
    runner.feed(_tokens(4, model.config.vocab_size, seed=1))  # 28 + 8 > 32: four AR-1 steps
    assert [T for T, _, _ in rec.calls] == [8, 8, 8, 8, 1, 1, 1, 1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefill_len", [4, 7])
def test_fast_path_gives_the_static_layouts_logits_and_cache(arch, prefill_len):
    _, model = tiny_decoder(arch, seed=5, max_context=CONTEXT)
    ids = _tokens(CONTEXT - 2, model.config.vocab_size, seed=3)  # beyond gemma3's window of 6
    runners = {
        fast: StaticRunner(model.config, {1: model, prefill_len: model}, CONTEXT, fast_path=None if fast else False)
        for fast in (True, False)
    }
    logits = {}
    for fast, runner in runners.items():
        out = [runner.feed(ids[:13])]
        out += [runner.feed([t]) for t in ids[13:]]
        logits[fast] = torch.cat(out, dim=1)
    assert logits[True].shape == (1, len(ids), model.config.vocab_size)
    assert (logits[True] - logits[False]).abs().max().item() <= 1e-5
    fast, static = runners[True], runners[False]
    assert fast.n_past == static.n_past == len(ids)
    for a, b in zip(fast.k + fast.v, static.k + static.v):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_the_fast_path_is_only_for_the_eager_decoder():
    _, model = tiny_decoder("llama", max_context=CONTEXT)
    assert StaticRunner(model.config, {1: model, 4: model}, CONTEXT).fast_path == {1: True, 4: True}
    assert StaticRunner(model.config, {1: lambda *a: model(*a)}, CONTEXT).fast_path == {1: False}
    assert StaticRunner(model.config, {1: model}, CONTEXT, fast_path=False).fast_path == {1: False}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_exported_programs_keep_the_device_layout_and_agree_with_the_eager_path(arch):
    _, model = tiny_decoder(arch, seed=2, max_context=CONTEXT)
    cfg = model.config
    programs = {T: torch.export.export(model, example_inputs(cfg, mode, CONTEXT, ar_len=4)).module()
                for T, mode in ((1, "decode"), (4, "prefill"))}
    recs = {T: Recorder(p) for T, p in programs.items()}
    ids = _tokens(20, cfg.vocab_size, seed=7)
    exported = StaticRunner(cfg, recs, CONTEXT)
    eager = StaticRunner(cfg, {1: model, 4: model}, CONTEXT)
    got = torch.cat([exported.feed(ids[:9])] + [exported.feed([t]) for t in ids[9:]], dim=1)
    ref = torch.cat([eager.feed(ids[:9])] + [eager.feed([t]) for t in ids[9:]], dim=1)
    assert all(c == CONTEXT - T for rec in recs.values() for T, c, _ in rec.calls)
    assert [T for rec in (recs[4], recs[1]) for T, _, _ in rec.calls] == [4, 4, 4] + [1] * 11  # 9 = 4 + 4 + 1 padded
    assert (got - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("mode", ["calibrate", "prefill", "decode"])
def test_exported_graphs_keep_the_explicit_attention_ops(mode):
    """fused_attention is eager only: the graphs the quantizer and the ONNX lowering see keep
    matmul, mask add and softmax, and an export that asks for the fused kernel is refused."""
    _, model = tiny_decoder("gemma3", max_context=CONTEXT)
    inputs = example_inputs(model.config, mode, CONTEXT, ar_len=4)
    graph = torch.export.export(model, inputs).module().graph
    targets = {str(n.target) for n in graph.nodes if n.op == "call_function"}
    assert not any("scaled_dot_product" in t for t in targets)
    assert any("softmax" in t for t in targets)
    with pytest.raises(ValueError, match="fused_attention is for eager calls"):
        torch.export.export(model, inputs, kwargs={"fused_attention": True})
