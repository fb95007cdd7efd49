"""A tokenizer with more tokens than the model has embedding rows is refused with both numbers;
a smaller one (a padded table) is fine."""

import pytest

from npuq.cli import main
from npuq.errors import ModelLoadError
from npuq.models import load_model
from npuq.testing.tiny import save_tiny_hf_folder


def _folder(tmp_path, n_words):
    return save_tiny_hf_folder(tmp_path / f"tiny-{n_words}", "llama", words=n_words)  # vocab_size 256


def test_larger_tokenizer_is_refused_with_both_numbers(tmp_path, capsys):
    folder = _folder(tmp_path, 300)
    loaded = load_model(str(folder))
    with pytest.raises(ModelLoadError, match=r"tokenizer has 303 tokens but the model's vocab_size is 256, so ids "
                                             r"256 to 302 have no embedding row; use the tokenizer files"):
        loaded.tokenizer  # noqa: B018  (building the tokenizer is what is checked)
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i}" for i in range(290, 300)) * 5)
    capsys.readouterr()
    assert main(["eval", "--model", str(folder), "--corpus", f"file:{text}", "--context", "16",
                 "--num-threads", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "303 tokens" in err and "vocab_size is 256" in err


def test_smaller_tokenizer_is_a_padded_table(tmp_path):
    loaded = load_model(str(_folder(tmp_path, 200)))
    assert len(loaded.tokenizer) == 203 < loaded.config.vocab_size == 256
