"""Guards around the artifact: calibration memory (a smaller batch, same encodings), free disk
before writing, file names that must stay inside the folder, program files that are not what npuq
writes (unknown ops, forward references, odd values), artifacts of the previous format."""

import json
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from npuq.cli import main
from npuq.errors import NpuqError
from npuq.lower.export import ExportOptions, export_artifact
from npuq.quantize import pt2e as pipeline
from npuq.quantize.artifact import (
    estimate_artifact_bytes,
    load_artifact,
    load_program,
    read_artifact,
    save_artifact,
)
from npuq.quant.recipe import load_recipe
from npuq.resources import USABLE_FRACTION, onepass_window_bytes

Usage = namedtuple("Usage", "total used free")


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


# --------------------------------------------------------------------------- memory
def test_memory_estimate_forces_a_smaller_batch_with_the_same_encodings(tiny_folders, monkeypatch):
    model, tokens = tiny_folders.model, tiny_folders.tokens
    per_window = onepass_window_bytes(model.config, 16)
    monkeypatch.setattr(pipeline, "available_memory", lambda device=None: int(1.5 * per_window / USABLE_FRACTION))
    batches = []
    real = pipeline.calibrate_onepass

    def recording(graph, cfg, windows, batch_size, progress=None, **part):
        batches.append(batch_size)
        return real(graph, cfg, windows, batch_size, progress, **part)

    monkeypatch.setattr(pipeline, "calibrate_onepass", recording)
    with pytest.warns(UserWarning, match=r"--batch-size 8 would need .* calibrating 1 window\(s\) per forward"):
        qm = pipeline.quantize_model(model, load_recipe(None, "16a8w"), tokens, context=16, prefill_len=4, batch_size=8)
    assert batches == [1] and qm.stats["batch_size"] == 1
    # min/max encodings do not depend on how the windows were batched (the session's artifact used batch 8)
    reference = tiny_folders.quantized.encodings
    for section in ("activation_encodings", "param_encodings"):
        got = {e["name"]: e for e in qm.encodings[section]}
        assert set(got) == {e["name"] for e in reference[section]}
        for e in reference[section]:
            assert got[e["name"]]["scale"] == pytest.approx(e["scale"], rel=1e-5), e["name"]
            assert max(abs(a - b) for a, b in zip(got[e["name"]]["offset"], e["offset"], strict=True)) <= 1


# --------------------------------------------------------------------------- disk
def _free(monkeypatch, free):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 40, 0, free))


def test_artifact_estimate_covers_what_is_written(tiny_folders):
    written = _size(tiny_folders.artifact)
    assert written <= estimate_artifact_bytes(tiny_folders.quantized) <= 3 * written


def test_full_disk_refuses_the_artifact_before_writing(tiny_folders, tmp_path, monkeypatch):
    old = tmp_path / "art"
    old.mkdir()
    (old / "previous.txt").write_text("keep me")
    _free(monkeypatch, 1 << 20)
    for target, force in ((tmp_path / "new", False), (old, True)):
        with pytest.raises(NpuqError, match=r"the artifact .* needs about [\d.]+ MiB but only 1\.0 MiB is free"):
            save_artifact(tiny_folders.quantized, target, force=force)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # nothing written, no temporary folder
    assert [p.name for p in old.iterdir()] == ["previous.txt"]


def test_full_disk_refuses_the_export_with_the_size_it_needs(tiny_folders, tmp_path, monkeypatch):
    _free(monkeypatch, 1 << 20)
    with pytest.raises(NpuqError, match=r"the export .* needs about") as exc:
        export_artifact(tiny_folders.artifact, tmp_path / "onnx", ExportOptions(qnn_version="2.51", htp_arch=73))
    needed = float(re.search(r"needs about ([\d.]+) MiB", str(exc.value)).group(1)) * (1 << 20)
    assert needed >= _size(tiny_folders.onnx)  # the real export of the same artifact
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- names in config.json
def _set_program_file(folder: Path, name: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["programs"]["decode"]["file"] = name
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "weights"])
def test_program_outside_the_artifact_is_refused(tiny_folders, tmp_path, capsys, kind):
    art = _copy(tiny_folders.artifact, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.copy(art / "decode.json", outside)  # a real program: only the location is wrong
    if kind == "dotdot":
        _set_program_file(art, "../elsewhere.json")
    elif kind == "absolute":
        _set_program_file(art, str(outside))
    elif kind == "symlink":
        (art / "decode.json").unlink()
        (art / "decode.json").symlink_to(outside)
    else:
        config = json.loads((art / "config.json").read_text())
        config["weights"] = "../weights.safetensors"
        (art / "config.json").write_text(json.dumps(config))
    message = "is a link to" if kind == "symlink" else "points outside"
    with pytest.raises(NpuqError, match=message):
        read_artifact(art)
    with pytest.raises(NpuqError, match=message):
        export_artifact(art, tmp_path / "onnx", ExportOptions(qnn_version="2.51"))
    capsys.readouterr()
    assert main(["eval", "--artifact", str(art), "--context", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_program_naming_a_weights_file_outside_is_refused(tiny_folders, tmp_path):
    art = _copy(tiny_folders.artifact, tmp_path)
    program = json.loads((art / "decode.json").read_text())
    program["weights"] = "../weights.safetensors"
    (art / "decode.json").write_text(json.dumps(program))
    with pytest.raises(NpuqError, match="points outside"):
        load_program(art / "decode.json")


def test_damaged_encodings_are_refused_before_the_programs_load(tiny_folders, tmp_path, monkeypatch):
    art = _copy(tiny_folders.artifact, tmp_path)
    enc = json.loads((art / "encodings.json").read_text())
    enc["activation_encodings"][3]["scale"][0] = -1.0
    (art / "encodings.json").write_text(json.dumps(enc))
    import npuq.quantize.artifact as artifact_mod

    monkeypatch.setattr(artifact_mod, "load_program", lambda *a, **k: pytest.fail("loaded a program first"))
    monkeypatch.setattr(artifact_mod, "read_weights", lambda *a, **k: pytest.fail("read the weights first"))
    name = enc["activation_encodings"][3]["name"]
    with pytest.raises(NpuqError, match=rf"activation_encodings\[3\] \({re.escape(name)}\): every scale must be"):
        load_artifact(art)


# --------------------------------------------------------------------------- program files
def _edit_program(tiny_folders, tmp_path, change) -> Path:
    art = _copy(tiny_folders.artifact, tmp_path)
    program = json.loads((art / "decode.json").read_text())
    change(program)
    (art / "decode.json").write_text(json.dumps(program))
    return art


def _first(program, op="call_function"):
    return next(n for n in program["nodes"] if n["op"] == op)


def _set(node, **fields):
    node.update(fields)


@pytest.mark.parametrize("change,message", [
    (lambda p: _set(_first(p), target="builtins::eval.default"), "is not an op of aten"),
    (lambda p: _set(_first(p), target="aten::__class__.default"), "is not an op of aten"),
    (lambda p: _set(_first(p), target="aten::no_such_op.default"), "unknown op"),
    (lambda p: _set(_first(p), target="os.system"), "is not an op of aten"),
    (lambda p: _set(_first(p), args=[{"node": "output"}]), "is not one npuq writes"),  # a later node
    (lambda p: _set(_first(p), args=[{"eval": "1"}]), "is not one npuq writes"),
    (lambda p: _set(_first(p), name="x; import os"), "is not a new identifier"),
    (lambda p: _set(_first(p, "get_attr"), target="__class__.__init__"), "is not in 'tensors'"),
    (lambda p: p["tensors"].update({"a.b": {"key": "missing", "dtype": "int8"}}), "does not hold"),
    (lambda p: _set(_first(p, "placeholder"), val=[[1, -1], "int64"]), "is not \\[shape, dtype\\]"),
    (lambda p: _set(_first(p), op="call_module"), "op kind 'call_module'"),
    (lambda p: p.update(format="npuq-graph/0"), "is not 'npuq-graph/1'"),
    (lambda p: p["nodes"].pop(), "has no output"),
])
def test_program_files_npuq_did_not_write_are_refused(tiny_folders, tmp_path, change, message):
    art = _edit_program(tiny_folders, tmp_path, change)
    with pytest.raises(NpuqError, match=message):
        load_program(art / "decode.json")
    with pytest.raises(NpuqError, match=message):
        load_artifact(art)


def test_a_damaged_weights_file_is_refused(tiny_folders, tmp_path):
    art = _copy(tiny_folders.artifact, tmp_path)
    data = (art / "weights.safetensors").read_bytes()
    (art / "weights.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(NpuqError, match="not a readable weights file"):
        load_artifact(art)
    (art / "weights.safetensors").write_bytes(b"\x80\x04K\x01.")  # a pickle is not safetensors either
    with pytest.raises(NpuqError, match="not a readable weights file"):
        load_program(art / "decode.json")


def test_npuqs_own_programs_load_as_static_graph_modules(tiny_folders):
    program = load_program(tiny_folders.artifact / "decode.json")
    assert isinstance(program, torch.fx.GraphModule)
    assert [tuple(n.meta["val"].shape) for n in program.graph.nodes if n.op == "placeholder"][:2] == [(1, 1), (1, 1, 1, 16)]


def test_an_artifact_of_the_previous_format_asks_to_quantize_again(tiny_folders, tmp_path, capsys):
    art = _copy(tiny_folders.artifact, tmp_path)
    config = json.loads((art / "config.json").read_text())
    config["format"] = "npuq-quantized/1"
    config["programs"] = {"decode": {"file": "decode.pt2", "ar_len": 1}, "prefill": {"file": "prefill.pt2", "ar_len": 4}}
    (art / "config.json").write_text(json.dumps(config))
    with pytest.raises(NpuqError, match=r"format 'npuq-quantized/1' .* is not 'npuq-quantized/2' or 'npuq-quantized/3', .*quantize the "
                                        r"model again with this npuq"):
        read_artifact(art)
    assert main(["eval", "--artifact", str(art), "--context", "8"]) == 2
    assert "quantize the model again" in capsys.readouterr().err
