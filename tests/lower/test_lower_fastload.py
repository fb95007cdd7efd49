"""The export's fast paths write exactly what the plain ones write.

``npuq export`` reads torch.export programs with stand-ins for three slow steps of
``torch.export.load`` (npuq.lower.fastload), lowers an ExportedProgram from its own graph
instead of ``program.module()``, keeps initializers as numpy arrays until the model is assembled
in place, and writes the bytes it serialized once. Each is checked against the plain way:
torch's loader, ``module()``, ``helper.make_model(helper.make_graph(...))`` over
``numpy_helper.from_array`` tensors, and ``onnx.save``; on torch.export archives of converted
tiny decoders, and end to end on artifacts (whatever format their programs are stored in).
"""

import dataclasses
import hashlib
import json
import logging
import zipfile

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from npuq.lower import fastload, onnx_writer
from npuq.lower.export import PHASES, ExportOptions, export_artifact, io_names, is_kv
from npuq.lower.ir import Initializer
from npuq.lower.onnx_writer import IR_VERSION, lower_program, write_tensor
from npuq.quantize.artifact import load_program, program_path, read_artifact

CONTEXT, PREFILL = 16, 4


def _quantize(tmp_path_factory, name, scheme, embedding=None):
    from npuq.models.tiny import tiny_decoder
    from npuq.quantize.artifact import save_artifact
    from npuq.quantize.pt2e import quantize_model
    from npuq.quant.recipe import load_recipe

    _, model = tiny_decoder(name, max_context=CONTEXT)
    recipe = load_recipe(None, scheme)
    if embedding is not None:
        recipe = dataclasses.replace(recipe, embedding=embedding)
    tokens = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    qm = quantize_model(model, recipe, tokens, context=CONTEXT, prefill_len=PREFILL)
    return save_artifact(qm, tmp_path_factory.mktemp("artifact") / name)


@pytest.fixture(scope="module", params=["llama-16a8w", "qwen2-16a4w_block-pcq8"])
def artifact(request, tmp_path_factory):
    """A plain 16a8w Llama, and a Qwen2 with biases, LPBQ weights and a PCQ embedding table."""
    if request.param == "llama-16a8w":
        return _quantize(tmp_path_factory, "llama", "16a8w")
    return _quantize(tmp_path_factory, "qwen2", "16a4w_block", embedding="pcq8")


@pytest.fixture(scope="module", params=[("llama", "decode"), ("qwen2", "prefill")], ids=lambda p: "-".join(p))
def pt2(request, tmp_path_factory):
    """A converted tiny decoder (test quantizer: PCQ embedding table, and biases for Qwen2) as a
    torch.export archive, the way format-1 artifacts stored their programs."""
    from pt2e_tiny import converted_tiny

    name, mode = request.param
    model, calib, cgm = converted_tiny(name, mode=mode)
    path = tmp_path_factory.mktemp("pt2") / f"{name}-{mode}.pt2"
    torch.export.save(torch.export.export(cgm, calib[0]), path)
    return model, path


def _program_json(path):
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if "/models/" in n and n.endswith(".json"))
        return json.loads(archive.read(name))


# --------------------------------------------------------------------------- the schema decoder
def test_decoder_builds_what_torch_builds(pt2):
    from torch._export.serde import schema, serialize

    data = _program_json(pt2[1])
    fast = fastload.dict_to_dataclass(schema.ExportedProgram, data)
    assert fast == serialize._dict_to_dataclass(schema.ExportedProgram, data)
    assert repr(fast) == repr(serialize._dict_to_dataclass(schema.ExportedProgram, data))


def test_decoder_follows_torch_on_edge_cases():
    """Unknown keys ignored, optional fields None, a union's tag and value, empty lists."""
    from torch._export.serde import schema, serialize

    cases = [
        (schema.TensorArgument, {"name": "x", "unknown_key": 1}),
        (schema.Argument, {"as_tensors": []}),
        (schema.Argument, {"as_float": 1}),
        (schema.Argument, {"as_tensor": {"name": "x"}}),
        (schema.Node, {"target": "t", "inputs": [], "outputs": [{"as_none": True}], "metadata": {"a": "b"},
                       "is_hop_single_tensor_return": None}),
    ]
    for cls, data in cases:
        assert fastload.dict_to_dataclass(cls, data) == serialize._dict_to_dataclass(cls, data), (cls, data)
    for cls, data in [(schema.Argument, {"as_int": 1, "as_float": 2.0}), (schema.Argument, [1])]:
        with pytest.raises(AssertionError):
            serialize._dict_to_dataclass(cls, data)
        with pytest.raises(AssertionError):
            fastload.dict_to_dataclass(cls, data)


def _swapped():
    from torch._export.serde import serialize
    from torch.export import exported_program

    return (serialize._dict_to_dataclass, serialize.GraphModuleDeserializer.deserialize_tensor_meta,
            exported_program._create_graph_module_for_export)


def test_faster_loading_is_scoped():
    torch_own = _swapped()
    with fastload.faster_loading() as swapped:
        assert swapped == 3
        assert all(a is not b for a, b in zip(_swapped(), torch_own))
        with fastload.faster_loading():
            pass
        assert all(a is not b for a, b in zip(_swapped(), torch_own))  # still inside the outer block
    assert all(a is b for a, b in zip(_swapped(), torch_own))
    with pytest.raises(RuntimeError), fastload.faster_loading():
        raise RuntimeError
    assert all(a is b for a, b in zip(_swapped(), torch_own))


def _val(v):
    if not isinstance(v, torch.Tensor):
        return repr(v)
    return (type(v).__name__, tuple(v.shape), v.stride(), v.dtype, str(v.device), v.requires_grad,
            v.storage_offset(), getattr(v, "constant", None) is None)


def test_faster_loading_loads_the_same_program(pt2):
    path = pt2[1]
    plain = torch.export.load(path)
    with fastload.faster_loading():
        fast = torch.export.load(path)
    assert fast.graph_module.code == plain.graph_module.code
    assert str(fast.graph_signature) == str(plain.graph_signature)
    assert fast.state_dict.keys() == plain.state_dict.keys()
    assert all(torch.equal(fast.state_dict[k], plain.state_dict[k]) for k in plain.state_dict)
    assert fast.constants.keys() == plain.constants.keys()
    metas = [[(n.name, n.op, str(n.target), _val(n.meta.get("val"))) for n in ep.graph.nodes] for ep in (fast, plain)]
    assert metas[0] == metas[1]
    modes = {id(n.meta["val"].fake_mode) for n in fast.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert len(modes) == 1  # one fake mode for the program, as torch's loader makes it
    inputs = plain.example_inputs[0]
    with torch.no_grad():
        a, b = fast.module()(*inputs), plain.module()(*inputs)  # the lazily generated code runs alike
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------- the writer
def _reference_assemble(name, nodes, inputs, outputs, initializers, opsets):
    """How the writer built its model before it assembled it in place."""
    tensors = [numpy_helper.from_array(i.array, i.name) if isinstance(i, Initializer) else i for i in initializers]
    graph = helper.make_graph(nodes, name, inputs, outputs, tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                              producer_name="npuq")
    model.ir_version = IR_VERSION
    return model


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.array(0.5, np.float32), np.arange(-3, 3, dtype=np.int8),
    np.arange(6, dtype=np.uint16).reshape(2, 3).T, np.array([1, -2], np.int64), np.array([7], np.int32),
    np.array([True, False]), np.arange(-7, 8, dtype=np.int8).astype(ml_dtypes.int4), np.zeros((0, 3), np.uint8),
    np.arange(4, dtype=np.float16),
], ids=lambda a: f"{a.dtype}{list(a.shape)}")
def test_write_tensor_is_from_array(array):
    t = TensorProto()
    write_tensor(t, array, "w")
    assert t.SerializeToString() == numpy_helper.from_array(array, "w").SerializeToString()


def _reference_lowering(program, args, kw, monkeypatch):
    """The plain way: ``module()`` of an ExportedProgram, and the model made by make_model."""
    if isinstance(program, torch.export.ExportedProgram):
        program = program.module()
    with monkeypatch.context() as m:
        m.setattr(onnx_writer, "_assemble", _reference_assemble)
        return lower_program(program, *args, **kw)


def _lowering_args(num_layers, graph_name):
    options = ExportOptions(qnn_version="2.51", htp_arch=73)
    ins, outs = io_names(num_layers)
    return (options.target(), options.lower_options(), ins, outs, is_kv), dict(graph_name=graph_name, log_warnings=False)


def _nodes(model):
    return [(n.op_type, n.name, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
            for n in model.graph.node]


def _initializers(model):
    return {i.name: (i.data_type, numpy_helper.to_array(i)) for i in model.graph.initializer}


def test_program_graph_lowers_like_module(pt2, monkeypatch):
    """An ExportedProgram lowered from its own graph (get_attr nodes put back, no code
    generated) with the model assembled in place gives the model ``module()`` and make_model
    give, byte for byte."""
    model, path = pt2
    args, kw = _lowering_args(model.config.num_layers, "tiny")
    with fastload.faster_loading():
        fast = lower_program(torch.export.load(path), *args, **kw)
    plain = _reference_lowering(torch.export.load(path), args, kw, monkeypatch)
    assert _nodes(fast.model) == _nodes(plain.model)
    a, b = _initializers(fast.model), _initializers(plain.model)
    assert list(a) == list(b)
    assert all(a[k][0] == b[k][0] and a[k][1].dtype == b[k][1].dtype and np.array_equal(a[k][1], b[k][1]) for k in a)
    assert fast.model.SerializeToString() == plain.model.SerializeToString()
    assert [s.to_json() for s in fast.inputs + fast.outputs] == [s.to_json() for s in plain.inputs + plain.outputs]
    assert fast.builders == plain.builders
    assert [(n.kind, n.node, n.detail) for n in fast.notes] == [(n.kind, n.node, n.detail) for n in plain.notes]
    assert any(n.kind == "embedding_pattern" for n in fast.notes)  # the PCQ table went through its builder


def test_exported_files_are_the_plain_lowering(artifact, tmp_path, monkeypatch, caplog):
    """The files of ``npuq export`` are the bytes onnx.save writes for the plain lowering of the
    artifact's programs, the manifest's sha256 are theirs, and the export logs its time per phase."""
    out = tmp_path / "out"
    with caplog.at_level(logging.DEBUG, logger="npuq.lower.export"):
        export_artifact(artifact, out, ExportOptions(qnn_version="2.51", htp_arch=73))
    manifest = json.loads((out / "manifest.json").read_text())
    config = read_artifact(artifact)
    from npuq.models.config import ModelConfig

    cfg = ModelConfig.from_dict(config.model_config)
    for kind in ("decode", "prefill"):
        args, kw = _lowering_args(cfg.num_layers, f"{cfg.arch}_{kind}")
        plain = _reference_lowering(load_program(program_path(artifact, config, kind)), args, kw, monkeypatch)
        onnx.save(plain.model, tmp_path / f"plain-{kind}.onnx")
        written = (out / f"{kind}.onnx").read_bytes()
        assert written == (tmp_path / f"plain-{kind}.onnx").read_bytes()
        assert manifest["graphs"][kind]["sha256"] == hashlib.sha256(written).hexdigest()
        assert manifest["graphs"][kind]["inputs"] == [s.to_json() for s in plain.inputs]
    phases = [r.npuq_export_phases for r in caplog.records if hasattr(r, "npuq_export_phases")]
    assert len(phases) == 1 and tuple(phases[0]) == PHASES and all(v >= 0 for v in phases[0].values())
