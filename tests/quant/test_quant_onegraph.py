"""One exported graph for every mode gives what one graph per mode gave, bit for bit.

The reference is the three-graph flow npuq used before (kept here, built from the per-mode
pieces that remain in src): export and prepare the calibrate, decode and prefill graphs
separately, calibrate the calibrate graph (or the decode graph, sequential mode), copy its
observer state node by node into decode and prefill, collect the decode graph's encodings and
convert decode and prefill. ``quantize_model`` must give the same encodings.json, byte for byte,
and programs whose logits are identical, in memory and after a save and a load.
"""

import dataclasses
import importlib
import json

import pytest
import torch
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from npuq.calibrate import graphs
from npuq.calibrate.encodings import collect_encodings, encodings_json, kv_io_qparams
from npuq.calibrate.engines import calibrate_onepass, calibrate_sequential
from npuq.calibrate.graphs import export_graph, export_model_graph, is_shape_node
from npuq.calibrate.split import split_windows
from npuq.testing.transfer import copy_observer_state
from npuq.models.decoder import StaticDecoder
from npuq.testing.tiny import TINY_CONFIGS, tiny_decoder
from npuq.quantize import passes, pt2e
from npuq.quantize.artifact import load_artifact, save_artifact
from npuq.quantize.passes import drop_unused_tensors
from npuq.quantize.pt2e import prepare_graph, quantize_model
from npuq.quant.quantizer import HtpQuantizer
from npuq.quant.recipe import RECIPES, Recipe
from npuq.runtime.runner import run_programs, step_inputs

CONTEXT, PREFILL = 16, 4


def reference_quantize(model, recipe, tokens, mode):
    """The three-graph flow (module docstring): (encodings, converted decode, converted prefill)."""
    cfg = model.config
    decode, _ = prepare_graph(model, recipe, "decode", CONTEXT)
    prefill, _ = prepare_graph(model, recipe, "prefill", CONTEXT, PREFILL)
    windows = split_windows(tokens, CONTEXT)
    if mode == "onepass":
        calib, _ = prepare_graph(model, recipe, "calibrate", CONTEXT)
        calibrate_onepass(calib, cfg, windows, 8)
        copy_observer_state(calib, decode)
    else:
        calibrate_sequential(decode, cfg, windows, CONTEXT)
    copy_observer_state(decode, prefill)
    encodings = collect_encodings(decode)
    return encodings, drop_unused_tensors(convert_pt2e(decode)), drop_unused_tensors(convert_pt2e(prefill))


def deep_decoder(family: str, layers: int, seed: int = 0) -> StaticDecoder:
    """A random StaticDecoder of a tiny family with more layers (its layer pattern repeated),
    deep enough that the model graph is stitched from a template."""
    _, small = tiny_decoder(family, seed=seed, max_context=CONTEXT)
    cfg, period = small.config, small.config.num_layers
    cfg = dataclasses.replace(cfg, num_layers=layers, layer_types=tuple(cfg.layer_types[i % period] for i in range(layers)),
                              use_rope=tuple(cfg.use_rope[i % period] for i in range(layers)))
    model = StaticDecoder(cfg, CONTEXT)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


def _nodes(gm):
    """Every node as (op, name, target, arguments by name, module path). A size read from a cache
    input is the same size whichever cache it is read from (torch picks one): those read "a cache"."""
    out = []
    for n in gm.graph.nodes:
        if graphs.is_input_guard(n):
            continue
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.name)
        if n.target == torch.ops.aten.sym_size.int and n.args[0].name.startswith("caches_"):
            args = (("a cache", *n.args[1:]), {})
        stack = n.meta.get("nn_module_stack")
        out.append((n.op, n.name, str(n.target), repr(args), list(stack.values())[-1][0] if stack else None))
    return out


def _calls(gm):
    return [(n.name, str(n.target)) for n in gm.graph.nodes if n.op == "call_function" and not is_shape_node(n)]


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_the_model_graph_has_the_static_decode_graphs_names_and_ops(family):
    _, model = tiny_decoder(family, seed=1, max_context=CONTEXT)
    static = export_graph(model, "decode", CONTEXT)
    model_graph = export_model_graph(model)
    assert _calls(model_graph) == _calls(static)
    assert [n.name for n in model_graph.graph.nodes if n.op == "placeholder"] == \
        [n.name for n in static.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("family,layers", [("llama", 5), ("gemma3", 7), ("smollm3", 9), ("qwen3", 4)])
def test_a_stitched_model_graph_is_the_traced_one(family, layers):
    model = deep_decoder(family, layers)
    picks = graphs.template_layers(model)
    assert len(picks) < layers  # stitched, not traced whole
    template = graphs._export_dynamic(graphs._with_layers(model, picks))
    stitched = graphs.static_names(graphs.stitch_layers(template, model, picks))
    traced = graphs.static_names(graphs._export_dynamic(model))
    assert _nodes(stitched) == _nodes(traced)
    cfg = model.config
    for B, T, C in ((1, 1, CONTEXT - 1), (2, 5, 0), (1, 4, CONTEXT - 4)):
        inputs = step_inputs(cfg, torch.randint(3, cfg.vocab_size, (B, T)), 0, C + T)
        caches = [torch.randn(B, cfg.num_kv_heads, cfg.head_dim, C) for _ in range(cfg.num_layers)] + \
                 [torch.randn(B, cfg.num_kv_heads, C, cfg.head_dim) for _ in range(cfg.num_layers)]
        expected = model(*inputs, *caches)
        assert all(torch.equal(a, b) for a, b in zip(stitched(*inputs, *caches), expected))


def test_a_stitched_model_quantizes_as_the_three_graph_flow(tmp_path):
    model = deep_decoder("gemma3", 7, seed=2)
    cfg = model.config
    tokens = torch.randint(3, cfg.vocab_size, (2 * CONTEXT + 3,), generator=torch.Generator().manual_seed(0))
    encodings, decode, prefill = reference_quantize(model, RECIPES["16a8w"], tokens, "onepass")
    qm = quantize_model(model, RECIPES["16a8w"], tokens, context=CONTEXT, prefill_len=PREFILL)
    assert json.dumps(qm.encodings, indent=1) == json.dumps(encodings, indent=1)
    ids = torch.randint(3, cfg.vocab_size, (1, CONTEXT - 3), generator=torch.Generator().manual_seed(1))
    expected = run_programs(cfg, {1: decode, PREFILL: prefill}, CONTEXT, ids)
    assert torch.equal(qm.logits(ids), expected)
    assert torch.equal(load_artifact(save_artifact(qm, tmp_path / "art")).logits(ids), expected)


def test_observer_names_are_torchs_own():
    """The linear-time namer is really swapped in for the block (it once bound the package's
    ``prepare`` function instead of the module and swapped nothing), and names as torch does."""
    fx_prepare = importlib.import_module("torch.ao.quantization.fx.prepare")
    original = fx_prepare.get_new_attr_name_with_prefix
    _, model = tiny_decoder("qwen2", seed=0, max_context=CONTEXT)
    names = []
    for fast in (True, False):
        graph = export_graph(model, "decode", CONTEXT)
        quantizer = HtpQuantizer(RECIPES["16a8w"], model.config.num_layers)
        if fast:
            with pt2e._observer_names_in_linear_time():
                assert fx_prepare.get_new_attr_name_with_prefix is not original
                prepared = prepare_pt2e(graph, quantizer)
            assert fx_prepare.get_new_attr_name_with_prefix is original
        else:
            prepared = prepare_pt2e(graph, quantizer)
        names.append([(n.name, n.target) for n in prepared.graph.nodes])
    assert names[0] == names[1]


def test_encodings_json_is_json_dumps_indent_1(tiny_folders):
    enc = tiny_folders.quantized.encodings
    assert encodings_json(enc) == json.dumps(enc, indent=1)
    odd = {"a": [1, 2.5, -0.0, True, None, "é\n"], "b": {}, "c": [], "d": [[1, 2], {"e": float("inf")}], "f": 1e-300}
    assert encodings_json(odd) == json.dumps(odd, indent=1)


def _kv8() -> Recipe:
    return Recipe.from_dict({**RECIPES["16a8w"].to_dict(), "kv_bits": 8}, name="16a8w-kv8")


CASES = [  # (family, recipe, calibration mode): every family, both modes, every weight format
    ("llama", "16a8w", "onepass"),
    ("llama3.2", "kv8", "onepass"),
    ("qwen2", "8a8w", "onepass"),
    ("qwen3", "16a8w", "sequential"),
    ("gemma3", "16a4w_block", "onepass"),
    ("smollm3", "16a4w_mixed", "onepass"),
    ("llama", "16a4w_block_mixed", "sequential"),
]


@pytest.mark.parametrize("family,scheme,mode", CASES)
def test_one_graph_gives_the_three_graph_flows_encodings_and_logits(family, scheme, mode, tmp_path):
    _, model = tiny_decoder(family, seed=6, max_context=CONTEXT)
    cfg = model.config
    recipe = _kv8() if scheme == "kv8" else RECIPES[scheme]
    tokens = torch.randint(3, cfg.vocab_size, (2 * CONTEXT + 5,), generator=torch.Generator().manual_seed(0))
    encodings, decode, prefill = reference_quantize(model, recipe, tokens, mode)
    qm = quantize_model(model, recipe, tokens, context=CONTEXT, prefill_len=PREFILL, mode=mode)

    assert json.dumps(qm.encodings, indent=1) == json.dumps(encodings, indent=1)
    assert _calls(qm.decode) == _calls(decode) and _calls(qm.prefill) == _calls(prefill)
    for ours, theirs in ((qm.decode, decode), (qm.prefill, prefill)):  # weights folded as torchao folds them
        constants = [(n.name, n.target) for n in theirs.graph.nodes if n.op == "get_attr"]
        assert [(n.name, n.target) for n in ours.graph.nodes if n.op == "get_attr"] == constants
        for _, target in constants:
            a, b = passes._constant(ours, target), passes._constant(theirs, target)
            assert a.dtype == b.dtype and torch.equal(a, b), target
    L = cfg.num_layers
    assert kv_io_qparams(qm.decode, L) == kv_io_qparams(decode, L) == kv_io_qparams(qm.prefill, L)

    ids = torch.randint(3, cfg.vocab_size, (2, CONTEXT - 2), generator=torch.Generator().manual_seed(1))
    expected = run_programs(cfg, {1: decode, PREFILL: prefill}, CONTEXT, ids)  # prefill chunks, then decode steps
    assert torch.equal(run_programs(cfg, qm.graphs(), CONTEXT, ids), expected)  # row by row, as the device runs

    out = save_artifact(qm, tmp_path / "art")
    assert (out / "encodings.json").read_text() == json.dumps(encodings, indent=1) + "\n"
    for fold in (True, False):
        loaded = load_artifact(out, fold_constants=fold)
        assert torch.equal(run_programs(cfg, loaded.graphs(), CONTEXT, ids), expected)
    single = torch.tensor([[5]])  # one token: the decode program alone
    assert torch.equal(load_artifact(out).logits(single), run_programs(cfg, {1: decode, PREFILL: prefill}, CONTEXT, single))


def test_decode_and_prefill_share_their_weights(tiny_folders):
    qm = tiny_folders.quantized
    decode = {t.data_ptr() for t in qm.decode.buffers()} | {p.data_ptr() for p in qm.decode.parameters()}
    prefill = {t.data_ptr() for t in qm.prefill.buffers()} | {p.data_ptr() for p in qm.prefill.parameters()}
    assert decode == prefill
    loaded = load_artifact(tiny_folders.artifact)
    assert {t.data_ptr() for t in loaded.decode.buffers()} == {t.data_ptr() for t in loaded.prefill.buffers()}


def test_programs_are_static_with_shapes_on_every_node(tiny_folders):
    qm = tiny_folders.quantized
    for gm, T in ((qm.decode, 1), (qm.prefill, PREFILL)):
        assert not any(is_shape_node(n) for n in gm.graph.nodes)
        tokens = next(n for n in gm.graph.nodes if n.op == "placeholder")
        assert tuple(tokens.meta["val"].shape) == (1, T)
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr") or (node.op == "call_function" and node.meta.get("val") is not None):
                assert all(isinstance(d, int) for d in node.meta["val"].shape), node.name
        missing = [n.name for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("val") is None
                   and "assert" not in str(n.target)]
        assert missing == []
