"""What AIMET reads of an export (docs/design.md §11): Q/DQ pairs sharing their initializers
(and running bit for bit as before), LPBQ multipliers in AIMET 1.0.0's (output channel, block)
order, one encodings file per graph named as AIMET's QDQ importer names the tensors, the graph
as that importer takes it, and AIMET's own readers on all of it (where aimet-onnx can be run)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from npuq.lower.aimet import aimet_import_graph, loadable_encodings
from npuq.lower.export import ExportOptions, export_artifact
from npuq.lower.manifest import read_manifest
from npuq.lower.ort import cpu_session, htp_session, qnn_available
from test_lower_deployable import _feeds
from test_lower_export import _quantize

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "bench" / "aimet_check.py"
KINDS = ("decode", "prefill")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """Two exports of tiny models: Qwen2-shaped 16a4w_block (LPBQ weights, q/k/v biases, 8-bit
    KV) and Llama-shaped 16a8w (per-channel weights, 16-bit KV)."""
    arts = {"lpbq": _quantize(tmp_path_factory, "qwen2", "16a4w_block", kv_bits=8),
            "16a8w": _quantize(tmp_path_factory, "llama", "16a8w")}
    outs = {}
    for which, art in arts.items():
        out = tmp_path_factory.mktemp(f"aimet-{which}") / "out"
        export_artifact(art, out, ExportOptions(qnn_version="2.51", htp_arch=73))
        outs[which] = out
    return outs


def _graph(out, kind):
    return onnx.load(str(out / f"{kind}.onnx"))


@pytest.mark.parametrize("which", ["lpbq", "16a8w"])
def test_qdq_pairs_share_their_initializers(exports, which):
    for kind in KINDS:
        g = _graph(exports[which], kind).graph
        producer = {o: n for n in g.node for o in n.output}
        pairs = [(producer[n.input[0]], n) for n in g.node if n.op_type == "DequantizeLinear"
                 and n.input[0] in producer and producer[n.input[0]].op_type == "QuantizeLinear"]
        assert len(pairs) > 20
        assert all(list(q.input[1:3]) == list(dq.input[1:3]) for q, dq in pairs), kind
        read = {x for n in g.node for x in n.input}
        assert [i.name for i in g.initializer if i.name not in read] == []  # the copies are gone


def _unshared(model):
    """The graph as the lowering wrote it before pairs shared initializers: each DequantizeLinear
    of a pair reads its own copies of the scale and zero point."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    for n in g.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in producer and producer[n.input[0]].op_type == "QuantizeLinear":
            for i in (1, 2):
                copy = onnx.TensorProto()
                copy.CopyFrom(inits[n.input[i]])
                copy.name = f"{n.name}/copy_{i}"
                g.initializer.append(copy)
                n.input[i] = copy.name
    return model


def _run_both(session_of, exports, which, seeds=(0, 1)):
    for kind in KINDS:
        manifest = read_manifest(exports[which])
        model = _graph(exports[which], kind)
        shared, separate = session_of(model), session_of(_unshared(model))
        for seed in seeds:
            feeds = _feeds(shared, manifest, kind, seed)
            want, got = separate.run(None, feeds), shared.run(None, feeds)
            assert len(want) == len(got) == len(manifest.graphs[kind].outputs)
            for a, b in zip(want, got):
                assert a.dtype == b.dtype and np.array_equal(a, b), kind


@pytest.mark.parametrize("which", ["lpbq", "16a8w"])
def test_shared_initializers_run_bit_for_bit_on_the_cpu(exports, which):
    _run_both(cpu_session, exports, which)


@pytest.mark.skipif(qnn_available() is not None, reason=str(qnn_available()))
def test_shared_initializers_run_bit_for_bit_on_the_htp_emulator(exports, tmp_path):
    def session(model):
        path = tmp_path / f"g{len(list(tmp_path.iterdir()))}.onnx"
        onnx.save(model, str(path))
        return htp_session(path, 73)

    _run_both(session, exports, "lpbq", seeds=(0,))


def test_lpbq_multipliers_are_listed_by_output_channel_then_block(exports):
    """k of a MatMul weight (I, O) is laid (I/B, O) in the graph; the file lists k[b, o] at
    o * (I/B) + b, and multiplier · base there is the graph's block scale exactly."""
    out = exports["lpbq"]
    checked = 0
    for kind in KINDS:
        g = _graph(out, kind).graph
        inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
        producer = {o: n for n in g.node for o in n.output}
        doc = json.loads((out / f"{kind}.encodings.json").read_text())
        for e in (e for e in doc["param_encodings"] if e["enc_type"] == "LPBQ"):
            scales = producer[producer[e["name"]].input[1]]
            k, base = inits[scales.input[0]].astype(np.int64), inits[scales.input[1]].astype(np.float64)
            blocks, channels = k.shape
            assert len(e["scale"]) == channels and len(e["per_block_int_scale"]) == blocks * channels
            flat = np.asarray(e["per_block_int_scale"])
            for o in range(channels):
                for b in range(blocks):
                    assert flat[o * blocks + b] * e["scale"][o] == k[b, o] * base[o], (e["name"], o, b)
            checked += 1
    assert checked == 2 * 15  # per graph: 2 layers × 7 projections + the LM head


@pytest.mark.parametrize("which", ["lpbq", "16a8w"])
def test_each_graph_has_its_encodings_file(exports, which):
    out = exports[which]
    manifest = read_manifest(out)
    complete = json.loads((out / "encodings.json").read_text())
    every = {e["name"]: e for e in complete["activation_encodings"] + complete["param_encodings"]}
    for kind in KINDS:
        doc = json.loads((out / f"{kind}.encodings.json").read_text())
        record = manifest.encodings.graphs[kind]
        assert record.file == f"{kind}.encodings.json" and record.params == len(doc["param_encodings"])
        view = aimet_import_graph(_graph(out, kind))
        tensors = {t for n in view.graph.node for t in list(n.input) + list(n.output)} | \
            {i.name for i in view.graph.input} | {o.name for o in view.graph.output}
        names = [e["name"] for e in doc["activation_encodings"] + doc["param_encodings"]]
        assert set(names) <= tensors and len(set(names)) == len(names)
        for e in doc["activation_encodings"] + doc["param_encodings"]:  # the same numbers as the complete file
            source = every.get(e["name"])
            if source is not None:
                assert source == e, e["name"]
        acts = {e["name"] for e in doc["activation_encodings"]}
        # The KV I/O and the logits (named by the graph output, as AIMET names a pair writing one)
        assert {"k_cache_0", "v_cache_1", "k_new_0", "v_new_1", "mask", "logits"} <= acts
        assert "logits" not in every  # encodings.json names the tensor the logits' pair quantizes
        params = doc["param_encodings"]
        # Weights only: 2 layers × 7 projections + the LM head, and Qwen2's q/k/v biases (fused
        # into AIMET's MatMul op); norm gammas and Mul scalars are no parameters for AIMET.
        assert len(params) == 15 + (6 if which == "lpbq" else 0)
        assert len([e for e in params if e["enc_type"] == ("LPBQ" if which == "lpbq" else "PER_CHANNEL")]) == 15
        assert len(complete["param_encodings"]) > len(params)


@pytest.mark.parametrize("which", ["lpbq", "16a8w"])
def test_import_graph_computes_what_the_graph_computes(exports, which):
    """Fed the dequantized values of the codes, the import graph's float outputs are the
    dequantized codes the export's graph writes, bit for bit (ONNX Runtime on the CPU)."""
    out = exports[which]
    manifest = read_manifest(out)
    for kind in KINDS:
        model = _graph(out, kind)
        view = aimet_import_graph(model)
        graph, imported = cpu_session(model), cpu_session(view)
        feeds = _feeds(graph, manifest, kind, 0)
        floats = {}
        for spec in manifest.graphs[kind].inputs:
            x = feeds[spec.name]
            if spec.encoding is not None:
                x = ((x.astype(np.int64) - spec.encoding.zero_point) * np.float32(spec.encoding.scale)).astype(np.float32)
            floats[spec.name] = x
        want, got = graph.run(None, feeds), imported.run(None, floats)
        for spec, a, b in zip(manifest.graphs[kind].outputs, want, got):
            if spec.encoding is not None:
                a = ((a.astype(np.int64) - spec.encoding.zero_point) * np.float32(spec.encoding.scale)).astype(np.float32)
            assert b.dtype == np.float32 and np.array_equal(a, b), (kind, spec.name)
        assert [i.type.tensor_type.elem_type for i in view.graph.input if i.name.startswith("k_cache")] == \
            [TensorProto.FLOAT] * manifest.cfg.num_layers


def test_loadable_encodings_need_no_export(exports):
    """The per-graph file is a function of the graph alone: read back from decode.onnx it is
    the file the export wrote."""
    out = exports["lpbq"]
    doc = loadable_encodings(_graph(out, "decode"))
    assert doc == json.loads((out / "decode.encodings.json").read_text())


# --------------------------------------------------------------------------- AIMET itself
def _aimet_python():
    if importlib.util.find_spec("aimet_onnx") is not None:
        return sys.executable
    for candidate in (os.environ.get("NPUQ_AIMET_PYTHON"), str(REPO / "out" / "aimet-venv" / "bin" / "python")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


AIMET = _aimet_python()
needs_aimet = pytest.mark.skipif(AIMET is None, reason="aimet-onnx is not importable here and no AIMET venv was found "
                                 "(`python bench/aimet.py --setup-only` makes out/aimet-venv; or set NPUQ_AIMET_PYTHON)")


def _aimet_folder(out, folder, transpose_lpbq=False):
    folder.mkdir()
    for kind in KINDS:
        model = _graph(out, kind)
        shutil.copy(out / f"{kind}.onnx", folder / f"{kind}.onnx")
        onnx.save(aimet_import_graph(model), str(folder / f"{kind}.aimet.onnx"))
        doc = json.loads((out / f"{kind}.encodings.json").read_text())
        if transpose_lpbq:  # the order npuq wrote before: the graph's (blocks, O) layout
            for e in doc["param_encodings"]:
                if e["enc_type"] == "LPBQ":
                    o = len(e["scale"])
                    e["per_block_int_scale"] = np.asarray(e["per_block_int_scale"]).reshape(o, -1).T.ravel().tolist()
        (folder / f"{kind}.encodings.json").write_text(json.dumps(doc))
    return folder


def _check(folder):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([AIMET, str(CHECK), str(folder), "--json", str(folder / "aimet.json")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((folder / "aimet.json").read_text())["graphs"]


@needs_aimet
def test_aimet_imports_both_graphs_and_loads_each_file(exports, tmp_path):
    graphs = _check(_aimet_folder(exports["lpbq"], tmp_path / "lpbq"))
    assert set(graphs) == set(KINDS)
    for kind, r in graphs.items():
        assert r["imported"] and r["loaded"], (kind, r)
        assert r["lpbq"]["entries"] == r["lpbq"]["equal_to_graph"] == 15 and not r["lpbq"]["wrong"]
        assert r["written_back_equal"] == r["activations"] + r["params"] and not r["written_back_differ"]
        assert r["agree_with_graph"] == r["from_graph"] > 50 and not r["disagree_with_graph"] and not r["graph_only"]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A tiny Llama (with its tokenizer) quantized 16a8w with an 8-bit KV cache, exported with
    --genai windowed: heads-first KV edges (DequantizeLinear → Reshape → QuantizeLinear) added
    after the lowering."""
    import torch

    from npuq.cli import main
    from npuq.testing.tiny import save_tiny_hf_folder

    root = tmp_path_factory.mktemp("windowed")
    model = save_tiny_hf_folder(root / "model", "llama", seed=0, words=200)
    text = root / "text.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (400,), generator=torch.Generator().manual_seed(0))))
    (root / "kv8.json").write_text(json.dumps({"default": "16a8w", "kv_bits": 8}))
    assert main(["quantize", "--model", str(model), "--calib-corpus", f"file:{text}", "--calib-tokens", "64", "--context",
                 "16", "--prefill-len", "4", "--num-threads", "1", "--out", str(root / "kv8"), "--recipe",
                 str(root / "kv8.json")]) == 0
    export_artifact(root / "kv8", root / "out", ExportOptions(qnn_version="2.51", htp_arch=73, genai="windowed"))
    return root / "out"


def test_windowed_graphs_share_their_edge_pairs(windowed):
    test_qdq_pairs_share_their_initializers({"windowed": windowed}, "windowed")
    for kind in KINDS:  # the per-graph file names the tensors of the heads-first graph
        doc = json.loads((windowed / f"{kind}.encodings.json").read_text())
        assert doc == loadable_encodings(_graph(windowed, kind))
        assert {"k_cache_0/reshaped", "v_cache_1/reshaped", "k_new_1"} <= {e["name"] for e in doc["activation_encodings"]}


@needs_aimet
def test_aimet_imports_windowed_graphs(windowed, tmp_path):
    for kind, r in _check(_aimet_folder(windowed, tmp_path / "windowed")).items():
        assert r["imported"] and r["loaded"] and not r["written_back_differ"], (kind, r)
        assert r["agree_with_graph"] == r["from_graph"] > 50 and not r["disagree_with_graph"] and not r["graph_only"]


@needs_aimet
def test_aimet_finds_multipliers_in_the_old_order_wrong(exports, tmp_path):
    """The check can fail: the (blocks, O) order npuq wrote before puts multipliers on the wrong
    blocks in AIMET's reading of every LPBQ entry."""
    graphs = _check(_aimet_folder(exports["lpbq"], tmp_path / "old", transpose_lpbq=True))
    for kind, r in graphs.items():
        assert r["lpbq"]["equal_to_graph"] == 0 and len(r["lpbq"]["wrong"]) == 15, kind
        assert len(r["disagree_with_graph"]) == 15, kind
