"""Empty cache slots of an exported graph hold the zero point, so they read as 0.0.

An exported graph takes its caches as codes: a slot left at code 0 reads as -zero_point·scale,
which for a K cache with a wide range (Qwen2.5-0.5B: -145) is a large key. While the masked
scores were encoded on their observed range with a mask of -255, such a key's q·k outweighed
the mask, which turned an exported Qwen2.5-Coder-0.5B's word perplexity of 45 into 60,000.
Since the ``scores + mask`` encoding puts every masked entry below every real score
(npuq.quant.specs.masked_scores_spec, docs/design.md §9), what an empty slot holds no longer
reaches the logits at all; the runner still fills slots with the zero point. A tiny Qwen2 with
its key projections scaled up has such a K range.
"""

import pytest
import torch

from npuq.lower.export import ExportOptions, export_artifact
from npuq.lower.ort import load_export
from npuq.testing.tiny import tiny_decoder
from npuq.quant.recipe import RECIPES
from npuq.quantize.artifact import load_artifact, save_artifact
from npuq.quantize.pt2e import quantize_model
from npuq.runtime.runner import StaticRunner

CONTEXT, PREFILL = 16, 4


@pytest.fixture(scope="module")
def wide_k(tmp_path_factory):
    _, model = tiny_decoder("qwen2", max_context=CONTEXT)
    with torch.no_grad():
        for layer in model.layers:  # keys spread over about ±60 around 0: zero point mid-range
            layer.self_attn.k_proj.weight.mul_(40.0)
            layer.self_attn.q_proj.weight.mul_(4.0)
    tokens = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    qm = quantize_model(model, RECIPES["16a8w"], tokens, context=CONTEXT, prefill_len=PREFILL)
    art = save_artifact(qm, tmp_path_factory.mktemp("art") / "wide-k")
    out = tmp_path_factory.mktemp("onnx") / "out"
    export_artifact(art, out, ExportOptions(qnn_version="2.51", htp_arch=73))
    return model.config, art, out


def _logits(cfg, graphs, ids):
    return StaticRunner(cfg, graphs, CONTEXT).feed(ids)


def test_empty_slots_hold_the_zero_point_and_the_export_matches_the_programs(wide_k):
    cfg, art, out = wide_k
    manifest, graphs = load_export(out)
    k0 = next(s for s in manifest.graphs["decode"].inputs if s.name == "k_cache_0")
    assert k0.encoding.zero_point > 1000  # the case this guards: code 0 is far from 0.0
    assert graphs[1].empty_cache[0] == k0.encoding.zero_point
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))[0].tolist()
    ref = load_artifact(art).logits(torch.tensor([ids]))
    got = _logits(cfg, graphs, ids)
    # Bound as in test_lower_export.py's runner test: the exported QDQ graph computes the
    # programs' ops within a code or so per requantization, 1% of the largest logit
    # (measured: 3.0e-4 against a bound of 2.8e-2; with code-0 slots: 3.2, 116x the bound).
    bound = 0.01 * float(ref.abs().max())
    assert float((got - ref).abs().max()) < bound
    # Slots at code 0 (keys of about -60) are masked and so take no weight either: the same
    # logits to the bit (with the mask of -255 encoded on its observed range: 116x the bound).
    for g in set(graphs.values()):
        g.empty_cache = (0.0,) * len(g.empty_cache)
    assert torch.equal(_logits(cfg, graphs, ids), got)
