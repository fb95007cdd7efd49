"""Random and mutated corpus files (file:*.txt, file:*.jsonl) give documents or npuq's own
error, never another exception; whatever is read is non-empty text."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npuq.data.corpora import Document, load_corpus
from npuq.errors import NpuqError

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_count = iter(range(10**9))

VALID_JSONL = b"".join(json.dumps({"text": t}, ensure_ascii=False).encode() + b"\n"
                       for t in ["first page", "zweite Seite \u00fc", "", "line \u2028 separator", "\ufffd literal"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["text", "t", ""]) | st.text(max_size=4),
                                                                inner, max_size=3),
    max_leaves=6,
)


def _read(tmp_path, suffix, data):
    path = tmp_path / f"c{next(_count)}{suffix}"
    path.write_bytes(data)
    try:
        docs = load_corpus(f"file:{path}")
    except NpuqError:
        return None
    assert docs and all(isinstance(d, Document) and isinstance(d.page, str) and d.page.strip() for d in docs)
    assert all(d.replaced >= 0 for d in docs)
    return docs


@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".txt", ".jsonl"]))
def test_random_bytes(tmp_path, data, suffix):
    _read(tmp_path, suffix, data)


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.floats(0.0, 1.0))
def test_mutated_jsonl(tmp_path, edits, cut):
    buf = bytearray(VALID_JSONL)
    for pos, value in edits:
        buf[pos % len(buf)] = value
    _read(tmp_path, ".jsonl", bytes(buf[: int(len(buf) * cut) + 1]))


@FUZZ
@given(lines=st.lists(json_values, min_size=1, max_size=4), ending=st.sampled_from([b"\n", b"\r\n", b"\n\n"]))
def test_json_values_per_line(tmp_path, lines, ending):
    docs = _read(tmp_path, ".jsonl", ending.join(json.dumps(v).encode() for v in lines))
    expected = [v["text"] for v in lines if isinstance(v, dict) and isinstance(v.get("text"), str) and v["text"].strip()]
    if docs is not None:  # every line an object with a string "text": those with text, in order
        assert [d.page for d in docs] == expected
