"""The deployable outputs of ``npuq export`` (docs/design.md §11): encodings.json in AIMET's format
1.0.0, checked against the ONNX files read with the ``onnx`` package, and QNN HTP context
binaries (``--compile``), checked bit for bit against the QDQ graphs on the HTP emulator."""

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from npuq.cli import main
from npuq.errors import NpuqError
from npuq.lower.aimet import merge_encodings
from npuq.lower.export import ExportOptions, export_artifact
from npuq.lower.manifest import read_manifest
from npuq.lower.ort import context_use, htp_session, load_export, qnn_available
from npuq.models.decoder import MASK_VALUE
from test_lower_export import _quantize

needs_qnn = pytest.mark.skipif(qnn_available() is not None, reason=str(qnn_available()))

# AIMET encoding format 1.0.0, written out from its specification: the top-level keys, and per
# entry each key's JSON type and the keys every enc_type must carry.
TOP_KEYS = {"version": str, "activation_encodings": list, "param_encodings": list, "quantizer_args": dict,
            "excluded_layers": list}
ENTRY_KEYS = {"name": str, "dtype": str, "enc_type": str, "bw": int, "is_sym": bool, "scale": list, "offset": list,
              "block_size": int, "compressed_bw": int, "per_block_int_scale": list, "zero_point_shift": list}
COMMON = {"name", "dtype", "enc_type", "bw", "is_sym", "scale", "offset"}
REQUIRED = {"PER_TENSOR": COMMON, "PER_CHANNEL": COMMON, "PER_BLOCK": COMMON | {"block_size"},
            "LPBQ": COMMON | {"block_size", "compressed_bw", "per_block_int_scale"}}
# The lowest code of each ONNX integer type: offsets are stored in the unsigned domain of bw bits.
LOWEST = {TensorProto.INT4: -8, TensorProto.INT8: -128, TensorProto.INT16: -32768, TensorProto.INT32: -(2**31),
          TensorProto.UINT4: 0, TensorProto.UINT8: 0, TensorProto.UINT16: 0}
BITS = {TensorProto.INT4: 4, TensorProto.UINT4: 4, TensorProto.INT8: 8, TensorProto.UINT8: 8, TensorProto.INT16: 16,
        TensorProto.UINT16: 16, TensorProto.INT32: 32}


def _check_schema(doc):
    assert set(doc) <= set(TOP_KEYS) and doc["version"] == "1.0.0"
    for key, kind in TOP_KEYS.items():
        assert key not in doc or isinstance(doc[key], kind)
    for entry in doc["activation_encodings"] + doc["param_encodings"]:
        assert set(entry) <= set(ENTRY_KEYS), set(entry) - set(ENTRY_KEYS)
        for key, value in entry.items():
            assert isinstance(value, ENTRY_KEYS[key]) and (key == "is_sym" or not isinstance(value, bool)), (key, value)
        assert entry["dtype"] in ("INT", "FLOAT") and entry["enc_type"] in REQUIRED
        assert REQUIRED[entry["enc_type"]] <= set(entry), entry["name"]
        assert 2 <= entry["bw"] <= 32
        assert all(isinstance(s, float) and s > 0 for s in entry["scale"])
        assert all(isinstance(o, int) for o in entry["offset"]) and len(entry["offset"]) == len(entry["scale"])
        if entry["enc_type"] == "PER_TENSOR":
            assert len(entry["scale"]) == 1


class _Onnx:
    """One ONNX file as the reference sees it: tensor names, and the Q/DQ nodes at each tensor."""

    def __init__(self, path):
        g = onnx.load(str(path)).graph
        self.inits = {i.name: i for i in g.initializer}
        self.names = set(self.inits) | {i.name for i in g.input} | {o.name for o in g.output} | \
            {t for n in g.node for t in list(n.input) + list(n.output) if t}
        self.producer = {o: n for n in g.node for o in n.output}
        self.qdq = [n for n in g.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]

    def array(self, name):
        return numpy_helper.to_array(self.inits[name])

    def at(self, name, param):
        """The Q/DQ nodes that give ``name`` its encoding: for a parameter the DequantizeLinear of
        a constant writing it; for an activation a QuantizeLinear reading it (the tensor it
        quantizes) or writing it (a quantized graph output), or a DequantizeLinear reading it
        (quantized codes). A requantized tensor (a DequantizeLinear's output read by another
        QuantizeLinear) takes the encoding it is quantized to."""
        if param:
            return [n for n in self.qdq if n.op_type == "DequantizeLinear" and n.output[0] == name
                    and n.input[0] in self.inits]
        return [n for n in self.qdq if (n.op_type == "QuantizeLinear" and name in (n.input[0], n.output[0]))
                or (n.op_type == "DequantizeLinear" and n.input[0] == name)]


def _expected_affine(graph, node):
    scale, zp_proto = graph.array(node.input[1]), graph.inits[node.input[2]]
    zp = numpy_helper.to_array(zp_proto).astype(np.int64)
    return scale.astype(np.float32).ravel(), (LOWEST[zp_proto.data_type] - zp).ravel(), BITS[zp_proto.data_type]


def _check_against_onnx(doc, out):
    graphs = [_Onnx(out / f"{kind}.onnx") for kind in ("decode", "prefill")]
    checked = 0
    for param, entry in [(False, e) for e in doc["activation_encodings"]] + [(True, e) for e in doc["param_encodings"]]:
        name = entry["name"]
        assert any(name in g.names for g in graphs), f"{name} is not a tensor of the ONNX graphs"
        found = False
        for g in graphs:
            if entry["enc_type"] == "LPBQ":
                node = g.producer.get(name)
                if node is None:
                    continue
                scales = g.producer[node.input[1]]  # DequantizeLinear(k, base) → the block scales
                k, base = g.array(scales.input[0]).astype(np.int64), g.array(scales.input[1]).astype(np.float64)
                axis = next(onnx.helper.get_attribute_value(a) for a in scales.attribute if a.name == "axis")
                shape = [1] * k.ndim
                shape[axis] = -1
                want = k * base.reshape(shape)
                # AIMET 1.0.0 lists k by (output channel, block): a MatMul weight's k is laid
                # (blocks, O) in the graph (channel axis 1), so the file holds its transpose.
                flat = np.asarray(entry["per_block_int_scale"])
                laid = flat.reshape(k.shape[::-1]).T if axis == 1 else flat.reshape(k.shape)
                got = laid * np.asarray(entry["scale"]).reshape(shape)
                assert np.array_equal(got, want), name
                assert entry["compressed_bw"] == BITS[g.inits[node.input[0]].data_type]
                assert max(entry["per_block_int_scale"]) <= 2 ** (entry["bw"] - entry["compressed_bw"])
                assert entry["offset"] == [-(2 ** (entry["bw"] - 1))] * len(entry["scale"])
                found = True
                continue
            for node in g.at(name, param):
                scale, offset, bits = _expected_affine(g, node)
                assert np.array_equal(np.float32(entry["scale"]), scale), name
                assert entry["offset"] == offset.tolist() and entry["bw"] == bits, name
                found = True
        assert found, f"{name}: no QuantizeLinear / DequantizeLinear at this tensor"
        checked += 1
    return checked


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return {"16a8w": _quantize(tmp_path_factory, "llama", "16a8w"),
            "lpbq": _quantize(tmp_path_factory, "qwen2", "16a4w_block", embedding="pcq8")}


@pytest.mark.parametrize("which", ["16a8w", "lpbq"])
def test_aimet_encodings_match_the_onnx_files(artifacts, tmp_path, which):
    out = tmp_path / "out"
    result = export_artifact(artifacts[which], out, ExportOptions(qnn_version="2.51", htp_arch=73))
    assert result.files["encodings"] == str(out / "encodings.json")
    doc = json.loads((out / "encodings.json").read_text())
    _check_schema(doc)
    assert _check_against_onnx(doc, out) == len(doc["activation_encodings"]) + len(doc["param_encodings"])
    kinds = {e["enc_type"] for e in doc["param_encodings"]}
    assert ("LPBQ" in kinds) == (which == "lpbq") and "PER_TENSOR" in {e["enc_type"] for e in doc["activation_encodings"]}
    names = {e["name"] for e in doc["activation_encodings"]}
    assert {"k_cache_0", "k_new_0", "v_cache_0", "v_new_0", "mask"} <= names  # the runner's quantized I/O
    manifest = read_manifest(out)
    assert manifest.encodings.file == "encodings.json" and manifest.encodings.format == "aimet-1.0.0"
    assert manifest.encodings.params == len(doc["param_encodings"])


def test_decode_and_prefill_must_agree():
    entry = {"name": "x", "dtype": "INT", "enc_type": "PER_TENSOR", "bw": 16, "is_sym": False, "scale": [0.1],
             "offset": [-3]}
    merge_encodings({"decode": ({"x": entry}, {}), "prefill": ({"x": dict(entry)}, {})})
    with pytest.raises(NpuqError, match="'x' has different encodings in the decode and prefill graphs"):
        merge_encodings({"decode": ({"x": entry}, {}), "prefill": ({"x": {**entry, "offset": [-4]}}, {})})


def test_old_manifest_without_new_fields_reads(artifacts, tmp_path):
    out = tmp_path / "out"
    export_artifact(artifacts["16a8w"], out, ExportOptions(qnn_version="2.51", htp_arch=73))
    data = json.loads((out / "manifest.json").read_text())
    del data["encodings"]
    (out / "manifest.json").write_text(json.dumps(data))
    assert read_manifest(out).encodings is None and read_manifest(out).compiled is None


# --------------------------------------------------------------------------- QNN context binaries
def _feeds(session, manifest, kind, seed=0):
    """Valid inputs: tokens in the vocabulary, positions in the context, a causal-ish mask, and
    cache codes anywhere in their encoding's range."""
    rng = np.random.default_rng(seed)
    entry = manifest.graphs[kind]
    vocab = manifest.cfg.vocab_size
    feeds = {}
    for spec in entry.inputs:
        shape = tuple(spec.shape)
        if spec.name == "tokens":
            feeds[spec.name] = rng.integers(0, vocab, shape).astype(spec.dtype)
        elif spec.name == "positions":
            feeds[spec.name] = (np.arange(np.prod(shape)).reshape(shape) + 3).astype(spec.dtype)
        elif spec.encoding is not None:
            feeds[spec.name] = rng.integers(spec.encoding.qmin, spec.encoding.qmax + 1, shape).astype(spec.dtype)
        else:
            feeds[spec.name] = np.where(rng.random(shape) < 0.3, MASK_VALUE, 0.0).astype(spec.dtype)
    return feeds


@pytest.fixture(scope="module")
def compiled(artifacts, tmp_path_factory):
    if qnn_available():
        pytest.skip(qnn_available())
    out = tmp_path_factory.mktemp("compiled") / "out"
    result = export_artifact(artifacts["lpbq"], out, ExportOptions(qnn_version="2.51", htp_arch=73, compile=True))
    return result, out


@needs_qnn
def test_contexts_are_bit_identical_to_the_qdq_graphs(compiled):
    """Each context's outputs equal the QDQ graph's on the HTP emulator, bit for bit, on inputs
    that exercise every quantized input (the LPBQ artifact: block-quantized weights and a PCQ
    embedding, the hardest graphs the lowering writes)."""
    _, out = compiled
    manifest = read_manifest(out)
    for kind, c in manifest.compiled.graphs.items():
        qdq, ctx = htp_session(out / f"{kind}.onnx", 73), htp_session(out / c.file, 73)
        for seed in range(2):
            feeds = _feeds(qdq, manifest, kind, seed)
            want, got = qdq.run(None, feeds), ctx.run(None, feeds)
            assert len(want) == len(got) == len(manifest.graphs[kind].outputs)
            for a, b in zip(want, got):
                assert a.dtype == b.dtype and np.array_equal(a, b), kind


@needs_qnn
def test_manifest_records_the_contexts(compiled):
    result, out = compiled
    manifest = read_manifest(out)
    c = manifest.compiled
    assert (c.htp_arch, c.soc, c.share_weights, c.verified) == (73, None, False, "emulator")
    assert c.qnn_version == "2.51.0" and "onnxruntime-qnn" in c.compiler
    for kind, entry in c.graphs.items():
        assert entry.file == f"{kind}_ctx.onnx" and entry.binary.endswith(".bin") and entry.seconds > 0
        assert entry.file_bytes == os.path.getsize(out / entry.file)
        assert entry.binary_bytes == os.path.getsize(out / entry.binary)
        assert result.files[f"{kind}_ctx"] == str(out / entry.file)
    assert result.compile_seconds > 0
    assert not [p for p in out.parent.iterdir() if p.name != "out"]  # written atomically: no leftovers


@needs_qnn
def test_htp_provider_runs_the_contexts(compiled):
    _, out = compiled
    _, graphs = load_export(out, "htp")
    assert sorted(g.file for g in graphs.values()) == ["decode_ctx.onnx", "prefill_ctx.onnx"]
    _, graphs = load_export(out, "cpu")
    assert sorted(g.file for g in graphs.values()) == ["decode.onnx", "prefill.onnx"]
    manifest = read_manifest(out)
    assert context_use(manifest, "htp") == (True, "QNN contexts compiled for HTP v73")
    assert context_use(manifest, "htp", 75)[0] is False


@needs_qnn
def test_shared_weights_are_one_binary_for_devices(artifacts, tmp_path):
    out = tmp_path / "out"
    export_artifact(artifacts["16a8w"], out, ExportOptions(qnn_version="2.51", soc="SM8650", compile=True,
                                                           share_weights=True))
    manifest = read_manifest(out)
    c = manifest.compiled
    assert c.share_weights and c.verified == "device only" and c.soc == "SM8650" and c.htp_arch == 75
    assert len({e.binary for e in c.graphs.values()}) == 1
    used, why = context_use(manifest, "htp")
    assert not used and "device only" in why
    _, graphs = load_export(out, "htp")  # the emulator cannot load them: the QDQ graphs run
    assert sorted(g.file for g in graphs.values()) == ["decode.onnx", "prefill.onnx"]


def test_compile_needs_an_arch(artifacts, tmp_path, capsys):
    with pytest.raises(NpuqError, match="--compile needs the target chip.*--soc NAME.*--htp-arch"):
        ExportOptions(compile=True)
    with pytest.raises(NpuqError, match="--share-weights applies to compiled contexts: add --compile"):
        ExportOptions(htp_arch=73, share_weights=True)
    code = main(["export", "--artifact", str(artifacts["16a8w"]), "--out", str(tmp_path / "o"), "--qnn-version", "2.51",
                 "--compile"])
    assert code == 2 and "--compile needs the target chip" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_options_without_compile_keep_their_key():
    """An export without --compile hashes as before the flag existed (run folders keep their cache)."""
    from npuq.records import to_json

    assert "compile" not in to_json(ExportOptions(htp_arch=73, compile=False))
    assert to_json(ExportOptions(htp_arch=73, compile=True))["compile"] is True
