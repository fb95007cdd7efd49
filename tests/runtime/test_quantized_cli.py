"""quantize → eval --artifact → export → eval --onnx → generate, on a tiny Hugging Face folder."""

import json

import pytest

from npuq.cli import main
from npuq.models.tiny import tiny_hf_model

TEXT = "The quick brown fox jumps over the lazy dog. Windows are disjoint; every token is scored once. " * 3


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<bos>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = tiny_hf_model("llama", seed=11)
    model.save_pretrained(root / "model", safe_serialization=True)
    _tokenizer().save_pretrained(root / "model")
    assert main(["quantize", "--model", str(root / "model"), "--scheme", "16a8w", "--calib-tokens", "256",
                 "--context", "32", "--prefill-len", "8", "--out", str(root / "art"), "--num-threads", "1"]) == 0
    assert main(["export", "--artifact", str(root / "art"), "--out", str(root / "onnx"), "--qnn-version", "2.51"]) == 0
    return root


def _eval(argv, tmp_path):
    out = tmp_path / "r.json"
    assert main(["eval", *argv, "--context", "32", "--max-tokens", "300", "--num-threads", "1", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_eval_float_artifact_and_onnx_agree(folders, tmp_path):
    float_r = _eval(["--model", str(folders / "model")], tmp_path)
    art_r = _eval(["--artifact", str(folders / "art")], tmp_path)
    onnx_r = _eval(["--onnx", str(folders / "onnx")], tmp_path)
    assert float_r["tokens"] == art_r["tokens"] == onnx_r["tokens"] == 300
    assert art_r["graphs"]["scheme"] == "16a8w"
    # 16a8w stays close to float; the exported QDQ graphs compute what the PT2E programs compute.
    assert abs(art_r["word_perplexity"] / float_r["word_perplexity"] - 1) < 0.05
    assert abs(onnx_r["word_perplexity"] / art_r["word_perplexity"] - 1) < 0.01


def test_generate_with_artifact_and_onnx(folders, tmp_path):
    results = []
    for flag, folder in (("--artifact", "art"), ("--onnx", "onnx")):
        out = tmp_path / f"{folder}.json"
        assert main(["generate", flag, str(folders / folder), "--prompt", "The quick brown", "--max-new-tokens", "5",
                     "--num-threads", "1", "--json", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    assert all(1 <= len(r["token_ids"]) <= 5 for r in results)


def test_context_beyond_the_graphs_is_refused(folders, capsys):
    assert main(["eval", "--artifact", str(folders / "art"), "--context", "64"]) == 2
    assert "exceeds the 32 tokens" in capsys.readouterr().err
