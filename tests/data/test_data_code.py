"""Corpus code: the standard library modules it reads, its fixed split, a machine that lacks
some or all of the source files."""

import importlib
import json.decoder
from pathlib import Path

import pytest

from npuq.data import code
from npuq.data.corpora import load_corpus
from npuq.errors import NpuqError


def test_every_module_is_a_standard_library_source_file_of_this_python():
    """Each path of the list is the source file of the module Python imports by that name (its
    ``__file__``: frozen modules such as abc have one too), under the standard library (not
    site-packages, not a test folder)."""
    root = code.stdlib_folder().resolve()
    for path in code.MODULES:
        name = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        origin = Path(importlib.import_module(name).__file__).resolve()
        assert origin == root / path, name
        assert "site-packages" not in origin.parts and not {"test", "tests", "idlelib"} & set(origin.parts)


def test_splits_are_disjoint_sorted_fixed_and_cover_the_list():
    calib, evals = load_corpus("code", "calib"), load_corpus("code", "eval")
    for docs in (calib, evals):
        assert [d.id for d in docs] == sorted(d.id for d in docs)
    assert not {d.id for d in calib} & {d.id for d in evals}
    assert {d.id for d in calib} | {d.id for d in evals} == {f"code/{p}" for p in code.MODULES}
    # The split of a path never changes (hand-checked: the first byte of SHA-256 is even for calib).
    ids = {d.id: split for split, docs in (("calib", calib), ("eval", evals)) for d in docs}
    assert (ids["code/abc.py"], ids["code/heapq.py"]) == ("calib", "calib")
    assert (ids["code/json/decoder.py"], ids["code/cmd.py"], ids["code/dataclasses.py"]) == ("eval",) * 3
    assert (len(calib), len(evals)) == (26, 28)
    assert 0.3 < sum(len(d.page) for d in evals) / sum(len(d.page) for d in calib + evals) < 0.7
    assert load_corpus("code", "eval") == evals


def test_a_document_is_the_module_source_as_python_reads_it():
    (doc,) = [d for d in load_corpus("code", "eval") if d.id == "code/json/decoder.py"]
    assert doc.page == Path(json.decoder.__file__).read_text(encoding="utf-8") and doc.target == doc.page
    assert "class JSONDecoder" in doc.page and doc.replaced == 0


def test_a_python_without_some_modules_leaves_them_out_with_a_warning(tmp_path):
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "decoder.py").write_text("def decode(s):\n    return s\n", encoding="utf-8")
    (tmp_path / "abc.py").write_text("class ABC:\n    pass\n", encoding="utf-8")
    with pytest.warns(UserWarning, match=rf"{len(code.MODULES) - 2} of its {len(code.MODULES)} modules .*cmd\.py"):
        docs = code.code_documents("eval", tmp_path)
    assert [(d.id, d.page) for d in docs] == [("code/json/decoder.py", "def decode(s):\n    return s\n")]


def test_a_python_without_its_sources_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(code, "stdlib_folder", lambda: tmp_path)
    with pytest.raises(NpuqError, match=r"corpus code: this Python has no standard library source files .*builtin"):
        load_corpus("builtin+code", "calib")


def test_code_is_a_part_of_a_mix_by_name_only(tmp_path):
    mix = load_corpus("builtin+code", "calib")
    assert [d.part for d in mix[:2]] == ["builtin", "code"] and mix[1].id == "code/abc.py"
    named = tmp_path / "x+code.txt"  # '+code' inside a file name is not a part
    named.write_text("words", encoding="utf-8")
    assert [d.part for d in load_corpus(f"file:{named}")] == [""]
    with pytest.raises(NpuqError, match="unknown corpus 'builtin\\+codes'"):
        load_corpus("builtin+codes")
