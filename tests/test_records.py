"""Records as JSON (npuq.records): one schema for writing and reading, strict on the way in, and
stage keys that change with every field of every options record."""

from __future__ import annotations

import dataclasses
import re

import pytest

from npuq.errors import NpuqError
from npuq.eval.perplexity import EvalOptions
from npuq.lower.export import ExportOptions
from npuq.pipeline.job import RunOptions
from npuq.quantize.stage import QuantizeOptions
from npuq.records import from_json, record_key, to_json

# A second valid value for every field of every options record (a field missing here fails).
OTHER = {
    QuantizeOptions: {"model": "tiny", "scheme": "16a4w", "recipe": "16a4w_mixed", "calib_corpus": "file:x.txt",
                      "calib_tokens": 8192, "context": 256, "calibration_mode": "sequential", "prefill_len": 16,
                      "batch_size": 2, "seq_mse": 50, "seq_mse_granularity": "layer", "weight_rounding": "gptq",
                      "layer_inputs": "float", "act_order": False},
    ExportOptions: {"qnn_version": "2.47", "htp_arch": 75, "soc": "SM8650", "embedding_pattern": "legacy",
                    "embedding_storage": "int8-rowscale"},
    EvalOptions: {"corpus": "wikitext2", "split": "calib", "context": 128, "max_docs": 3, "max_tokens": None,
                  "batch_size": 1},
    RunOptions: {"quantize": QuantizeOptions(context=256), "export": ExportOptions(htp_arch=73), "eval_corpus": "wikitext2",
                 "eval_tokens": 128, "gen_tokens": 8, "prompts": ("Hello",), "sqnr_tokens": 16},
}
# fields that need a companion change to stay valid
COMPANIONS = {("QuantizeOptions", "layer_inputs"): {"seq_mse": 50}, ("QuantizeOptions", "act_order"): {"weight_rounding": "gptq"},
              ("EvalOptions", "max_docs"): {}, ("QuantizeOptions", "seq_mse_granularity"): {"seq_mse": 50}}


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
    assert (gptq.layer_inputs, gptq.act_order) == ("quantized", True)
    assert gptq == QuantizeOptions(weight_rounding="gptq", layer_inputs="quantized", act_order=True)
    assert record_key(gptq) == record_key(QuantizeOptions(weight_rounding="gptq", act_order=True))
    assert (QuantizeOptions().layer_inputs, QuantizeOptions().act_order) == (None, None)
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
    (lambda: QuantizeOptions(calibration_mode="fast"), "unknown --calibration-mode"),
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
