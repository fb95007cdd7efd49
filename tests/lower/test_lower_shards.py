"""Sharded export (``npuq export --shards``, docs/design.md §13) of artifacts quantized in parts.

Reference: the export of the same model quantized in one piece. Quantizing one layer per part
gives the whole graph's encodings and weights bit for bit (tests/quant/test_quant_parts.py), and
a shard boundary only carries the hidden states as the codes its QuantizeLinear wrote to the
DequantizeLinear that reads them, so ONNX Runtime must compute the same logits from the shards,
bit for bit: chained shard by shard per call, part-major (every call through one shard before
the next opens), and with the weights in external data files. The shard plans are checked
against hand-worked splits.
"""

import json
import re

import onnx
import pytest
import torch

from npuq.cli import main
from npuq.errors import NpuqError
from npuq.lower import export as export_mod, shards as shards_mod
from npuq.lower.export import ExportOptions, export_artifact
from npuq.lower.manifest import SHARDED_FORMAT, read_manifest
from npuq.lower.ort import load_export, qnn_available
from npuq.lower.shards import plan_shards
from npuq.quant.recipe import load_recipe
from npuq.quantize.artifact import save_artifact
from npuq.quantize.pt2e import even_parts, quantize_model
from npuq.runtime.runner import PartChain, StaticRunner, run_programs
from npuq.testing.tiny import save_tiny_hf_folder, tiny_decoder

CONTEXT, PREFILL = 16, 4
TARGET = ExportOptions(qnn_version="2.51", htp_arch=73)
# gemma3 has three layers (shards of one, two and three parts), qwen2 an untied head and LPBQ weights
FAMILIES = {"gemma3": "16a8w", "qwen2": "16a4w_block"}


def test_plans_group_whole_parts_as_evenly_as_they_allow():
    assert plan_shards([3, 3, 3, 3], "auto", limit=6) == ((0, 2), (2, 4))
    assert plan_shards([3, 3, 3, 3], "auto", limit=12) == ((0, 4),)
    assert plan_shards([3, 3, 3, 3], "auto", limit=5) == ((0, 1), (1, 2), (2, 3), (3, 4))
    # an embedding-heavy first part: the fewest shards under the limit, the largest as small as it can be
    assert plan_shards([5, 1, 1, 1, 1, 1], "auto", limit=6) == ((0, 1), (1, 6))
    assert plan_shards([5, 1, 1, 1, 1, 1], 3) == ((0, 1), (1, 3), (3, 6))  # largest 5: no split does better
    assert plan_shards([1, 1, 1, 1], 3) == ((0, 1), (1, 2), (2, 4))  # largest 2
    assert plan_shards([2], "auto") == ((0, 1),)
    with pytest.raises(NpuqError, match="quantize again with --parts 3"):
        plan_shards([1, 1], 3)
    with pytest.raises(NpuqError, match="part 2 of the artifact holds .* quantize again with more --parts"):
        plan_shards([1, 7, 1], "auto", limit=6)
    with pytest.raises(NpuqError, match="at least 1"):
        ExportOptions(shards=0)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def artifacts(request, tmp_path_factory):
    """(whole artifact, artifact of one layer per part, number of layers) of one family."""
    arch = request.param
    _, model = tiny_decoder(arch, max_context=CONTEXT)
    recipe = load_recipe(None, FAMILIES[arch])
    tokens = torch.randint(3, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    L = model.config.num_layers
    folder = tmp_path_factory.mktemp(arch)
    whole = save_artifact(quantize_model(model, recipe, tokens, context=CONTEXT, prefill_len=PREFILL), folder / "whole")
    parts = save_artifact(quantize_model(model, recipe, tokens, context=CONTEXT, prefill_len=PREFILL,
                                         parts=even_parts(L, L)), folder / "parts")
    return whole, parts, L


def _logits(folder, tokens, in_turn=None):
    manifest, graphs = load_export(folder)
    if in_turn is not None:  # part by part (in turn), or every part at each call (chained)
        graphs = {ar: PartChain(g.layers, g.programs, in_turn=in_turn) for ar, g in graphs.items()}
    return run_programs(manifest.cfg, graphs, manifest.context, tokens)


def _stepped_without_room(folder, tokens, monkeypatch):
    """Each row fed through the export's chains called as one program (a generation step), with
    no memory to keep a part loaded: each part's session opens and closes at every call."""
    import npuq.runtime.runner as runner

    manifest, graphs = load_export(folder)
    with monkeypatch.context() as m:
        m.setattr(runner, "available_memory", lambda: 0)
        rows = [StaticRunner(manifest.cfg, graphs, manifest.context).feed(row.tolist()) for row in tokens]
    assert all(not kept for g in graphs.values() for kept in g.resident.values())
    return torch.cat(rows)


def _unnamed(entries):
    return {json.dumps({k: v for k, v in e.items() if k != "name"}, sort_keys=True) for e in entries}


def test_shards_compute_the_unsharded_export_bit_for_bit(artifacts, tmp_path, monkeypatch):
    whole, parts, L = artifacts
    export_artifact(whole, tmp_path / "one", TARGET)
    tokens = torch.randint(3, 256, (2, 14), generator=torch.Generator().manual_seed(1))  # prefill chunks + decode steps
    expected = _logits(tmp_path / "one", tokens)
    reference = json.loads((tmp_path / "one" / "encodings.json").read_text())
    for shards in range(1, L + 1):
        out = tmp_path / f"s{shards}"
        result = export_artifact(parts, out, ExportOptions(qnn_version="2.51", htp_arch=73, shards=shards))
        manifest = read_manifest(out)
        if shards == 1:  # the parts merged into one piece: the unsharded layout
            assert result.shards is None and manifest.shards is None and set(manifest.graphs) == {"decode", "prefill"}
            assert torch.equal(_logits(out, tokens), expected)
        else:
            assert result.shards == shards and manifest.format == SHARDED_FORMAT and manifest.graphs is None
            layers = [s.layers for s in manifest.shards]
            assert layers[0][0] == 0 and layers[-1][1] == L and len(layers) == shards
            for k, (shard, (first, end)) in enumerate(zip(manifest.shards, layers)):
                decode = shard.graphs["decode"]
                ins, outs = [e.name for e in decode.inputs], [e.name for e in decode.outputs]
                assert ins[0] == ("tokens" if first == 0 else f"hidden_{first}")
                assert outs[0] == ("logits" if end == L else f"hidden_{end}")
                assert ins[3:] == [f"k_cache_{i}" for i in range(first, end)] + [f"v_cache_{i}" for i in range(first, end)]
                if k > 0:  # the codes one shard returns are the next one's input, in the same encoding
                    before = manifest.shards[k - 1].graphs["decode"].outputs[0]
                    assert before.name == ins[0] and before.encoding == decode.inputs[0].encoding
                    assert before.dtype == "uint16" and before.encoding.bits == 16
            for in_turn in (True, False):
                assert torch.equal(_logits(out, tokens, in_turn), expected), (shards, in_turn)
            if shards == L:  # as generation calls them: every part at each step, none kept loaded
                assert torch.equal(_stepped_without_room(out, tokens, monkeypatch), expected)
        # the weights' encodings are the unsharded export's (compared as sets without names: a part's
        # program numbers its nodes afresh, the shard prefixes them with the part, and each part
        # holds its own copy of a constant several parts read, such as a RoPE table)
        found = json.loads((out / "encodings.json").read_text())
        assert _unnamed(found["param_encodings"]) == _unnamed(reference["param_encodings"])
        assert all(re.match(r"part\d+/", e["name"]) for e in found["param_encodings"])


def test_weights_go_to_one_data_file_per_shard(artifacts, tmp_path, monkeypatch):
    whole, parts, L = artifacts
    export_artifact(whole, tmp_path / "one", TARGET)
    tokens = torch.randint(3, 256, (1, 9), generator=torch.Generator().manual_seed(2))
    expected = _logits(tmp_path / "one", tokens)
    monkeypatch.setattr(export_mod, "PROTOBUF_LIMIT", 2)  # every shard "too large" for one protobuf file
    monkeypatch.setattr(shards_mod, "EXTERNAL_MIN_BYTES", 256)  # and a tiny model's weights "large"
    for shards in (1, 2):
        out = tmp_path / f"x{shards}"
        export_artifact(parts, out, ExportOptions(qnn_version="2.51", htp_arch=73, shards=shards))
        manifest = read_manifest(out)
        for graphs in ([manifest.graphs] if shards == 1 else [s.graphs for s in manifest.shards]):
            data = {e.external_data for e in graphs.values()}
            assert len(data) == 1 and None not in data  # decode and prefill share their shard's file
            stored = {}  # graph file: {tensor: (offset, length)}
            for entry in graphs.values():
                model = onnx.load(str(out / entry.file), load_external_data=False)
                for t in model.graph.initializer:
                    if t.data_location == onnx.TensorProto.EXTERNAL:
                        where = {e.key: e.value for e in t.external_data}
                        assert where["location"] == next(iter(data)) and int(where["offset"]) % 4096 == 0
                        stored.setdefault(entry.file, {})[t.name] = (int(where["offset"]), int(where["length"]))
            # each weight once: the prefill graph points at the bytes the decode graph's copy wrote
            decode, prefill = (stored[graphs[kind].file] for kind in ("decode", "prefill"))
            shared = set(decode) & set(prefill)
            assert shared and all(decode[name] == prefill[name] for name in shared)
            unique = set(decode.values()) | set(prefill.values())
            size = (out / next(iter(data))).stat().st_size
            assert sum(n for _, n in unique) <= size <= sum(n for _, n in unique) + 4096 * len(unique)
        assert torch.equal(_logits(out, tokens), expected)


def test_cli_exports_shards_and_eval_scores_them_as_the_unsharded_export(tmp_path, capsys):
    folder = save_tiny_hf_folder(tmp_path / "llama", "llama", seed=5)  # a tokenizer for eval
    common = ["quantize", "--model", str(folder), "--scheme", "16a8w", "--calib-tokens", "64", "--context",
              str(CONTEXT), "--num-threads", "1"]
    for parts in (1, 2):
        assert main([*common, "--parts", str(parts), "--out", str(tmp_path / f"p{parts}")]) == 0
    target = ["--soc", "SM8650", "--qnn-version", "2.51"]
    assert main(["export", "--artifact", str(tmp_path / "p2"), "--out", str(tmp_path / "bad"), "--shards", "3",
                 *target]) == 2
    assert "quantize again with --parts 3" in capsys.readouterr().err and not (tmp_path / "bad").exists()
    assert main(["export", "--artifact", str(tmp_path / "p2"), "--out", str(tmp_path / "s2"), "--shards", "2", *target,
                 "--json", str(tmp_path / "s2.json")]) == 0
    result = json.loads((tmp_path / "s2.json").read_text())
    assert result["shards"] == 2 and "decode.part-2-of-2" in result["files"]
    manifest = json.loads((tmp_path / "s2" / "manifest.json").read_text())
    for bad, message in (({**manifest, "graphs": manifest["shards"][0]["graphs"]}, "not both"),
                         ({**manifest, "shards": manifest["shards"][::-1]}, "do not cover layers"),
                         ({**manifest, "format": "npuq-export/1"}, "is not 'npuq-export/2'")):
        (tmp_path / "s2" / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(NpuqError, match=message):
            read_manifest(tmp_path / "s2")
    (tmp_path / "s2" / "manifest.json").write_text(json.dumps(manifest))
    assert main(["export", "--artifact", str(tmp_path / "p1"), "--out", str(tmp_path / "one"), *target]) == 0
    scores = []
    for out in ("one", "s2"):
        assert main(["eval", "--onnx", str(tmp_path / out), "--context", str(CONTEXT), "--max-tokens", "48",
                     "--num-threads", "1", "--json", str(tmp_path / f"e{out}.json")]) == 0
        scores.append(json.loads((tmp_path / f"e{out}.json").read_text())["word_perplexity"])
    assert scores[0] == scores[1]
    # generation chains the shards at every step; the graphs' prefill length applies (4, not the default 32)
    texts = []
    for out in ("one", "s2"):
        assert main(["generate", "--onnx", str(tmp_path / out), "--prompt", "The quick brown", "--max-new-tokens", "4",
                     "--num-threads", "1", "--json", str(tmp_path / f"g{out}.json")]) == 0
        texts.append(json.loads((tmp_path / f"g{out}.json").read_text())["token_ids"])
    assert texts[0] == texts[1] and len(texts[0]) == 4
    if qnn_available() is None:  # the HTP emulator runs each shard's whole graph: the same numbers again
        htp = []
        for out in ("one", "s2"):
            assert main(["eval", "--onnx", str(tmp_path / out), "--provider", "htp", "--context", str(CONTEXT),
                         "--max-tokens", "48", "--num-threads", "1", "--json", str(tmp_path / f"h{out}.json")]) == 0
            htp.append(json.loads((tmp_path / f"h{out}.json").read_text())["word_perplexity"])
        assert htp[0] == htp[1]


def test_16_bit_codes_lowered_as_stored_give_the_same_files(artifacts, tmp_path, monkeypatch):
    """The export reads each program with its 16-bit codes as the uint16 the artifact stores
    (``load_program(narrow=True)``), not widened to the int32 the program holds: the lowering
    writes them as uint16 anyway. Reference: the export of the programs as they run (widened);
    every graph, data and encodings file must be the same bytes, and some codes must have been
    read narrow (the 16-bit embedding table, a 16-bit bias)."""
    from npuq.quantize import artifact as artifact_mod
    from npuq.quantize.graphfile import NARROWED

    whole, parts, L = artifacts
    narrowed = []
    real = artifact_mod.load_program

    def load(path, tensors=None, *, narrow=False):
        program = real(path, tensors, narrow=narrow)
        narrowed.extend(program.meta.get(NARROWED, ()))
        return program

    monkeypatch.setattr(export_mod, "load_program", load)
    monkeypatch.setattr(export_mod, "PROTOBUF_LIMIT", 2)  # the parts' weights to a data file too
    monkeypatch.setattr(shards_mod, "EXTERNAL_MIN_BYTES", 256)
    for name, art in (("whole", whole), ("parts", parts)):
        export_artifact(art, tmp_path / f"{name}-narrow", TARGET)
        assert narrowed, name
        narrowed.clear()
        monkeypatch.setattr(export_mod, "load_program", lambda path, tensors=None, *, narrow=False: load(path, tensors))
        export_artifact(art, tmp_path / f"{name}-wide", TARGET)
        assert not narrowed
        monkeypatch.setattr(export_mod, "load_program", load)
        files = sorted(p.name for p in (tmp_path / f"{name}-wide").iterdir() if p.suffix in (".onnx", ".data", ".json")
                       and p.name != "manifest.json")
        assert files == sorted(p.name for p in (tmp_path / f"{name}-narrow").iterdir()
                               if p.suffix in (".onnx", ".data", ".json") and p.name != "manifest.json")
        assert any(f.endswith(".onnx") for f in files)
        for f in files:
            assert (tmp_path / f"{name}-narrow" / f).read_bytes() == (tmp_path / f"{name}-wide" / f).read_bytes(), f
