"""``--device``: how it resolves, its one-line errors, CPU results equal to the default, and the
whole pipeline on CUDA compared with the CPU where a GPU exists (skipped without one)."""

import json

import pytest
import torch

from npuq.cli import main
from npuq.device import resolve_device
from npuq.errors import NpuqError
from npuq.testing.tiny import tiny_hf_model
from npuq.quantize.artifact import load_artifact

CONTEXT = 16
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine where torch sees no GPU (what this suite's CPU-only runners are anyway)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_the_cpu_without_a_gpu(no_gpu):
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("cuda_build, why", [(None, "built for CPU"), ("12.4", "built with CUDA 12.4, but no GPU is visible")])
def test_cuda_without_a_gpu_says_what_to_do(no_gpu, monkeypatch, cuda_build, why):
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    with pytest.raises(NpuqError) as exc:
        resolve_device("cuda")
    message = str(exc.value)
    assert message.startswith(f"--device cuda: CUDA is not available (torch {torch.__version__} {why}")
    assert message.endswith(": use --device cpu") and "\n" not in message


def test_cli_refuses_cuda_before_any_work(no_gpu, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["quantize", "--model", str(tmp_path / "no-such-model"), "--device", "cuda", "--out", str(out)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err and not out.exists()  # refused before the model loads
    assert main(["eval", "--model", str(tmp_path / "no-such-model"), "--device", "cuda:1"]) == 2
    assert "--device cuda:1: CUDA is not available" in capsys.readouterr().err
    assert main(["eval", "--onnx", str(tmp_path), "--device", "cuda"]) == 2
    assert "does not apply to --onnx" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--device", "gpu"])
    assert exc.value.code == 2 and "expected auto, cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err


# --------------------------------------------------------------------------- end to end
def _tokenizer(words):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny Llama folder and a text file of its words (calibration and evaluation text)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", seed=7).save_pretrained(folder, safe_serialization=True)
    words = [f"w{i}" for i in range(200)]
    _tokenizer(words).save_pretrained(folder)
    text = folder.parent / "text.txt"
    ids = torch.randint(0, 200, (200,), generator=torch.Generator().manual_seed(0))
    text.write_text(" ".join(words[int(i)] for i in ids))
    return folder, text


def _quantize(folder, text, out, *extra):
    result = out.parent / f"{out.name}.json"
    argv = ["quantize", "--model", str(folder), "--scheme", "16a8w", "--calib-corpus", f"file:{text}",
            "--calib-tokens", "40", "--context", str(CONTEXT), "--prefill-len", "4", "--num-threads", "1",
            "--out", str(out), "--json", str(result), *extra]
    assert main(argv) == 0
    return json.loads(result.read_text())


def _eval(what, text, out, *extra):
    argv = ["eval", *what, "--corpus", f"file:{text}", "--context", str(CONTEXT), "--max-tokens", "60",
            "--num-threads", "1", "--json", str(out), *extra]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    result.pop("seconds")
    return result


def test_device_cpu_equals_the_default(no_gpu, hf_folder, tmp_path):
    """Without a GPU the default (auto) is the CPU: --device cpu gives exactly its numbers."""
    folder, text = hf_folder
    default = _quantize(folder, text, tmp_path / "default")
    cpu = _quantize(folder, text, tmp_path / "cpu", "--device", "cpu")
    assert default["device"] == cpu["device"] == "cpu"
    assert (tmp_path / "default" / "encodings.json").read_bytes() == (tmp_path / "cpu" / "encodings.json").read_bytes()
    assert json.loads((tmp_path / "cpu" / "config.json").read_text())["calibration"]["device"] == "cpu"
    for what in (["--model", str(folder)], ["--artifact", str(tmp_path / "cpu")]):
        a = _eval(what, text, tmp_path / "a.json")
        b = _eval(what, text, tmp_path / "b.json", "--device", "cpu")
        assert a == b and b["device"] == "cpu"


# Tolerances on CUDA, stated: the float forward differs from the CPU's by float32 rounding
# (different kernels and reduction orders, TF32 off as torch's default), so perplexities agree
# to 1e-5 relative and min/max activation scales to 1e-4; weight encodings are exact (the same
# weights' min/max). The QDQ programs re-round activations at every quantize node, where a
# value a rounding away from a code boundary may land one code apart: 1e-3 for their perplexity.
@CUDA
@pytest.mark.parametrize("mode", ["onepass", "sequential"])
def test_cuda_quantize_and_eval_match_the_cpu(hf_folder, tmp_path, mode):
    folder, text = hf_folder
    cpu = _quantize(folder, text, tmp_path / "cpu", "--device", "cpu", "--calibration-mode", mode)
    gpu = _quantize(folder, text, tmp_path / "gpu", "--device", "cuda", "--calibration-mode", mode, "--num-threads", "0")
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda:")
    phase = "calibrate" if mode == "onepass" else "decode"
    assert gpu["thread_plan"][phase]["source"] == "kept"  # --num-threads 0 on a GPU: no CPU tuning
    enc = {d: json.loads((tmp_path / d / "encodings.json").read_text()) for d in ("cpu", "gpu")}
    assert enc["gpu"]["param_encodings"] == enc["cpu"]["param_encodings"]
    for a, b in zip(enc["cpu"]["activation_encodings"], enc["gpu"]["activation_encodings"]):
        assert a["name"] == b["name"] and b["scale"] == pytest.approx(a["scale"], rel=1e-4), a["name"]

    # made on the GPU, the artifact is CPU tensors: it loads and runs anywhere
    art = load_artifact(tmp_path / "gpu")
    assert {t.device.type for gm in (art.decode, art.prefill) for t in [*gm.parameters(), *gm.buffers()]} == {"cpu"}
    assert torch.isfinite(art.logits(torch.tensor([[1, 5, 9, 12]]))).all()

    f_cpu = _eval(["--model", str(folder)], text, tmp_path / "f1.json", "--device", "cpu")
    f_gpu = _eval(["--model", str(folder)], text, tmp_path / "f2.json", "--device", "cuda")
    assert f_gpu["device"].startswith("cuda:") and f_gpu["tokens"] == f_cpu["tokens"]
    assert f_gpu["word_perplexity"] == pytest.approx(f_cpu["word_perplexity"], rel=1e-5)
    q_cpu = _eval(["--artifact", str(tmp_path / "cpu")], text, tmp_path / "q1.json", "--device", "cpu")
    q_gpu = _eval(["--artifact", str(tmp_path / "cpu")], text, tmp_path / "q2.json", "--device", "cuda")
    assert q_gpu["device"].startswith("cuda:")
    assert q_gpu["word_perplexity"] == pytest.approx(q_cpu["word_perplexity"], rel=1e-3)


@CUDA
def test_cuda_generate_and_weight_optimization(hf_folder, tmp_path):
    folder, text = hf_folder
    for flag in (["--model", str(folder), "--context", str(CONTEXT)], ["--artifact", None]):
        if flag[1] is None:
            _quantize(folder, text, tmp_path / "art", "--device", "cuda", "--seq-mse", "4",
                      "--weight-rounding", "gptq")
            flag = ["--artifact", str(tmp_path / "art")]
        out = tmp_path / "g.json"
        assert main(["generate", *flag, "--prompt", "w1 w2 w3", "--max-new-tokens", "4", "--prefill-len", "4",
                     "--device", "cuda", "--json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["device"].startswith("cuda:") and 1 <= len(result["token_ids"]) <= 4
        assert result["thread_plan"]["decode"]["source"] == "kept"
    config = json.loads((tmp_path / "art" / "config.json").read_text())
    assert config["calibration"]["device"].startswith("cuda:")
    assert config["optimize"]["seq_mse"]["candidates"] == 4 and config["optimize"]["weight_rounding"]["method"] == "gptq"
