"""Quantizing in parts (docs/design.md §13): the model graph cut at block boundaries, each part
prepared, calibrated and converted on its own, optionally streamed from disk.

References: the whole-graph flow on the same model and tokens. Observers only watch, so every
part sees the float activations the whole graph's observers see, in the same ops, and the
results must agree exactly: the same encodings (compared by tensor name: the merged file lists
them part by part), the same recipe plan, and logits equal bit for bit (one torch thread, the
conftest's, so both sum in the same order). The streamed model reads the same float32 tensors
the resident one holds, so it must give the same again.
"""

import dataclasses
import itertools
import json

import pytest
import torch

from npuq.calibrate.graphs import export_model_graph, meta_model_graph, part_graph
from npuq.cli import main
from npuq.errors import NpuqError
from npuq.models import load_model, open_streamed
from npuq.optimize.driver import RecoveryOptions
from npuq.optimize.recovery import PartRecovery
from npuq.calibrate.split import split_windows
from npuq.testing.tiny import TINY_CONFIGS, save_tiny_hf_folder, tiny_decoder
from npuq.optimize.rotate import rotate_model, rotate_streamed
from npuq.quant.recipe import load_recipe
from npuq.quantize.artifact import PARTS_FORMAT, load_artifact, read_artifact, save_artifact, weights_sha256, \
    start_weights_sha256
from npuq.quantize.pt2e import check_parts, even_parts, quantize_model
from npuq.quantize.stage import auto_parts
from npuq.runtime.runner import step_inputs

ARCHS = sorted(TINY_CONFIGS)
CONTEXT = 32


def _by_name(encodings):
    return {key: {e["name"]: e for e in encodings[key]} for key in ("activation_encodings", "param_encodings")}


def _tokens(vocab, shape, seed):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_chained_parts_compute_the_whole_graph_bit_for_bit(arch):
    model = tiny_decoder(arch)[1]
    cfg = model.config
    L, KV, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    B, T, C = 2, 5, 7  # a filled cache: the parts' caches must line up with their layers
    tokens, mask, positions = step_inputs(cfg, _tokens(cfg.vocab_size, (B, T), 0), C, C + T)
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(B, KV, D, C, generator=g) for _ in range(L)] + \
             [torch.randn(B, KV, C, D, generator=g) for _ in range(L)]
    whole = export_model_graph(model)
    expected = whole(tokens, mask, positions, *caches)
    for graph in (whole, meta_model_graph(cfg, model.max_context)):  # the meta trace holds no weights
        for layers in (even_parts(L, L), even_parts(L, 2), even_parts(L, 1)):
            x, k_news, v_news = tokens, [], []
            for first, end in layers:
                out = part_graph(graph, first, end, model)(x, mask, positions, *caches[first:end],
                                                          *caches[L + first : L + end])
                n = end - first
                x, k_news, v_news = out[0], k_news + list(out[1 : 1 + n]), v_news + list(out[1 + n :])
            assert torch.equal(x, expected[0]), (arch, layers)
            for got, want in zip(k_news + v_news, expected[1:], strict=True):
                assert torch.equal(got, want), (arch, layers)


@pytest.fixture(scope="module")
def calibration():
    return _tokens(256, (150,), 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_one_layer_per_part_gives_the_whole_graphs_encodings_and_logits(arch, calibration, tmp_path):
    model = tiny_decoder(arch)[1]
    L = model.config.num_layers
    recipe = load_recipe(None, "16a8w")
    whole = quantize_model(model, recipe, calibration, context=CONTEXT, batch_size=3)
    parts = quantize_model(model, recipe, calibration, context=CONTEXT, batch_size=3, parts=even_parts(L, L))
    assert parts.parts == even_parts(L, L)
    assert _by_name(parts.encodings) == _by_name(whole.encodings)
    assert parts.plan.to_list() == whole.plan.to_list()
    test = _tokens(256, (3, 30), 3)  # prefill chunks and decode steps, through the scoring program too
    expected = whole.logits(test)
    assert torch.equal(parts.logits(test), expected)
    # the artifact of the parts reads back as the same programs
    folder = save_artifact(parts, tmp_path / "art")
    config = read_artifact(folder)
    assert config.format == PARTS_FORMAT and [p.layers for p in config.parts] == list(even_parts(L, L))
    assert torch.equal(load_artifact(folder).logits(test), expected)
    assert _by_name(json.loads((folder / "encodings.json").read_text())) == _by_name(whole.encodings)


@pytest.mark.parametrize("arch,r1,r2", [("gemma3", False, False), ("qwen2", False, False), ("llama", True, True),
                                        ("gemma3", True, False)])  # R1 across sandwich norms; q/k/v biases
def test_streamed_parts_equal_the_resident_model(arch, r1, r2, calibration, tmp_path):
    """Sliding windows and norm offsets (gemma3), biases and an untied head (qwen2), a tied head
    untied by R1 (llama); rotated as each part is read, or the resident model in place."""
    folder = save_tiny_hf_folder(tmp_path / arch, arch, seed=4)
    resident = load_model(str(folder), max_context=64)
    streamed = open_streamed(str(folder), max_context=64)  # the same RoPE length: the same tables
    # the hash of the float weights, read one tensor at a time, is the resident model's
    assert start_weights_sha256(streamed.model)() == weights_sha256(resident.model)
    if r1 or r2:
        expected_report = rotate_model(resident.model, seed=7, r1=r1, r2=r2)
        report = rotate_streamed(streamed.model, seed=7, r1=r1, r2=r2)
        assert dataclasses.replace(report, seconds=0) == dataclasses.replace(expected_report, seconds=0)
        assert streamed.model.config == resident.model.config  # untied alike
    L = resident.config.num_layers
    recipe = load_recipe(None, "16a8w")
    expected = quantize_model(resident.model, recipe, calibration, context=CONTEXT, batch_size=4)
    stored = []
    got = quantize_model(streamed.model, recipe, calibration, context=CONTEXT, batch_size=4,
                         parts=even_parts(L, 2), store=lambda k, part: stored.append((k, part)))
    assert [k for k, _ in stored] == [0, 1] and got.decode is None  # the programs went to store only
    assert _by_name(got.encodings) == _by_name(expected.encodings)
    test = _tokens(resident.config.vocab_size, (2, 30), 5)
    chained = quantize_model(streamed.model, recipe, calibration, context=CONTEXT, batch_size=4, parts=even_parts(L, 2))
    assert torch.equal(chained.logits(test), expected.logits(test))


def test_parts_are_checked():
    assert even_parts(5, 2) == ((0, 2), (2, 5))
    assert even_parts(4, 4) == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert check_parts(None, 3) == ((0, 3),)
    with pytest.raises(NpuqError, match="splits into 1 to 2 parts"):
        even_parts(2, 3)
    with pytest.raises(NpuqError, match="do not cover layers 0..3 in order"):
        check_parts([(0, 2), (1, 4)], 4)
    with pytest.raises(NpuqError, match="end at layer 2, not at the model's last, 3"):
        check_parts([(0, 3)], 4)


def _splits(n):
    """Every way to cut n layers into runs of consecutive layers, as (first, end) pairs."""
    for mask in itertools.product((False, True), repeat=n - 1):
        cuts = [0, *(i + 1 for i, cut in enumerate(mask) if cut), n]
        yield tuple(zip(cuts, cuts[1:]))


def test_auto_parts_keeps_small_models_whole_and_cuts_larger_ones_by_bytes(monkeypatch):
    from npuq.models import model_sizes
    from npuq.quantize import stage
    from npuq.resources import USABLE_FRACTION

    model = tiny_decoder("smollm3")[1]  # 4 layers
    cfg = model.config
    L = cfg.num_layers
    by_layer = [0] * L  # the reference: the tiny model's own parameters, by the layer that holds them
    for name, p in model.named_parameters():
        layer = int(name.split(".")[1]) if name.startswith("layers.") else 0 if name.startswith("embed") else L - 1
        by_layer[layer] += 4 * p.numel()
    weights = sum(by_layer)
    assert weights == model_sizes(cfg)[1]
    plenty = int(100 * weights / USABLE_FRACTION)
    whole = ((0, L),)

    def best(limit):  # brute force: the fewest runs within the limit, and the smallest largest run of that count
        fitting = [s for s in _splits(L) if max(sum(by_layer[a:b]) for a, b in s) <= max(limit, max(by_layer))]
        count = min(len(s) for s in fitting)
        return count, min(max(sum(by_layer[a:b]) for a, b in s) for s in fitting if len(s) == count)

    # a model of at most PART_BYTES that fits: one part, loaded whole, whatever the memory to spare
    assert stage.PART_BYTES >= weights and auto_parts(cfg, plenty) == whole
    assert auto_parts(cfg, int(2.5 * weights / USABLE_FRACTION) + 1) == whole
    for limit in (weights // 2, weights // 3 + 1, weights // 4, 1):  # larger models: parts of at most PART_BYTES
        monkeypatch.setattr(stage, "PART_BYTES", limit)
        layout = auto_parts(cfg, plenty)
        assert check_parts(layout, L) == layout  # every layer once, in order
        assert (len(layout), max(sum(by_layer[a:b]) for a, b in layout)) == best(limit), limit
        assert auto_parts(cfg, plenty, whole=True) == whole  # SeqMSE/GPTQ, a budget: the whole model, which fits
    monkeypatch.setattr(stage, "PART_BYTES", 1 << 40)
    # one that does not fit 2.5x: parts of a quarter of the usable memory, also where the run wants it whole
    tight = int(2 * weights / USABLE_FRACTION)
    for needs_whole in (False, True):
        layout = auto_parts(cfg, tight, whole=needs_whole)
        assert len(layout) > 1 and (len(layout), max(sum(by_layer[a:b]) for a, b in layout)) == best(
            int(USABLE_FRACTION * tight / 4))


def test_auto_parts_gives_a_large_embedding_table_a_part_with_one_layer(monkeypatch):
    """A vocabulary-heavy model (Qwen2.5-1.5B: a 0.93 GB table, 0.19 GB blocks): the first part is
    the table and one layer, the last one layer and the head, the layers between in as few parts
    as there can be of at most the largest of those two (which sets the run's peak anyway)."""
    from npuq.models import StaticDecoder
    from npuq.quantize import stage

    cfg = dataclasses.replace(tiny_decoder("qwen2")[1].config, vocab_size=4096, num_layers=12, layer_types=(),
                              use_rope=())
    with torch.device("meta"):
        params = dict(StaticDecoder(cfg, 1).named_parameters())
    table = 4 * params["embed_tokens.weight"].numel()
    block = 4 * sum(p.numel() for n, p in params.items() if n.startswith("layers.0."))
    limit = table + block // 2  # the table fits, not with a layer beside it
    monkeypatch.setattr(stage, "PART_BYTES", limit)
    layout = auto_parts(cfg, 1 << 40)
    assert layout[0] == (0, 1) and layout[-1] == (11, 12)
    # the largest part (one layer, the final norm and the head) sets the limit the others keep
    per_part = (table + block + 4 * cfg.hidden_size) // block
    assert all(b - a <= per_part for a, b in layout[1:-1]) and len(layout) == 2 + -(-10 // per_part)


def test_cli_quantizes_in_parts_and_eval_scores_the_artifact(tmp_path, capsys):
    folder = save_tiny_hf_folder(tmp_path / "llama", "llama", seed=5)
    common = ["quantize", "--model", str(folder), "--scheme", "16a8w", "--calib-tokens", "64", "--context", "16"]
    assert main([*common, "--parts", "2", "--calibration-mode", "sequential", "--out", str(tmp_path / "refused")]) == 2
    assert "use --calibration-mode onepass" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
    assert main([*common, "--parts", "2", "--out", str(tmp_path / "p2"), "--json", str(tmp_path / "p2.json")]) == 0
    result = json.loads((tmp_path / "p2.json").read_text())
    assert result["parts"] == 2 and result["streamed"] is True and result["rotation"]["r1"]  # the default R1
    assert [p["source"] for p in result["thread_plan"].values()] == ["kept"]  # a streamed model is not timed
    assert main([*common, "--parts", "1", "--num-threads", "1", "--out", str(tmp_path / "p1"),
                 "--json", str(tmp_path / "p1.json")]) == 0
    assert json.loads((tmp_path / "p1.json").read_text())["rotation"]["r1"]
    scores = []
    for art in ("p1", "p2"):
        assert main(["eval", "--artifact", str(tmp_path / art), "--context", "16", "--max-tokens", "64",
                     "--num-threads", "1", "--json", str(tmp_path / f"e{art}.json")]) == 0
        scores.append(json.loads((tmp_path / f"e{art}.json").read_text())["word_perplexity"])
    assert scores[0] == scores[1]


def test_an_artifact_in_parts_runs_part_by_part_with_the_same_logits(tmp_path):
    """``load_artifact(in_turn=True)`` reads each part's programs when it first runs and drops them
    when its calls are done (memory: one part); every call sees what it sees chained, so the
    logits are the chained programs' bit for bit."""
    _, model = tiny_decoder("gemma3", max_context=CONTEXT)
    L = model.config.num_layers
    recipe = load_recipe(None, "16a8w")
    calibration = _tokens(model.config.vocab_size, (64,), 0).tolist()
    qm = quantize_model(model, recipe, calibration, context=CONTEXT, prefill_len=4, parts=even_parts(L, L))
    folder = save_artifact(qm, tmp_path / "art")
    tokens = _tokens(model.config.vocab_size, (2, 11), 1)  # prefill chunks and decode steps
    chained = load_artifact(folder, scoring=False, in_turn=False)
    in_turn = load_artifact(folder, in_turn=True)
    assert in_turn.scoring is None and all(c.in_turn for c in in_turn.graphs().values())
    assert torch.equal(in_turn.logits(tokens), chained.logits(tokens))
    assert all(p.part._programs is None for p in in_turn.decode.programs)  # every part released


def test_the_head_part_calibrates_a_window_at_a_time_with_the_same_encodings(monkeypatch, calibration):
    """Quantizing in parts, the part that holds the head calibrates at most ``head_rows`` windows
    per call (its logits are context × vocabulary floats a window); the observers see every
    window's values in the same ops, so the encodings are the whole graph's, which calibrates a
    whole batch per call."""
    from npuq.quantize import pt2e

    calls = []
    real = pt2e.calibrate_onepass

    def spy(graph, cfg, windows, batch_size, progress=None, **kwargs):
        calls.append(kwargs.get("rows"))
        return real(graph, cfg, windows, batch_size, progress, **kwargs)

    model = tiny_decoder("qwen2")[1]
    L = model.config.num_layers
    recipe = load_recipe(None, "16a8w")
    whole = quantize_model(model, recipe, calibration, context=CONTEXT, batch_size=3)
    monkeypatch.setattr(pt2e, "calibrate_onepass", spy)
    monkeypatch.setattr(pt2e, "HEAD_CALL_BYTES", 1)  # a window per call
    parts = quantize_model(model, recipe, calibration, context=CONTEXT, batch_size=3, parts=even_parts(L, 2))
    assert calls == [None, 1]
    assert _by_name(parts.encodings) == _by_name(whole.encodings)
    monkeypatch.undo()
    assert pt2e.head_rows(model.config, CONTEXT) == max(1, pt2e.HEAD_CALL_BYTES // (4 * CONTEXT * 256))


@pytest.mark.parametrize("arch,scheme,rounding,inputs,r1", [
    ("gemma3", "16a4w", "gptq", "quantized", False),
    ("qwen2", "16a4w_block", "gptq", "quantized", False),
    ("llama", "16a4w", "nearest", "float", True),
    ("qwen3", "16a4w", "gptq", "asymmetric", True),
])
def test_seqmse_and_gptq_in_streamed_parts_equal_the_whole_model(arch, scheme, rounding, inputs, r1, calibration,
                                                                 tmp_path):
    """SeqMSE/GPTQ part by part (quantize_model's ``recover``) on a model streamed from disk one
    layer per part: the walk hands each part the hidden states the part before returned, so
    every layer's Gram, scales and codes are the whole model's, and so are the encodings and
    the logits, bit for bit. Float layer inputs carry the float model's hidden states instead
(asymmetric ones both);
    R1 folds into each part as it is read (the tied llama head untied)."""
    folder = save_tiny_hf_folder(tmp_path / arch, arch, seed=4)
    resident = load_model(str(folder), max_context=64)
    streamed = open_streamed(str(folder), max_context=64)
    if r1:
        rotate_model(resident.model, seed=7, r1=True, r2=False)
        rotate_streamed(streamed.model, seed=7, r1=True, r2=False)
    L = resident.config.num_layers
    recipe = load_recipe(None, scheme)
    options = RecoveryOptions(seq_mse=8, weight_rounding=rounding, layer_inputs=inputs)
    windows = split_windows(calibration, CONTEXT)
    whole = PartRecovery(resident.model, recipe, windows, options, progress=False)
    expected = quantize_model(resident.model, recipe, calibration, context=CONTEXT, batch_size=4, recover=whole)
    parts = PartRecovery(streamed.model.skeleton, recipe, windows, options, progress=False)
    got = quantize_model(streamed.model, recipe, calibration, context=CONTEXT, batch_size=4,
                         parts=even_parts(L, L), recover=parts)
    a, b = whole.optimizer.results, parts.optimizer.results
    assert list(a) == list(b) and len(a) == 7 * L + 1  # every linear layer, the head included
    for name in a:
        assert torch.equal(a[name].scale, b[name].scale) and torch.equal(a[name].codes, b[name].codes), name
    assert whole.summary().output_error_reduction == parts.summary().output_error_reduction > 0
    assert _by_name(got.encodings) == _by_name(expected.encodings)
    test = _tokens(resident.config.vocab_size, (2, 30), 5)
    assert torch.equal(got.logits(test), expected.logits(test))


def test_cli_quantizes_in_parts_with_gptq_as_it_does_whole(tmp_path):
    """``npuq quantize --parts 2 --seq-mse --weight-rounding gptq`` streams the model and
    recovers each part as it is read: the artifact's encodings and score are the whole run's."""
    folder = save_tiny_hf_folder(tmp_path / "llama", "llama", seed=6)
    common = ["quantize", "--model", str(folder), "--scheme", "16a4w", "--calib-tokens", "64", "--context", "16",
              "--seq-mse", "4", "--weight-rounding", "gptq", "--num-threads", "1"]
    results = {}
    for parts in ("1", "2"):
        out = tmp_path / f"p{parts}"
        assert main([*common, "--parts", parts, "--out", str(out), "--json", str(tmp_path / f"p{parts}.json")]) == 0
        results[parts] = json.loads((tmp_path / f"p{parts}.json").read_text())
        # the walk's time is in the result as in config.json, beside SeqMSE's and GPTQ's
        optimize = json.loads((out / "config.json").read_text())["optimize"]
        assert results[parts]["gram_seconds"] == optimize["gram_seconds"] > 0
        assert main(["eval", "--artifact", str(out), "--context", "16", "--max-tokens", "64", "--num-threads", "1",
                     "--json", str(tmp_path / f"e{parts}.json")]) == 0
    assert results["2"]["streamed"] is True and results["1"]["streamed"] is False
    assert results["1"]["weight_rounding"]["method"] == results["2"]["weight_rounding"]["method"] == "gptq"
    assert _by_name(json.loads((tmp_path / "p2" / "encodings.json").read_text())) == \
        _by_name(json.loads((tmp_path / "p1" / "encodings.json").read_text()))
    scores = [json.loads((tmp_path / f"e{p}.json").read_text())["word_perplexity"] for p in ("1", "2")]
    assert scores[0] == scores[1]


def test_generate_runs_an_artifact_too_large_for_memory_part_by_part(tmp_path, monkeypatch):
    """Where neither the artifact's parts nor the float model fit memory, `generate --artifact`
    reads each part at every step and the float model only for its tokenizer: the same tokens as
    the parts held together."""
    import npuq.quantize.artifact as artifact
    import npuq.runtime.runner as runner

    folder = save_tiny_hf_folder(tmp_path / "qwen2", "qwen2", seed=6)
    assert main(["quantize", "--model", str(folder), "--scheme", "16a8w", "--calib-tokens", "64", "--context", "16",
                 "--parts", "2", "--num-threads", "1", "--out", str(tmp_path / "art")]) == 0
    generate = ["generate", "--artifact", str(tmp_path / "art"), "--prompt", "w5 w17 w3 w42 w8", "--max-new-tokens",
                "6", "--num-threads", "1"]
    assert main([*generate, "--json", str(tmp_path / "held.json")]) == 0
    reads = []
    monkeypatch.setattr(artifact, "available_memory", lambda: 0)  # the parts do not fit: in turn
    monkeypatch.setattr(runner, "available_memory", lambda: 0)  # no room to keep one: each read at every step
    monkeypatch.setattr(artifact, "_load_part", lambda *a, _load=artifact._load_part: reads.append(a[2]) or _load(*a))
    assert main([*generate, "--json", str(tmp_path / "in_turn.json")]) == 0
    held, in_turn = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("held", "in_turn"))
    assert in_turn["token_ids"] == held["token_ids"] and len(held["token_ids"]) == 6
    assert in_turn["prompt_tokens"] == held["prompt_tokens"] == 5  # the tiny Qwen2 folder's word-level tokenizer
    # the prompt's prefill chunks (the last one padded), then a decode step per token after the first
    prefill_len = read_artifact(tmp_path / "art").programs["prefill"].ar_len
    assert reads == [0, 1] * (-(-5 // prefill_len) + 5)
