"""Records as JSON (npuq.records): one schema for writing and reading, strict on the way in, and
stage keys that change with every field of every options record."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from npuq.errors import NpuqError
from npuq.eval.perplexity import EvalOptions
from npuq.lower.export import ExportOptions
from npuq.lower.manifest import (EXPORT_FORMAT, ArtifactRef, GraphEntry, IOEncoding, IOEntry, LoweringChoices, Manifest,
                                 TargetInfo, TokenizerRef)
from npuq.optimize.gptq import GptqOptions
from npuq.optimize.recovery import RecoverySummary
from npuq.runs import RunOptions
from npuq.quant.recipe import RECIPES
from npuq.quantize.artifact import ArtifactConfig, ModelInfo, ProgramEntry
from npuq.quantize.stage import QuantizeOptions
from npuq.records import from_json, record_key, to_json

# A second valid value for every field of every options record (a field missing here fails).
OTHER = {
    QuantizeOptions: {"model": "tiny", "scheme": "16a4w", "recipe": "16a4w_mixed", "calib_corpus": "file:x.txt",
                      "calib_tokens": 8192, "calib_offset": 4096, "calib_sampling": "spread", "context": 256, "calibration_mode": "sequential", "prefill_len": 16,
                      "batch_size": 2, "seq_mse": 50, "seq_mse_granularity": "layer", "weight_rounding": "gptq",
                      "layer_inputs": "float", "act_order": False, "gptq_damp": 0.5, "gptq_damp_down": 3.0, "rotate": "r1",
                      "bits_per_weight": 6.5, "parts": 2},
    ExportOptions: {"qnn_version": "2.47", "htp_arch": 75, "soc": "SM8650", "embedding_pattern": "legacy",
                    "embedding_storage": "int8-rowscale", "compile": True, "share_weights": True,
                    "genai": "shared", "shards": 2},
    EvalOptions: {"corpus": "wikitext2", "split": "calib", "context": 128, "max_docs": 3, "max_tokens": None,
                  "batch_size": 1},
    RunOptions: {"quantize": QuantizeOptions(context=256), "export": ExportOptions(htp_arch=73), "eval_corpus": "wikitext2",
                 "eval_tokens": 128, "gen_tokens": 8, "prompts": ("Hello",), "sqnr_tokens": 16},
}
# fields that need a companion change to stay valid
COMPANIONS = {("QuantizeOptions", "layer_inputs"): {"seq_mse": 50}, ("QuantizeOptions", "act_order"): {"weight_rounding": "gptq"},
              ("QuantizeOptions", "gptq_damp"): {"weight_rounding": "gptq"},
              ("QuantizeOptions", "gptq_damp_down"): {"weight_rounding": "gptq"},
              ("EvalOptions", "max_docs"): {}, ("QuantizeOptions", "seq_mse_granularity"): {"seq_mse": 50},
              ("ExportOptions", "compile"): {"htp_arch": 73},
              ("ExportOptions", "share_weights"): {"htp_arch": 73, "compile": True}}


def _variants(cls):
    base = cls()
    assert set(OTHER[cls]) == {f.name for f in dataclasses.fields(cls)}, f"give every {cls.__name__} field a value"
    for name, value in OTHER[cls].items():
        if name == "soc":
            yield name, cls(soc=value)
            continue
        if cls is EvalOptions and name == "max_tokens":
            yield name, cls(max_tokens=1000)
            continue
        yield name, cls(**{**COMPANIONS.get((cls.__name__, name), {}), name: value})
    assert base == cls()


@pytest.mark.parametrize("cls", list(OTHER), ids=lambda c: c.__name__)
def test_every_field_changes_the_key(cls):
    base = record_key(cls())
    keys = {}
    for name, changed in _variants(cls):
        assert changed != cls(), name
        keys[name] = record_key(changed)
        assert keys[name] != base, f"{cls.__name__}.{name} does not reach the key"


@pytest.mark.parametrize("cls", list(OTHER), ids=lambda c: c.__name__)
def test_json_round_trip(cls):
    for _, record in [("default", cls()), *_variants(cls)]:
        assert from_json(cls, to_json(record), "test") == record


def test_defaults_that_depend_on_other_fields_are_filled_in():
    assert QuantizeOptions(context=512).prefill_len == 32 and QuantizeOptions(context=40).prefill_len == 20
    gptq = QuantizeOptions(weight_rounding="gptq")
    assert (gptq.layer_inputs, gptq.act_order, gptq.gptq_damp, gptq.gptq_damp_down) == (
        "quantized", True, GptqOptions().damp, GptqOptions().damp_down)
    assert gptq == QuantizeOptions(weight_rounding="gptq", layer_inputs="quantized", act_order=True,
                                   gptq_damp=GptqOptions().damp, gptq_damp_down=GptqOptions().damp_down)
    assert record_key(gptq) == record_key(QuantizeOptions(weight_rounding="gptq", act_order=True))
    assert gptq.recovery.gptq == GptqOptions()
    assert (QuantizeOptions().layer_inputs, QuantizeOptions().act_order, QuantizeOptions().gptq_damp) == (None, None, None)
    assert not {"gptq_damp", "gptq_damp_down"} & set(to_json(QuantizeOptions()))  # runs without GPTQ keep their keys
    assert QuantizeOptions(calib_offset=0) == QuantizeOptions() and "calib_offset" not in to_json(QuantizeOptions())
    assert QuantizeOptions(calib_sampling="contiguous") == QuantizeOptions()
    assert "calib_sampling" not in to_json(QuantizeOptions())
    assert to_json(QuantizeOptions(calib_sampling="spread"))["calib_sampling"] == "spread"
    # the calibration draw (npuq.data.corpora.calibration_draw): 4096 contiguous, filled in; where
    # SeqMSE/GPTQ run, left to the stage (the model's widest layer input decides), given values kept
    assert (QuantizeOptions().calib_tokens, gptq.calib_tokens, gptq.calib_sampling) == (4096, None, None)
    wide, narrow = 4864, 1536  # Qwen2.5-Coder-0.5B's down projections, SmolLM2-135M's
    assert (gptq.calibration(wide), gptq.calibration(narrow)) == ((8192, "spread"), (4096, "contiguous"))
    assert QuantizeOptions().calibration(wide) == (4096, "contiguous")  # nothing fitted to a Gram matrix
    given = QuantizeOptions(seq_mse=50, calib_tokens=4096, calib_sampling="contiguous")
    assert given.calibration(wide) == (4096, "contiguous") and record_key(given) != record_key(QuantizeOptions(seq_mse=50))
    assert QuantizeOptions(seq_mse=50, calib_tokens=2048).calibration(wide) == (2048, "spread")
    assert from_json(QuantizeOptions, to_json(given), "test") == given
    assert ExportOptions(htp_arch="v73").htp_arch == 73 and ExportOptions(soc="sm8650").soc == "SM8650"


@pytest.mark.parametrize("data, message", [
    ({"context": 256, "contxt": 1}, "unknown key(s) 'contxt'"),
    ({"context": "256"}, "context: expected int"),
    ({"act_order": 1}, "act_order: expected bool"),
    ({"context": True}, "context: expected int"),
    ([], "expected an object"),
])
def test_reading_refuses_what_does_not_fit(data, message):
    with pytest.raises(NpuqError, match=re.escape(message)):
        from_json(QuantizeOptions, data, "config")


@pytest.mark.parametrize("make, message", [
    (lambda: QuantizeOptions(calib_tokens=100, context=512), "--calib-tokens 100 is less than one window"),
    (lambda: QuantizeOptions(prefill_len=512, context=512), "--prefill-len 512 must be at least 1 and below"),
    (lambda: QuantizeOptions(act_order=True), "--act-order orders GPTQ"),
    (lambda: QuantizeOptions(gptq_damp=0.1), "--gptq-damp damps GPTQ's Hessian"),
    (lambda: QuantizeOptions(weight_rounding="gptq", gptq_damp=0.0), "--gptq-damp 0 must be a positive number"),
    (lambda: QuantizeOptions(gptq_damp_down=1.0), "--gptq-damp-down damps GPTQ's Hessian"),
    (lambda: QuantizeOptions(weight_rounding="gptq", gptq_damp_down=-2.0), "--gptq-damp-down -2 must be a positive"),
    (lambda: QuantizeOptions(calibration_mode="fast"), "unknown --calibration-mode"),
    (lambda: QuantizeOptions(calib_offset=-1), "--calib-offset -1 must be 0 or more"),
    (lambda: QuantizeOptions(calib_sampling="random"), "unknown --calib-sampling 'random'"),
    (lambda: ExportOptions(htp_arch=73, soc="SM8650"), "either --htp-arch or --soc"),
    (lambda: ExportOptions(qnn_version="two"), "two"),
    (lambda: ExportOptions(embedding_pattern="new"), "unknown embedding pattern"),
    (lambda: EvalOptions(context=1), "too small"),
    (lambda: EvalOptions(max_docs=1, max_tokens=10), "either --max-docs or --max-tokens"),
    (lambda: RunOptions(eval_tokens=1), "--eval-tokens 1"),
])
def test_records_check_themselves_on_construction(make, message):
    with pytest.raises(NpuqError, match=message):
        make()


def test_a_record_read_back_is_checked_like_a_new_one():
    data = to_json(QuantizeOptions())
    data["calib_tokens"] = 10
    with pytest.raises(NpuqError, match="config: --calib-tokens 10 is less than one window"):
        from_json(QuantizeOptions, data, "config")


# --------------------------------------------------------------------------- file formats as records
@pytest.fixture(scope="module")
def model_config():
    from npuq.testing.tiny import tiny_decoder

    return json.loads(json.dumps(tiny_decoder("llama")[1].config.to_dict()))


def _manifest(model_config) -> Manifest:
    per_tensor = IOEncoding("uint16", 16, 0, 65535, 0.001, 32768)
    per_channel = IOEncoding("int8", 8, -128, 127, (0.5, 0.25), (0, 0), axis=1)

    def graph(kind, ar_len):
        return GraphEntry(f"{kind}.onnx", None, "0" * 64, ar_len,
                          (IOEntry("tokens", (1, ar_len), "int64"), IOEntry("k_cache_0", (1, 2, 16, 8), "uint16", per_tensor)),
                          (IOEntry("logits", (1, ar_len, 2), "int8", per_channel),
                           IOEntry("k_new_0", (1, 2, ar_len, 8), "uint16", per_tensor)),
                          {"matmul": "int16"}, ({"kind": "matmul_second_input", "node": "mm", "bits": [8, 16]},))

    return Manifest(format=EXPORT_FORMAT, npuq_version="0.1", artifact=ArtifactRef("/a", "npuq-quantized/2", None),
                    model_config=model_config, context=16, tokenizer=TokenizerRef("tiny", None),
                    target=TargetInfo("2.51.0", "--qnn-version", 73, None), opset=21, kv_cache="codes",
                    embedding_pattern="plain", embeddings={"embed": {"pattern": "plain"}},
                    options=LoweringChoices("auto", "u16"),
                    graphs={"decode": graph("decode", 1), "prefill": graph("prefill", 4)})


def _config(model_config, **changes) -> ArtifactConfig:
    fields = dict(model_config=model_config, context=16,
                  programs={"decode": ProgramEntry("decode.json", 1), "prefill": ProgramEntry("prefill.json", 4)},
                  weights="weights.safetensors", recipe=RECIPES["16a8w"].to_dict(),
                  recipe_plan=({"path": "layers.0.mlp", "kind": "linear", "rule": "default", "scheme": "16a8w"},),
                  stats={"scheme": "16a8w"}, versions={"npuq": "0.1"})
    return ArtifactConfig(**{**fields, **changes})


def test_manifest_round_trip(model_config):
    manifest = _manifest(model_config)
    data = json.loads(json.dumps(to_json(manifest)))
    assert from_json(Manifest, data, "manifest.json") == manifest
    decode = data["graphs"]["decode"]
    assert "encoding" not in decode["inputs"][0]  # optional keys are left out while unset, as npuq always wrote them
    assert "axis" not in decode["inputs"][1]["encoding"] and decode["outputs"][0]["encoding"]["axis"] == 1


def test_artifact_config_round_trip(model_config):
    for config in (_config(model_config),
                   _config(model_config, model=ModelInfo("tiny", "/models/tiny", "0" * 64),
                           calibration={"corpus": "builtin"}, recipe_plan=None,
                           optimize=from_json(RecoverySummary, OPTIMIZE_JSON, "optimize"))):
        data = json.loads(json.dumps(to_json(config)))
        assert from_json(ArtifactConfig, data, "config.json") == config
        assert ("model" in data) == (config.model is not None) and "optimize" in data


# config.json's "optimize" as npuq wrote it when it was a dict (format 2 onwards)
OPTIMIZE_JSON = {"seq_mse": {"candidates": 4, "granularity": "channel", "seconds": 1.5},
                 "weight_rounding": {"method": "gptq", "seconds": 2.25, "act_order": True},
                 "gram_seconds": 0.5, "layer_inputs": "quantized", "layers": 211, "output_error_reduction": 0.42}


def test_optimize_summary_keeps_its_json():
    """The recovery summary record reads what the dict-writing versions wrote and writes it back
    byte for byte (same keys, same order), so existing artifacts read back unchanged."""
    for data in (OPTIMIZE_JSON, {**OPTIMIZE_JSON, "weight_rounding": {**OPTIMIZE_JSON["weight_rounding"], "damp": 0.1}},
                 {**OPTIMIZE_JSON, "seq_mse": {"candidates": None, "granularity": None, "seconds": 0.0},
                                 "weight_rounding": {"method": "nearest", "seconds": 0.1, "act_order": None}}):
        record = from_json(RecoverySummary, json.loads(json.dumps(data)), "optimize")
        assert json.dumps(to_json(record)) == json.dumps(data)


def _set(data, path, value):
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    (("graphs", "decode", "inputs", 0, "nme"), "x", "graphs['decode']: inputs[0]: unknown key(s) 'nme'"),
    (("target", "arch"), 73, "target: unknown key(s) 'arch'"),
    (("context",), "16", "context: expected int, got '16'"),
    (("target", "htp_arch"), [73], "target: htp_arch: expected int, got [73]"),
    (("graphs", "prefill", "outputs", 1, "encoding", "scale"), "0.1", "encoding: scale: '0.1' fits none of its types"),
    (("graphs", "prefill", "ar_len"), 1, "graph prefill: ar_len 1 is not a distinct whole number from 1 to 16"),
    (("graphs", "decode", "inputs", 1, "encoding", "zero_point"), 70000, "zero_point within [qmin, qmax]"),
    (("model_config", "num_layers"), "2", "num_layers must be a whole number, got '2'"),
])
def test_manifest_refuses_what_does_not_fit(model_config, path, value, message):
    data = _set(to_json(_manifest(model_config)), path, value)
    with pytest.raises(NpuqError, match="^manifest.json: .*" + re.escape(message)):
        from_json(Manifest, data, "manifest.json")


@pytest.mark.parametrize("path, value, message", [
    (("note",), "test", "config.json: unknown key(s) 'note'"),
    (("programs", "decode", "ar_len"), "1", "config.json: programs['decode']: ar_len: expected int, got '1'"),
    (("versions", "npuq"), 1, "config.json: versions['npuq']: expected str, got 1"),
    (("programs", "prefill", "ar_len"), 16, "the prefill program's ar_len 16 is not a whole number from 1 to 15"),
])
def test_artifact_config_refuses_what_does_not_fit(model_config, path, value, message):
    data = _set(to_json(_config(model_config)), path, value)
    with pytest.raises(NpuqError, match=re.escape(message)):
        from_json(ArtifactConfig, data, "config.json")


def test_execution_summary_keeps_its_json():
    """report.json's "execution": ExecutionContext.describe() as a record, written as the dict was."""
    from npuq.runtime.context import ExecutionContext
    from npuq.threads import ExecutionSummary

    ctx = ExecutionContext.create("cpu", num_threads=2)
    ctx.adopt({"decode": 3})
    summary = ctx.describe()
    assert json.dumps(to_json(summary)) == json.dumps(
        {"device": "cpu", "num_threads": 2, "thread_plan": {"decode": {"threads": 2, "source": "user"}}})
    assert from_json(ExecutionSummary, json.loads(json.dumps(to_json(summary))), "execution") == summary
