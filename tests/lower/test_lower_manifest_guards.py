"""Reading an export folder back: manifest.json is checked before ONNX Runtime opens anything,
and a graph file named outside the folder is refused."""

import json
import shutil
from pathlib import Path

import pytest

from npuq.cli import main
from npuq.errors import NpuqError
from npuq.lower.manifest import read_manifest
from npuq.lower.ort import load_export


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "onnx"))


def _edit(folder: Path, change) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_npuqs_own_manifest_reads_back(tiny_folders):
    manifest = read_manifest(tiny_folders.onnx)
    assert {e.ar_len for e in manifest.graphs.values()} == {1, 4}
    _, graphs = load_export(tiny_folders.onnx)
    assert sorted(graphs) == [1, 4]


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "external_data"])
def test_graph_outside_the_folder_is_refused(tiny_folders, tmp_path, capsys, kind):
    out = _copy(tiny_folders.onnx, tmp_path)
    outside = tmp_path / "elsewhere.onnx"
    shutil.copy(out / "decode.onnx", outside)  # a real graph: only its location is wrong
    if kind == "dotdot":
        _edit(out, lambda m: m["graphs"]["decode"].update(file="../elsewhere.onnx"))
    elif kind == "absolute":
        _edit(out, lambda m: m["graphs"]["decode"].update(file=str(outside)))
    elif kind == "external_data":
        _edit(out, lambda m: m["graphs"]["decode"].update(external_data="../../weights.data"))
    else:
        (out / "decode.onnx").unlink()
        (out / "decode.onnx").symlink_to(outside)
    message = "is a link to" if kind == "symlink" else "points outside"
    with pytest.raises(NpuqError, match=message):
        load_export(out)
    capsys.readouterr()
    for command in (["eval", "--onnx", str(out), "--context", "8"],
                    ["generate", "--onnx", str(out), "--prompt", "hello"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_a_damaged_graph_is_one_error(tiny_folders, tmp_path):
    out = _copy(tiny_folders.onnx, tmp_path)
    data = (out / "prefill.onnx").read_bytes()
    (out / "prefill.onnx").write_bytes(data[: len(data) // 3])
    _, graphs = load_export(out)  # a CPU session opens on the graph's first call
    prefill = next(g for g in graphs.values() if g.file == "prefill.onnx")
    with pytest.raises(NpuqError, match="prefill.onnx: ONNX Runtime cannot open it"):
        prefill.session


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(format="npuq-export/0"), "manifest format 'npuq-export/0' is not 'npuq-export/1'"),
    (lambda m: m["graphs"]["decode"].update(ar_len=4), "is not a distinct whole number"),
    (lambda m: m["graphs"]["decode"]["inputs"][0].update(dtype="object"), "dtype 'object' is not one of"),
    (lambda m: m["model_config"].update(num_layers="2"), "num_layers must be a whole number, got '2'"),
    (lambda m: m["target"].update(htp_arch=[73]), "htp_arch"),
])
def test_manifest_fields_are_checked(tiny_folders, tmp_path, change, message):
    out = _copy(tiny_folders.onnx, tmp_path)
    _edit(out, change)
    with pytest.raises(NpuqError, match=message):
        read_manifest(out)
