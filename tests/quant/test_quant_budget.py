"""Weight size arithmetic (npuq.quant.size) against a hand computation, the bits-per-weight
allocation (npuq.optimize.budget) on synthetic layers and on a tiny model, and
``npuq quantize --bits-per-weight`` end to end: the recipe file it writes, read back by --recipe."""

import itertools
import json

import pytest
import torch

from npuq.cli import main
from npuq.errors import NpuqError
from npuq.testing.tiny import save_tiny_hf_folder, tiny_decoder
from npuq.optimize.budget import Option, allocate, budget_recipe, lower_hull, measure_sensitivity
from npuq.quant.recipe import RECIPES
from npuq.quant.size import WeightTensor, layer_size, model_weights, recipe_size
from npuq.quantize.pt2e import quantize_model

CONTEXT = 16

# The tiny llama (tests' models): 2 layers, hidden 64, 4 heads of 16 (q 64 rows), 2 KV heads (k, v
# 32 rows), intermediate 96, vocabulary 256, lm head its own tensor.
LAYER = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (96, 64), "up": (96, 64), "down": (64, 96)}


def test_sizes_by_hand():
    _, model = tiny_decoder("llama", max_context=CONTEXT)
    weights = model_weights(model)
    assert len(weights) == 2 * 7 + 2 and sum(w.params for w in weights) == 2 * 30720 + 2 * 256 * 64 == 94208
    # 16a4w_mixed: 4-bit linears but the down projections and the lm head at 8 bits, the table
    # shared with the 16-bit activations
    per_layer = 4 * (4096 + 2048 + 2048 + 4096 + 6144 + 6144) + 8 * 6144
    bits = 2 * per_layer + 8 * 256 * 64 + 16 * 256 * 64
    scales = 2 * 4 * sum(r for r, _ in LAYER.values()) + 4 * 256 + 8  # float32 per row; one scale + offset
    size = recipe_size(RECIPES["16a4w_mixed"], weights)
    assert size.params == 94208 and size.bits_per_weight == pytest.approx(bits / 94208) == pytest.approx(7.3043478)
    assert size.weight_bytes == bits // 8 + scales == 90632
    # LPBQ: 4-bit codes, a float32 base per row and a 4-bit multiplier per block of 32 inputs
    q = WeightTensor("layers.0.self_attn.q_proj", "linear", 64, 64)
    lpbq = layer_size(q, "16a4w_block")
    assert (lpbq.code_bits, lpbq.bytes) == (4, 64 * 64 // 2 + 64 * 4 + 64 * 2 * 4 // 8)
    assert layer_size(WeightTensor("embed_tokens", "embedding", 256, 64), "pcq4").bytes == 256 * 64 // 2 + 256 * 4
    # uniform 16a16w: every weight 16 bits, whatever the table mode
    assert recipe_size(RECIPES["16a16w"], weights).bits_per_weight == 16.0


def test_hull_drops_dominated_and_concave_points():
    opts = [Option("a", 4, 10.0), Option("b", 4, 9.0), Option("c", 8, 8.5), Option("d", 12, 2.0), Option("e", 16, 3.0)]
    # b beats a at the same bits; c lies above the chord b–d; e loses more than d
    assert [o.format for o in lower_hull(opts)] == ["b", "d"]


def test_allocation_respects_the_budget_and_beats_uniform_choices():
    """Random convex-ish layers: the greedy choice fits, is never worse than any uniform
    choice that fits, and is within the brute-force optimum's loss by at most the largest
    single step it could not take (the greedy knapsack's bound)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        layers = {}
        for i in range(5):
            n = int(torch.randint(1, 10, (1,), generator=g)) * 100
            base = float(torch.rand(1, generator=g)) * 10
            layers[f"l{i}"] = [Option("4", 4 * n, base), Option("8", 8 * n, base / 16), Option("16", 16 * n, base / 4096)]
        params = sum(o[0].bits for o in layers.values()) / 4
        for bits in (4.0, 5.5, 7.0, 9.0, 12.0, 16.0):
            chosen = allocate(layers, bits * params)
            used, loss = sum(o.bits for o in chosen.values()), sum(o.loss for o in chosen.values())
            assert used <= bits * params
            for k in range(3):
                uniform = [opts[k] for opts in layers.values()]
                if sum(o.bits for o in uniform) <= bits * params:
                    assert loss <= sum(o.loss for o in uniform) + 1e-12
            best = min(sum(o.loss for o in combo) for combo in itertools.product(*layers.values())
                       if sum(o.bits for o in combo) <= bits * params)
            assert loss <= best + max(opts[0].loss for opts in layers.values()) + 1e-9
    with pytest.raises(NpuqError, match="smallest formats"):
        allocate(layers, 3.9 * params)


def _kld(logits, ref):
    return torch.nn.functional.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()


def test_budget_at_a_recipes_bits_beats_it_on_a_tiny_model():
    """At 16a4w_mixed's own bits the budget's recipe takes no more bits, its estimated loss is
    lower, and the quantized model diverges from the float one less than 16a4w_mixed's on
    held-out tokens."""
    from npuq.runtime.runner import forward_logits

    _, model = tiny_decoder("llama", seed=3, max_context=CONTEXT)
    g = torch.Generator().manual_seed(0)
    calib = torch.randint(3, 256, (8 * CONTEXT,), generator=g)
    held_out = torch.randint(3, 256, (4, CONTEXT), generator=g)
    rows = list(calib.view(-1, CONTEXT))
    mixed = RECIPES["16a4w_mixed"]
    weights = model_weights(model)
    target = recipe_size(mixed, weights).bits_per_weight
    recipe, report = budget_recipe(model, mixed, rows, target)
    assert report.bits_per_weight <= target and recipe_size(recipe, weights).bits_per_weight == report.bits_per_weight
    assert (recipe.rotate, recipe.kv_bits) == (mixed.rotate, mixed.kv_bits)
    sens, tokens = measure_sensitivity(model, rows, weights)
    assert tokens == 8 * (CONTEXT - 1)
    mixed_choice = {w.path: (mixed.embedding if w.kind == "embedding" else mixed.resolve(w.path, "linear")[0].name)
                    for w in weights}
    assert report.estimated_loss < sum(sens[p][f] for p, f in mixed_choice.items())
    ref = forward_logits(model, held_out)
    klds = {}
    for name, r in (("mixed", mixed), ("budget", recipe)):
        qm = quantize_model(model, r, calib.tolist(), context=CONTEXT, prefill_len=4)
        with torch.no_grad():
            klds[name] = _kld(qm.logits(held_out), ref)
    assert klds["budget"] <= klds["mixed"], klds


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget-cli")
    folder = save_tiny_hf_folder(root / "model", "llama", seed=0, words=200)
    g = torch.Generator().manual_seed(0)
    text = root / "text.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (300,), generator=g)))
    return folder, text


def test_cli_bits_per_weight_writes_a_recipe_that_recipe_reads(tmp_path, hf_folder, capsys):
    folder, text = hf_folder
    base = ["quantize", "--model", str(folder), "--calib-corpus", f"file:{text}", "--calib-tokens", "48",
            "--context", str(CONTEXT), "--num-threads", "1"]
    assert main([*base, "--bits-per-weight", "6", "--recipe-summary", "--out", str(tmp_path / "b"),
                 "--json", str(tmp_path / "b.json")]) == 0
    printed = capsys.readouterr().out
    assert "weights: 6.0000 bits per weight" in printed and "budget 6 bits per weight" in printed
    result = json.loads((tmp_path / "b.json").read_text())
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert result["bits_per_weight"] == config["bits_per_weight"] <= 6
    assert result["weight_bytes"] == config["weight_bytes"] > 0
    assert result["budget"] == config["budget"] and config["budget"]["target_bits"] == 6
    assert sum(config["budget"]["formats"].values()) == 16  # 14 projections, the lm head, the table
    saved = json.loads((tmp_path / "b" / "recipe.json").read_text())
    assert saved == config["recipe"] and saved["rotate"] == "r1"  # the default recipe's rotation

    # the recipe file, given back, quantizes to the same formats and size
    assert main([*base, "--recipe", str(tmp_path / "b" / "recipe.json"), "--out", str(tmp_path / "again"),
                 "--json", str(tmp_path / "again.json")]) == 0
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["recipe_plan"] == config["recipe_plan"] and again["bits_per_weight"] == config["bits_per_weight"]
    assert "budget" not in again and not (tmp_path / "again" / "recipe.json").exists()
    assert json.loads((tmp_path / "again.json").read_text())["budget"] is None

    # every result reports its size: the default 16a8w, the table shared at 16 bits
    assert again["weight_bytes"] > 0
    capsys.readouterr()
    assert main([*base, "--bits-per-weight", "3", "--out", str(tmp_path / "x")]) == 2
    assert "--bits-per-weight 3 is outside 4..64" in capsys.readouterr().err
    assert main([*base, "--scheme", "8a8w", "--bits-per-weight", "6", "--out", str(tmp_path / "x")]) == 2
    assert "8-bit activations" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("arch,r1", [("gemma3", False), ("qwen2", False), ("llama", True)])
def test_sensitivity_of_a_streamed_model_part_by_part_is_the_whole_models(arch, r1, tmp_path):
    """A model read from disk is measured a part at a time: a forward keeps the hidden states
    entering each part, then each part, last to first, runs again with gradients from them and
    back from the part after it. The same ops in the same order as one forward and backward of
    the resident model, so the same sums, bit for bit (one torch thread, the conftest's); R1
    folded as each part is read (the tied llama head untied)."""
    from npuq.models import load_model, open_streamed
    from npuq.optimize.rotate import rotate_model, rotate_streamed

    folder = save_tiny_hf_folder(tmp_path / arch, arch, seed=2)
    resident = load_model(str(folder), max_context=CONTEXT).model
    streamed = open_streamed(str(folder), max_context=CONTEXT).model
    if r1:
        rotate_model(resident, seed=7, r1=True, r2=False)
        rotate_streamed(streamed, seed=7, r1=True, r2=False)
    L = resident.config.num_layers
    weights = model_weights(resident)
    assert weights == model_weights(streamed.skeleton)
    g = torch.Generator().manual_seed(1)
    rows = list(torch.randint(3, 256, (3, CONTEXT), generator=g)) + [torch.randint(3, 256, (7,), generator=g)]
    expected, tokens = measure_sensitivity(resident, rows, weights)
    for parts in (((0, L),), tuple((i, i + 1) for i in range(L))):
        got, got_tokens = measure_sensitivity(streamed, rows, weights, parts=parts)
        assert got_tokens == tokens == 3 * (CONTEXT - 1) + 6
        assert got == expected, parts
    assert all(v > 0 for per in expected.values() for v in per.values())


def test_cli_bits_per_weight_in_parts_chooses_what_it_chooses_whole(tmp_path, hf_folder):
    folder, text = hf_folder
    base = ["quantize", "--model", str(folder), "--calib-corpus", f"file:{text}", "--calib-tokens", "48",
            "--context", str(CONTEXT), "--num-threads", "1", "--bits-per-weight", "6"]
    configs = {}
    for parts in ("1", "2"):
        assert main([*base, "--parts", parts, "--out", str(tmp_path / parts)]) == 0
        configs[parts] = json.loads((tmp_path / parts / "config.json").read_text())
    assert configs["2"]["parts"] != configs["1"].get("parts")  # streamed in two parts, whole in one
    for key in ("recipe", "recipe_plan", "bits_per_weight", "weight_bytes"):
        assert configs["2"][key] == configs["1"][key], key
    assert {k: v for k, v in configs["2"]["budget"].items() if k != "seconds"} == \
        {k: v for k, v in configs["1"]["budget"].items() if k != "seconds"}
