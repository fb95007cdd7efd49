"""`npuq eval` on a corpus file with non-UTF-8 bytes: scored, with the replacement count in
the JSON result and a warning on stderr."""

import json

import pytest

from npuq import cli


def test_eval_reports_replaced_bytes(monkeypatch, tokenizer, tmp_path):
    import npuq.models
    from npuq.models import LoadedModel
    from npuq.testing.tiny import tiny_decoder

    hf, model = tiny_decoder("llama", seed=0, max_context=64)
    monkeypatch.setattr(npuq.models, "load_model",
                        lambda spec, max_context=None: LoadedModel(spec, "tiny", model.config, hf.config, model,
                                                                   lambda: tokenizer))
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"The quick brown fox jumps over the lazy dog. \x80\x81 The lazy dog sleeps \xc0. " * 3)
    out = tmp_path / "r.json"
    with pytest.warns(UserWarning, match=r"9 byte sequence\(s\) are not UTF-8"):  # shown on stderr by the CLI
        assert cli.main(["eval", "--model", "tiny", "--corpus", f"file:{path}", "--context", "32", "--num-threads",
                         "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["replacement_characters"] == 9  # \x80, \x81 and \xc0 are each invalid alone, three times
    assert result["documents"] == 1 and result["tokens"] > 0
    clean = tmp_path / "clean.txt"
    clean.write_text("The quick brown fox. " * 5, encoding="utf-8")
    assert cli.main(["eval", "--model", "tiny", "--corpus", f"file:{clean}", "--context", "32", "--num-threads", "1",
                     "--json", str(out)]) == 0
    assert json.loads(out.read_text())["replacement_characters"] == 0
