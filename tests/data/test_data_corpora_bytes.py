"""File corpora with bytes that are not UTF-8: read with U+FFFD, counted and reported; JSON
Lines split at newlines only."""

import codecs
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npuq.data.corpora import load_corpus, replaced_characters
from npuq.data.document import decode_utf8

_errors: list[int] = []


def _counting_replace(exc: UnicodeDecodeError):
    _errors.append(exc.end - exc.start)
    return "\ufffd", exc.end


codecs.register_error("npuq-test-count", _counting_replace)


def reference_count(data: bytes) -> tuple[str, int]:
    """The same decoding through a counting error handler: an independent count."""
    _errors.clear()
    text = data.decode("utf-8", errors="npuq-test-count")
    return text, len(_errors)


# Valid text including a literal U+FFFD, mixed with arbitrary bytes.
chunks = st.lists(st.one_of(st.binary(max_size=12), st.text(max_size=12).map(lambda t: t.encode("utf-8")),
                            st.just("\ufffd".encode())), max_size=12).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(data=chunks)
def test_replacement_count_matches_a_counting_decoder(data):
    assert decode_utf8(data) == reference_count(data)


def test_txt_with_broken_bytes_is_read_and_reported(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café – déjà vu \ufffd".encode() + b" caf\xe9 na\xefve \xff\xfe end")
    with pytest.warns(UserWarning, match=r"latin1.txt: 4 byte sequence\(s\) are not UTF-8 .* U\+FFFD"):
        (doc,) = load_corpus(f"file:{path}")
    assert doc.replaced == 4 and replaced_characters([doc]) == 4
    assert doc.page == "café – déjà vu \ufffd caf\ufffd na\ufffdve \ufffd\ufffd end"


def test_jsonl_counts_per_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "clean"}\n{"text": "bro\xc3ken \xa0"}\r\n\n{"text": "ok"}\n')
    with pytest.warns(UserWarning, match="2 byte sequence"):
        docs = load_corpus(f"file:{path}")
    assert [(d.page, d.replaced) for d in docs] == [("clean", 0), ("bro\ufffdken \ufffd", 2), ("ok", 0)]


def test_clean_files_warn_nothing(tmp_path, recwarn):
    path = tmp_path / "clean.txt"
    path.write_text("plain text \ufffd is a real character here", encoding="utf-8")
    (doc,) = load_corpus(f"file:{path}")
    assert doc.replaced == 0 and not [w for w in recwarn if "UTF-8" in str(w.message)]


@settings(max_examples=100, deadline=None)
@given(texts=st.lists(st.text(min_size=1).filter(str.strip), min_size=1, max_size=5))
def test_jsonl_round_trip(tmp_path_factory, texts):
    """Regression: JSON may hold U+2028, U+0085, \\x1c... unescaped inside a string, and the
    reader used str.splitlines, which splits there too and broke such a line in two."""
    path = tmp_path_factory.mktemp("rt") / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t}, ensure_ascii=False) for t in texts) + "\n", encoding="utf-8")
    assert [d.page for d in load_corpus(f"file:{path}")] == texts


def test_line_separator_inside_a_string(tmp_path):
    path = tmp_path / "ls.jsonl"
    path.write_text('{"text": "one\u2028two\x85three"}\n', encoding="utf-8")
    assert [d.page for d in load_corpus(f"file:{path}")] == ["one\u2028two\x85three"]
