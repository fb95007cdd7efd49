"""Corpora: the offline builtin split, file corpora and their errors, the wikitext detokenizer."""

import builtins
import hashlib
import json

import pytest

from npuq.data.corpora import builtin_split_of, load_corpus, wikitext2_documents, wikitext_detokenize
from npuq.errors import NpuqError


def test_builtin_splits_are_disjoint_sorted_and_cover_the_topics():
    from pydoc_data.topics import topics

    calib, evals = load_corpus("builtin", "calib"), load_corpus("builtin", "eval")
    assert calib and evals
    for docs in (calib, evals):
        assert [d.id for d in docs] == sorted(d.id for d in docs)
    calib_text = {d.page for d in calib}
    assert not calib_text & {d.page for d in evals}
    assert {d.id for d in calib} | {d.id for d in evals} == {f"builtin/{t}" for t, v in topics.items() if v.strip()}
    # Balanced enough to calibrate on one half and evaluate on the other.
    assert 0.3 < sum(len(d.page) for d in evals) / sum(len(d.page) for d in calib + evals) < 0.7


def test_builtin_split_is_a_fixed_hash_not_pythons_salted_one():
    for topic in ("assert", "with", "lambda", "numbers"):
        expected = "calib" if hashlib.sha256(topic.encode()).digest()[0] % 2 == 0 else "eval"
        assert builtin_split_of(topic) == expected
    assert load_corpus("builtin") == load_corpus("builtin")


def test_txt_and_jsonl_files(tmp_path):
    txt = tmp_path / "one.txt"
    txt.write_text("A single page.\nSecond line.", encoding="utf-8")
    (doc,) = load_corpus(f"file:{txt}")
    assert doc.page == "A single page.\nSecond line." and doc.target == doc.page

    jsonl = tmp_path / "many.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["first", "", "third"]) + "\n\n", encoding="utf-8")
    docs = load_corpus(f"file:{jsonl}", "calib")
    assert [d.page for d in docs] == ["first", "third"]
    assert len({d.id for d in docs}) == 2


def test_jsonl_line_without_text_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "no text here"}\n', encoding="utf-8")
    with pytest.raises(NpuqError, match=r'line 2: no "text" field'):
        load_corpus(f"file:{path}")


def test_jsonl_line_that_is_not_json(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\nnot json\n', encoding="utf-8")
    with pytest.raises(NpuqError, match=r"line 3: not valid JSON"):
        load_corpus(f"file:{path}")


def test_missing_file_and_bad_suffix(tmp_path):
    with pytest.raises(NpuqError, match="does not exist"):
        load_corpus(f"file:{tmp_path / 'nope.txt'}")
    (tmp_path / "data.csv").write_text("a,b", encoding="utf-8")
    with pytest.raises(NpuqError, match=r"expected a \.txt or \.jsonl"):
        load_corpus(f"file:{tmp_path / 'data.csv'}")


@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_empty_corpus_is_refused(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(NpuqError, match="no documents with text"):
        load_corpus(f"file:{path}")


def test_unknown_corpus_and_split():
    with pytest.raises(NpuqError, match="unknown corpus 'wiki'.*file:PATH"):
        load_corpus("wiki")
    with pytest.raises(NpuqError, match="unknown split 'test'"):
        load_corpus("builtin", "test")


def test_wikitext2_without_datasets_says_how_to_use_a_file(monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("No module named 'datasets'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(NpuqError, match="file:PATH"):
        wikitext2_documents("eval")


def test_wikitext_detokenizer():
    raw = ' = Valkyria = \n The game , released in 2011 @-@ 12 , sold 1 @,@ 000 @.@ 5 units ( in Japan ) . It \'s " good " . \n'
    assert wikitext_detokenize(raw) == ' = Valkyria =\nThe game, released in 2011-12, sold 1,000.5 units (in Japan). It\'s "good".\n'


def test_a_mix_alternates_its_parts_and_takes_an_equal_share_of_tokens(tmp_path):
    """builtin+file:X: the parts' documents in turn, each marked with its part; corpus_tokens
    takes n/2 tokens from each part (by a whitespace tokenizer, counted by hand), although the
    builtin part alone has far more than n tokens and comes first."""
    from npuq.data.corpora import corpus_tokens

    weird = tmp_path / "a+b.txt"  # a '+' inside a file name is part of the name, not a mix
    weird.write_text("zeta eta theta " * 50, encoding="utf-8")
    mix = load_corpus(f"builtin+file:{weird}", "calib")
    builtin = load_corpus("builtin", "calib")
    assert len(mix) == len(builtin) + 1
    assert (mix[0].part, mix[1].part) == ("builtin", f"file:{weird}") and mix[1].page.startswith("zeta")
    assert [d.page for d in mix if d.part == "builtin"] == [d.page for d in builtin]

    class Words:  # one token per word: ids 1.. for words, 0 for BOS
        bos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [1 + (hash(w) % 1000) for w in text.split()]

    tokens = corpus_tokens(Words(), mix, 101)
    alone = corpus_tokens(Words(), [d for d in mix if d.part == "builtin"], 51)
    assert tokens[:51] == alone  # the first part's share: 51 of 101
    assert tokens[51] == 0 and len(tokens) == 101  # then BOS and 49 words of the file
    assert tokens[52:] == Words().encode("zeta eta theta " * 50)[:49]
    # An offset draws later text: of a single corpus, the same tokens as a longer draw from 0 cut
    # by hand; of a mix, each part from its own offset.
    assert corpus_tokens(Words(), "builtin", 40, offset=30) == corpus_tokens(Words(), "builtin", 70)[30:]
    shifted = corpus_tokens(Words(), mix, 101, offset=7)
    assert shifted[:51] == corpus_tokens(Words(), [d for d in mix if d.part == "builtin"], 58)[7:]
    assert shifted[51:] == ([0] + Words().encode("zeta eta theta " * 50))[7:7 + 50]
    assert corpus_tokens(Words(), [mix[1]], 10, offset=150) == [1 + (hash("theta") % 1000)]  # 151 tokens: the last
    with pytest.raises(NpuqError, match="same corpus twice"):
        load_corpus("builtin+builtin")
    with pytest.raises(NpuqError, match="unknown corpus 'builtin\\+nope'; use builtin, file:PATH"):
        load_corpus("builtin+nope")  # '+' splits only before another corpus name


def test_spread_sampling_takes_windows_from_evenly_spaced_points():
    """spread=W: runs of W tokens starting at offset + i·T/runs (T the whole text's tokens),
    wrapping round at the end, the last run shorter; computed here by hand on a text whose
    tokens are their own positions."""
    from npuq.data.corpora import corpus_tokens
    from npuq.data.document import Document

    class Counter:  # document k of n words → its words' numbers; BOS is -1
        bos_token_id = -1

        def encode(self, text, add_special_tokens=False):
            return [int(w) for w in text.split()]

    docs = [Document(f"d{k}", " ".join(str(100 * k + j) for j in range(24))) for k in range(4)]  # 4 × 25 = 100 tokens
    flat = [t for d in docs for t in [-1] + Counter().encode(d.target)]
    # 25 tokens in runs of 10: 3 runs at 0, 33, 66 (100·i/3 rounded down), of 10, 10 and 5.
    assert corpus_tokens(Counter(), docs, 25, spread=10) == flat[0:10] + flat[33:43] + flat[66:71]
    # From offset 40: runs at 40, 73 and 106 − 100 = 6; the second wraps past the end.
    assert corpus_tokens(Counter(), docs, 25, offset=40, spread=10) == flat[40:50] + flat[73:83] + flat[6:11]
    assert corpus_tokens(Counter(), docs, 30, offset=90, spread=10) == flat[90:100] + flat[23:33] + flat[56:66]
    # Every document is sampled where a contiguous draw of the same size sees the first one only.
    first_tokens = {t // 100 for t in corpus_tokens(Counter(), docs, 20, spread=5) if t >= 0}
    assert first_tokens == {0, 1, 2, 3}
    assert {t // 100 for t in corpus_tokens(Counter(), docs, 20) if t >= 0} == {0}
    # A text no longer than the request is taken whole; an offset past its end gives nothing.
    assert corpus_tokens(Counter(), docs, 100, spread=10) == flat
    assert corpus_tokens(Counter(), docs, 10, offset=100, spread=5) == []
