"""One direct test per escape the fuzzers (tests/fuzz, bench/faults.py) found: each input once
raised something other than NpuqError."""

import json
import shutil

import pytest

from npuq.calibrate.encodings import read_encodings
from npuq.data.corpora import load_corpus
from npuq.errors import ModelLoadError, NpuqError
from npuq.lower.manifest import read_manifest
from npuq.models import load_model
from npuq.models.config import ModelConfig
from npuq.testing.tiny import tiny_decoder, tiny_hf_model
from npuq.quantize.artifact import load_artifact, read_artifact
from npuq.quant.recipe import load_recipe


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    tiny_hf_model("llama").save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("config, message", [
    ([1, 2], "holds list, not a JSON object"),  # was AttributeError: 'list' object has no attribute 'get'
    ({"model_type": {"llama": 1}}, "model type .* is not supported"),  # was TypeError: unhashable type: 'dict'
])
def test_hf_config_that_is_no_config(hf_folder, tmp_path, config, message):
    folder = tmp_path / "m"
    shutil.copytree(hf_folder, folder)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(folder))


@pytest.mark.parametrize("content, message", [
    (b'{"default": "16a8w", "name": "caf\xe9"}', "cannot be read as UTF-8"),  # was UnicodeDecodeError
    (b'{"default": {"scheme": "16a8w"}}', "unknown scheme"),  # was TypeError: unhashable type: 'dict'
    (b'{"default": "16a8w", "rules": [{"path": 5, "scheme": "16a4w"}]}', "path must be a regular expression"),
    (b'{"default": "16a8w", "rules": 3}', "'rules' must be a list"),  # was TypeError: 'int' object is not iterable
])
def test_recipe_files(tmp_path, content, message):
    path = tmp_path / "r.json"
    path.write_bytes(content)
    with pytest.raises(NpuqError, match=message):
        load_recipe(str(path))


@pytest.mark.parametrize("line, message", [
    (b'{"text": ' + b"1" * 5000 + b"}", "ValueError"),  # more digits than int() converts
    (b"[" * 50_000, "RecursionError"),
])
def test_jsonl_lines_json_cannot_parse(tmp_path, line, message):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + line + b"\n")
    with pytest.raises(NpuqError, match=f"line 2: unreadable JSON \\({message}"):
        load_corpus(f"file:{path}")


def _copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


def _edit(path, change):
    data = json.loads(path.read_text())
    data = change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change, message", [
    (lambda c: {**c, "programs": ["decode.pt2"]}, "programs: expected an object, got list"),  # was AttributeError
    (lambda c: {**c, "programs": {"decode": "decode.pt2", "prefill": "prefill.pt2"}},
     r"programs\['decode'\]: expected an object, got str"),
    (lambda c: {**c, "programs": {"prefill": c["programs"]["prefill"]}}, "the decode program is missing"),
    (lambda c: {**c, "versions": 3, "format": "x"}, "format 'x' written by npuq an unknown version"),
    (lambda c: {**c, "context": "16"}, "context: expected int, got '16'"),  # was ValueError/TypeError later
    (lambda c: {**c, "model_config": {**c["model_config"], "rope": 5}}, "model_config rope must be an object, got 5"),
    (lambda c: {**c, "recipe": {**c["recipe"], "rules": [{"op": "linear", "path": [1], "scheme": "16a8w"}]}},
     "path must be a regular expression"),
])
def test_artifact_config_fields(tiny_folders, tmp_path, change, message):
    art = _copy(tiny_folders.artifact, tmp_path)
    _edit(art / "config.json", change)
    with pytest.raises(NpuqError, match=message):
        read_artifact(art)


def test_encodings_json_that_is_not_json(tiny_folders, tmp_path):
    art = _copy(tiny_folders.artifact, tmp_path)
    (art / "encodings.json").write_text('{"version": "1.0.0", "activation_encodings": [')  # was JSONDecodeError
    with pytest.raises(NpuqError, match="encodings.json is not valid JSON"):
        load_artifact(art)
    (art / "encodings.json").write_text('{"version": "1.0.0", "activation_encodings": [7], "param_encodings": []}')
    with pytest.raises(NpuqError, match=r"activation_encodings\[0\] is not an object"):
        read_encodings(art / "encodings.json")


def test_manifest_that_is_not_json(tiny_folders, tmp_path):
    out = _copy(tiny_folders.onnx, tmp_path)
    (out / "manifest.json").write_bytes(b'{"format": "npuq-export/1", \xff}')  # was UnicodeDecodeError
    with pytest.raises(NpuqError, match="manifest.json cannot be read as UTF-8"):
        read_manifest(out)
    manifest = json.loads((tiny_folders.onnx / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "graphs": []}))
    with pytest.raises(NpuqError, match="graphs: expected an object, got list"):  # was AttributeError: list.values
        read_manifest(out)
    (out / "manifest.json").write_text(json.dumps({**manifest, "graphs": {}}))
    with pytest.raises(NpuqError, match="'graphs' is missing or empty; export the artifact again"):
        read_manifest(out)


def test_model_config_from_dict_types():
    cfg = tiny_decoder("llama")[1].config
    data = json.loads(json.dumps(cfg.to_dict()))
    assert ModelConfig.from_dict(data) == cfg
    for bad, message in ((dict(data, hidden_size=64.0), "hidden_size must be a whole number, got 64.0"),
                         (dict(data, extra=1), "unknown key"),
                         ({k: v for k, v in data.items() if k != "vocab_size"}, "lacks vocab_size"),
                         (dict(data, num_layers=10**9), "implausible"),  # a tuple per layer would need gigabytes
                         (dict(data, layer_types=["full", "global"]), "must be 'full' or 'sliding'")):
        with pytest.raises(ModelLoadError, match=message):  # were TypeError or ValueError
            ModelConfig.from_dict(bad)
