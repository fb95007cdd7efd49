"""Ctrl-C (SIGINT) or SIGTERM during ``npuq quantize``, in a real subprocess: exit status 130,
the previous artifact byte for byte intact, and no temporary folder left beside it."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from npuq.testing.tiny import tiny_hf_model

# Runs the real CLI; at the chosen point it says READY on stdout and waits for the test's signal.
DRIVER = """
import os, sys, time
from npuq import cli
import npuq.quantize.pt2e as pipeline
import torch

def wait_for_signal():
    print("READY", flush=True)
    time.sleep(600)  # the signal's KeyboardInterrupt ends this

point = os.environ["NPUQ_TEST_POINT"]
if point == "calibrate":
    real_calibrate = pipeline.calibrate_onepass
    def calibrate(*args, **kwargs):
        wait_for_signal()
        return real_calibrate(*args, **kwargs)
    pipeline.calibrate_onepass = calibrate
elif point == "save":
    import safetensors.torch
    real_save = safetensors.torch.save_file
    def save(*args, **kwargs):
        real_save(*args, **kwargs)  # weights.safetensors is in the temporary folder now
        wait_for_signal()
    safetensors.torch.save_file = save
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_folders):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("interrupt")
    tiny_hf_model("llama").save_pretrained(root / "model", safe_serialization=True)
    words = [f"w{i}" for i in range(200)]
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(root / "model")
    corpus = root / "calib.txt"  # two bytes that are not UTF-8 per repetition
    corpus.write_bytes(b" ".join(w.encode() for w in words) + b" \xff w1 w2 \xc3 w3\n" * 2)
    return root, tiny_folders.artifact


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _quantize(setup, tmp_path, point, sig=None):
    root, previous = setup
    parent = tmp_path / "work"
    parent.mkdir()
    out = parent / "art"
    shutil.copytree(previous, out)  # the previous artifact that must survive
    argv = [sys.executable, "-c", DRIVER, "quantize", "--model", str(root / "model"), "--scheme", "16a8w",
            "--calib-corpus", f"file:{root / 'calib.txt'}", "--calib-tokens", "64", "--context", "16",
            "--prefill-len", "4", "--num-threads", "1", "--out", str(out), "--force", "--json", str(tmp_path / "r.json")]
    env = {**os.environ, "NPUQ_TEST_POINT": point}
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        watchdog = threading.Timer(600, proc.kill)
        watchdog.start()
        try:
            if sig is not None:
                assert proc.stdout.readline().strip() == "READY", (tmp_path / "stderr.txt").read_text()[-3000:]
                proc.send_signal(sig)
            proc.communicate()
        finally:
            watchdog.cancel()
    return proc.returncode, (tmp_path / "stderr.txt").read_text(), parent, out


@pytest.mark.parametrize("point, sig", [
    ("calibrate", signal.SIGINT),
    ("save", signal.SIGINT),  # one program already written into the temporary folder
    ("calibrate", signal.SIGTERM),
])
def test_interrupted_quantize_keeps_the_previous_artifact(setup, tmp_path, point, sig):
    before = _digest(setup[1])
    code, stderr, parent, out = _quantize(setup, tmp_path, point, sig)
    assert code == 130, stderr[-3000:]
    assert "npuq: interrupted" in stderr and "Traceback" not in stderr
    assert _digest(out) == before  # byte for byte the previous artifact
    assert [p.name for p in parent.iterdir()] == ["art"]  # no .art.*.tmp / .old left behind
    assert not (tmp_path / "r.json").exists()


def test_uninterrupted_quantize_replaces_it_and_reports_replaced_bytes(setup, tmp_path):
    before = _digest(setup[1])
    code, stderr, parent, out = _quantize(setup, tmp_path, "none")
    assert code == 0, stderr[-3000:]
    assert _digest(out) != before and [p.name for p in parent.iterdir()] == ["art"]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["replacement_characters"] == 4 and result["batch_size"] == 8  # the default: memory is plenty
    assert json.loads((out / "config.json").read_text())["calibration"]["replacement_characters"] == 4
    assert "4 byte sequence(s) are not UTF-8" in stderr  # the warning reaches the user's terminal
