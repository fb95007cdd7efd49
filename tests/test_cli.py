"""The command line's edges: every numeric flag out of range is one line and exit status 2,
and the Hugging Face libraries are put offline before they are imported."""

import json
import os
import subprocess
import sys

import pytest

from npuq import cli
from npuq.testing.tiny import tiny_hf_model


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, message", [
    (["quantize", "--context", "1"], "--context: too small: a window needs at least 2 tokens, got 1"),
    (["quantize", "--seq-mse", "0"], "--seq-mse: must be at least 1, got 0"),
    (["quantize", "--seq-mse", "-5"], "--seq-mse: must be at least 1, got -5"),
    (["quantize", "--calib-tokens", "0"], "--calib-tokens: must be at least 1"),
    (["quantize", "--batch-size", "0"], "--batch-size: must be at least 1"),
    (["quantize", "--batch-size", "2.5"], "--batch-size: expected a whole number, got '2.5'"),
    (["quantize", "--prefill-len", "0"], "--prefill-len: must be at least 1"),
    (["quantize", "--num-threads", "5000"], "--num-threads: must be at most 1024, got 5000"),
    (["quantize", "--num-threads", "-1"], "--num-threads: must be 0 or more, got -1"),
    (["quantize", "--calib-tokens", "9" * 5000], "--calib-tokens: expected a whole number"),
    (["generate", "--prompt", "x", "--context", "0"], "--context: too small"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["tune-threads", "--phase", "decode", "--context", "1"], "--context: too small"),
    (["eval", "--batch-size", "0"], "--batch-size: must be at least 1"),
    (["eval", "--max-tokens", "-2"], "--max-tokens: must be at least 1"),
    (["eval", "--max-docs", "0"], "--max-docs: must be at least 1"),
])
def test_flag_out_of_range_is_one_line(capsys, tmp_path, argv, message):
    if argv[0] == "quantize":
        argv = [*argv, "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = _one_line(capsys)
    assert err.startswith(f"npuq {argv[0]}: error: argument ") and message in err and f"see 'npuq {argv[0]} --help'" in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--context", "8", "--prefill-len", "9"], "--prefill-len 9 exceeds --context 8"),
    (["generate", "--prompt", "x", "--context", "8", "--prefill-len", "4", "--max-new-tokens", "8"],
     "--max-new-tokens 8 leaves no room for the prompt in --context 8: use at most 7"),
    (["tune-threads", "--phase", "prefill", "--context", "8", "--prefill-len", "16"], "--prefill-len 16 exceeds --context 8"),
    (["quantize", "--context", "16", "--prefill-len", "16", "--calib-tokens", "64"],
     "--prefill-len 16 must be at least 1 and below --context 16"),
    (["quantize", "--act-order"], "--act-order orders GPTQ's rounding"),
    (["quantize", "--layer-inputs", "quantized"], "add --seq-mse N and/or --weight-rounding gptq"),
    (["run", "--act-order", "--seq-mse", "8"], "add --weight-rounding gptq"),
    (["quantize", "--gptq-damp", "0.1"], "add --weight-rounding gptq, or drop --gptq-damp"),
    (["quantize", "--weight-rounding", "gptq", "--gptq-damp", "-1"], "--gptq-damp -1 must be a positive number"),
    (["quantize", "--gptq-damp-down", "2"], "add --weight-rounding gptq, or drop --gptq-damp-down"),
])
def test_flags_that_must_fit_the_context(capsys, tmp_path, monkeypatch, argv, message):
    import npuq.models
    import npuq.pipeline.job
    import npuq.quantize.stage

    def no_model(*args, **kwargs):
        raise AssertionError("the flags are checked before any model loads")

    for module, name in ((npuq.models, "load_model"), (npuq.quantize.stage, "load_model"),
                         (npuq.pipeline.job, "open_model")):  # each module that loads one
        monkeypatch.setattr(module, name, no_model)
    if argv[0] in ("quantize", "run"):
        argv = [*argv, "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    assert message in _one_line(capsys)


def test_absurd_context_is_refused_before_allocating(tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_hf_model("llama").save_pretrained(folder, safe_serialization=True)
    (tmp_path / "c.txt").write_text("some text " * 50)
    huge = str(10**15)  # RoPE tables this long would need petabytes
    capsys.readouterr()  # save_pretrained's progress bar
    argv = ["quantize", "--model", str(folder), "--context", huge, "--calib-tokens", huge,
            "--calib-corpus", f"file:{tmp_path / 'c.txt'}", "--out", str(tmp_path / "o")]
    assert cli.main(argv) == 2
    assert f"--context {huge} exceeds the model's limit of 256" in _one_line(capsys)


def test_stay_offline_respects_an_explicit_choice():
    env = {}
    cli._stay_offline(env)
    assert env == dict.fromkeys(cli.OFFLINE_VARIABLES, "1")
    env = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "1"}
    cli._stay_offline(env)
    assert env == {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_DATASETS_OFFLINE": "1"}


WATCH = """
import json, os, sys
from npuq import cli
seen = {}
class Watch:  # records the environment when a Hugging Face library is first imported
    def find_spec(self, name, path=None, target=None):
        if name in ("huggingface_hub", "transformers") and name not in seen:
            seen[name] = {k: os.environ.get(k) for k in cli.OFFLINE_VARIABLES}
sys.meta_path.insert(0, Watch())
code = cli.main(sys.argv[1:])
from huggingface_hub import constants, get_session
try:
    get_session().get("https://huggingface.co/api/models/gpt2", timeout=5)
    blocked = None
except Exception as exc:
    blocked = type(exc).__name__
print(json.dumps({"code": code, "seen": seen, "offline": constants.HF_HUB_OFFLINE, "blocked": blocked}))
"""


@pytest.mark.parametrize("user", [None, "0"])
def test_cli_is_offline_before_transformers_is_imported(tmp_path, user):
    folder = tmp_path / "tiny"
    tiny_hf_model("llama").save_pretrained(folder, safe_serialization=True)
    env = {k: v for k, v in os.environ.items() if k not in cli.OFFLINE_VARIABLES}
    if user is not None:
        env["HF_HUB_OFFLINE"] = user
    proc = subprocess.run([sys.executable, "-c", WATCH, "info", "--model", str(folder)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 0 and set(report["seen"]) == {"huggingface_hub", "transformers"}
    expected = user or "1"
    for name, variables in report["seen"].items():
        assert variables == dict.fromkeys(cli.OFFLINE_VARIABLES, expected), name
    if user is None:
        assert report["offline"] is True and report["blocked"] == "OfflineModeIsEnabled"  # no request left the process
    else:
        assert report["offline"] is False  # the user's explicit choice wins (e.g. to fill a cache once)


def test_gptq_damp_help_states_the_default(capsys):
    """The help is written out (importing GPTQ for --help would import torch): its default must be
    GPTQ's."""
    from npuq.optimize.gptq import GptqOptions

    with pytest.raises(SystemExit):
        cli.main(["quantize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {GptqOptions().damp:g} with --weight-rounding gptq;" in text
    assert f"(default {GptqOptions().damp_down:g} with --weight-rounding gptq)" in text


def test_model_help_names_every_builtin(capsys):
    """The --model help is written out (listing the table would import torch for --help): it
    must still name every built-in model."""
    from npuq.models.sources import BUILTINS

    with pytest.raises(SystemExit):
        cli.main(["info", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert [name for name in BUILTINS if name not in text] == []
