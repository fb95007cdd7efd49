"""One-pass calibration equals AR-1 decode calibration over the same tokens.

Both engines see the same windows (4 whole windows of 16 tokens and a 5-token tail), each a
fresh sequence. With min/max observers, row t of the full causal forward holds exactly the
values decode step t computes, so every encoding must agree (scales within 1e-5 relative,
offsets within 1 code: see the comment in the test) except these, per attention layer:

    Q·Kᵀ (the first matmul), its scaling (mul), the view of it, the mask add and its float
    copy (to) — the tensors from the QK matmul up to the softmax input.

Their *masked* entries differ by construction: in the full forward they are products with
future keys (then pushed down by the mask), in a decode step products with empty cache slots
(zeros). Their content depends on the cache length; every other tensor's does not. So does
the mask's requantization into the mask add, whose range is derived from the scores'
(npuq.quant.specs.layer_mask_spec).
"""

import functools

import pytest
import torch

from npuq.calibrate.engines import calibrate_onepass, calibrate_sequential
from npuq.testing.transfer import copy_observer_state
from npuq.calibrate.split import split_windows
from npuq.testing.tiny import tiny_decoder
from npuq.quant.graph import DATA_MOVERS, MASK_INPUT, MATMUL, SOFTMAX
from npuq.quant.observers import is_observer
from npuq.quantize.pt2e import prepare_graph
from npuq.quant.recipe import RECIPES

CONTEXT = 16
N_TOKENS = 4 * CONTEXT + 5
ARCHS = ["llama", "gemma3", "qwen2"]  # plain, sliding window + sandwich norms, q/k/v bias


def _tokens(vocab):
    return torch.randint(3, vocab, (N_TOKENS,), generator=torch.Generator().manual_seed(7))


@functools.lru_cache(maxsize=None)
def _calibrated_decode(arch, mode, recipe="16a8w"):
    _, model = tiny_decoder(arch, seed=2, max_context=CONTEXT)
    cfg = model.config
    windows = split_windows(_tokens(cfg.vocab_size), CONTEXT)
    decode, _ = prepare_graph(model, RECIPES[recipe], "decode", CONTEXT)
    if mode == "onepass":
        calib, _ = prepare_graph(model, RECIPES[recipe], "calibrate", CONTEXT)
        calibrate_onepass(calib, cfg, windows, batch_size=3)
        copy_observer_state(calib, decode)
    else:
        calibrate_sequential(decode, cfg, windows, CONTEXT)
    return decode


def _real(gm, node):
    while node.op == "call_module" and is_observer(gm.get_submodule(node.target)):
        node = node.args[0]
    return node


def score_path_nodes(gm):
    """Nodes from each attention's Q·Kᵀ matmul up to (not including) its softmax."""
    excluded = set()
    for sm in (n for n in gm.graph.nodes if n.target in SOFTMAX):
        ancestors, stack, qk = set(), [sm.args[0]], None
        while stack:
            n = stack.pop()
            if n in ancestors or not hasattr(n, "op") or n.op in ("placeholder", "get_attr"):
                continue
            ancestors.add(n)
            if n.target in MATMUL:
                qk = n
                continue
            stack.extend(a for a in n.all_input_nodes)
        descendants, stack = set(), [qk]
        while stack:
            n = stack.pop()
            if n in descendants or n is sm:
                continue
            descendants.add(n)
            stack.extend(n.users)
        excluded |= {_real(gm, n) for n in ancestors & descendants}
    return excluded


def _mask_edges(gm, excluded):
    """Observer nodes that requantize the mask into an excluded (mask) add."""
    edges = set()
    for node in gm.graph.nodes:
        if node.op != "call_module" or not is_observer(gm.get_submodule(node.target)):
            continue
        src = node.args[0]
        if not (src.op == "call_module" and all(u in excluded for u in node.users)):
            continue  # not an input-edge requantization into the score path
        while src.op == "call_module" or (src.op == "call_function" and src.target in DATA_MOVERS):
            src = src.args[0]
        if src.op == "placeholder" and src.name == MASK_INPUT:
            edges.add(node.name)
    return edges


def _encodings(gm):
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and is_observer(gm.get_submodule(node.target)):
            scale, zp = gm.get_submodule(node.target).calculate_qparams()
            out.append((node.name, _real(gm, node.args[0]), scale.double(), zp))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_onepass_equals_sequential(arch):
    a, b = _calibrated_decode(arch, "onepass"), _calibrated_decode(arch, "sequential")
    excluded = score_path_nodes(a)
    names = {n.name for n in excluded}
    layers = a.meta.get("num_layers") or sum(1 for n in a.graph.nodes if n.target in SOFTMAX)
    assert {n.name.split("_")[0] for n in excluded} == {"matmul", "mul", "view", "add", "to"}
    assert len(excluded) == 5 * layers, names
    mask_edges = _mask_edges(a, excluded)
    assert len(mask_edges) == layers, mask_edges
    compared = 0
    for (name_a, node_a, scale_a, zp_a), (name_b, node_b, scale_b, zp_b) in zip(_encodings(a), _encodings(b), strict=True):
        assert (name_a, node_a.name) == (name_b, node_b.name)
        if node_a in excluded or name_a in mask_edges:
            continue
        rel = ((scale_a - scale_b).abs() / scale_b).max().item()
        assert rel <= 1e-5, f"{node_a.name}: scale differs by {rel:.2e} relative"
        # The offset is round(min / scale): a min that differs in its last float bits (batched
        # matmul vs matrix-vector sums) can round to the neighbouring integer, never further.
        assert (zp_a - zp_b).abs().max().item() <= 1, f"{node_a.name}: offset {zp_a.tolist()} vs {zp_b.tolist()}"
        compared += 1
    assert compared > 10 * len(excluded)  # the exclusions are a small, named minority


def test_excluded_tensors_really_differ():
    """The exclusion list is needed: at least one score tensor differs between the engines."""
    a, b = _calibrated_decode("llama", "onepass"), _calibrated_decode("llama", "sequential")
    excluded = score_path_nodes(a)
    diffs = [na.name for (_, na, sa, _), (_, nb, sb, _) in zip(_encodings(a), _encodings(b))
             if na in excluded and ((sa - sb).abs() / sb).max().item() > 1e-5]
    assert diffs
