"""`npuq eval`: the JSON it writes, and bad input as one line with exit status 2."""

import json

import pytest

from npuq import cli


@pytest.fixture
def tiny_model(monkeypatch, tokenizer):
    """`load_model` replaced by a tiny random llama (vocab 256, max_position_embeddings 256)."""
    import npuq.models
    from npuq.models import LoadedModel
    from npuq.testing.tiny import tiny_decoder

    hf, model = tiny_decoder("llama", seed=0, max_context=64)
    assert len(tokenizer) <= model.config.vocab_size
    calls = []

    def fake_load_model(spec, max_context=None):
        calls.append((spec, max_context))
        return LoadedModel(spec, "tiny", model.config, hf.config, model, lambda: tokenizer)

    monkeypatch.setattr(npuq.models, "load_model", fake_load_model)
    return calls


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "pages.jsonl"
    pages = ["The quick brown fox jumps over the lazy dog. " * 6, "Perplexity of a text.", "Numbers: 3.14 and 42."]
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in pages), encoding="utf-8")
    return path


def _one_line_error(capsys, argv):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("npuq: error:") and "\n" not in err
    return err


def test_eval_writes_json(tiny_model, corpus_file, tmp_path):
    out = tmp_path / "ppl.json"
    argv = ["eval", "--model", "tiny", "--corpus", f"file:{corpus_file}", "--context", "16", "--batch-size", "2",
            "--json", str(out)]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte", "tokens", "words", "bytes", "documents",
                "context", "seconds", "graphs", "corpus", "split"):
        assert key in result, key
    assert result["documents"] == 3 and result["context"] == 16 and result["graphs"] == {"model": "tiny"}
    assert result["corpus"] == f"file:{corpus_file}" and result["split"] is None
    assert result["tokens"] > 16 and result["word_perplexity"] > 1.0


def test_eval_builtin_with_a_token_budget_and_threads(tiny_model, capsys):
    import torch

    before = torch.get_num_threads()
    argv = ["eval", "--model", "tiny", "--context", "32", "--max-tokens", "40", "--num-threads", "1", "--json", "-"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # standard output holds the JSON alone
    assert "word perplexity" in err  # the summary line went to standard error
    assert result["tokens"] == 40 and result["corpus"] == "builtin" and result["split"] == "eval"
    assert result["threads"] == 1 and torch.get_num_threads() == before


@pytest.mark.parametrize("context", ["0", "1"])
def test_context_below_two(tiny_model, capsys, context):
    err = _one_line_error(capsys, ["eval", "--model", "tiny", "--context", context])
    assert "too small" in err
    assert tiny_model == []  # refused before loading the model


def test_context_above_the_model_limit(tiny_model, capsys):
    err = _one_line_error(capsys, ["eval", "--model", "tiny", "--context", "257"])
    assert "exceeds the model's limit of 256" in err


def test_missing_corpus_file(tiny_model, capsys, tmp_path):
    err = _one_line_error(capsys, ["eval", "--model", "tiny", "--corpus", f"file:{tmp_path / 'none.jsonl'}"])
    assert "does not exist" in err


def test_jsonl_without_text(tiny_model, capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"title": "no text"}\n', encoding="utf-8")
    err = _one_line_error(capsys, ["eval", "--model", "tiny", "--corpus", f"file:{path}"])
    assert "line 2" in err and '"text"' in err


def test_empty_corpus(tiny_model, capsys, tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n", encoding="utf-8")
    err = _one_line_error(capsys, ["eval", "--model", "tiny", "--corpus", f"file:{path}"])
    assert "no documents" in err


def test_budget_flags_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--max-docs", "2", "--max-tokens", "100"])
    assert exc.value.code == 2
