"""Random and mutated encodings.json, config.json (artifact), manifest.json (export) and
program files give a result or npuq's own error, never another exception.

The seeds are folders npuq wrote itself (the session's tiny artifact and export); mutations
are structure-aware (a value anywhere in the JSON replaced by another JSON value, or a key
dropped) and byte-level (bytes overwritten, the file cut short)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npuq.calibrate.encodings import read_encodings
from npuq.errors import NpuqError
from npuq.lower.manifest import read_manifest
from npuq.quantize.artifact import load_program, read_artifact
from npuq.records import to_json

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
SLOW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
# Each edit: which child to walk into at each level (indices taken modulo the size), how deep,
# and either a new value or None for "drop this key / item".
edits = st.lists(st.tuples(st.lists(st.integers(0, 10**6), min_size=1, max_size=6), st.one_of(st.none(), json_values)),
                 min_size=1, max_size=4)
byte_edits = st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), max_size=8)
cuts = st.one_of(st.just(1.0), st.floats(0.0, 1.0))


def mutate_json(value, edits):
    """``value`` (a deep copy) with each edit applied: walk down by the indices, then replace or drop."""
    value = json.loads(json.dumps(value))
    for path, new in edits:
        parent, key, node = None, None, value
        for index in path:
            if isinstance(node, dict) and node:
                parent, key = node, sorted(node)[index % len(node)]
            elif isinstance(node, list) and node:
                parent, key = node, index % len(node)
            else:
                break
            node = parent[key]
        if parent is None:
            value = new
        elif new is None:
            del parent[key]
        else:
            parent[key] = new
    return value


def mutate_bytes(data: bytes, edits, cut) -> bytes:
    buf = bytearray(data)
    for pos, value in edits:
        buf[pos % len(buf)] = value
    return bytes(buf[: int(len(buf) * cut)])


def _expect_result_or_npuq_error(read, path):
    try:
        return read(path)
    except NpuqError:
        return None


_count = iter(range(10**9))


@pytest.fixture(scope="module")
def seeds(tiny_folders):
    return {
        "config": json.loads((tiny_folders.artifact / "config.json").read_text()),
        "encodings": json.loads((tiny_folders.artifact / "encodings.json").read_text()),
        "manifest": json.loads((tiny_folders.onnx / "manifest.json").read_text()),
    }


def _folder(tmp_path, files, name, text):
    """A folder holding ``name`` = ``text`` and empty placeholders for the other ``files``: the
    readers only check that the files they name exist."""
    folder = tmp_path / f"f{next(_count)}"
    folder.mkdir()
    for f in files:
        (folder / f).write_bytes(b"")
    (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return folder


ARTIFACT_FILES = ("decode.json", "prefill.json", "scoring.json", "weights.safetensors")
EXPORT_FILES = ("decode.onnx", "prefill.onnx")


# (seed, extra files the folder needs, file name, reader of the folder, bytes edits confined to
# the first N bytes (where the structure starts) or None)
DOCUMENTS = {
    "artifact config.json": ("config", ARTIFACT_FILES, "config.json", read_artifact, None),
    "encodings.json": ("encodings", (), "encodings.json", lambda f: read_encodings(f / "encodings.json"), 4096),
    "export manifest.json": ("manifest", EXPORT_FILES, "manifest.json", read_manifest, None),
}


@pytest.mark.parametrize("document", list(DOCUMENTS))
@FUZZ
@given(edits=edits)
def test_json_edits(seeds, tmp_path, document, edits):
    seed, files, name, read, _ = DOCUMENTS[document]
    folder = _folder(tmp_path, files, name, json.dumps(mutate_json(seeds[seed], edits)))
    _expect_result_or_npuq_error(read, folder)


@pytest.mark.parametrize("document", list(DOCUMENTS))
@FUZZ
@given(edits=byte_edits, cut=cuts)
def test_json_bytes(seeds, tmp_path, document, edits, cut):
    seed, files, name, read, window = DOCUMENTS[document]
    if window is not None:
        edits = [(pos % window, v) for pos, v in edits]
    folder = _folder(tmp_path, files, name, mutate_bytes(json.dumps(seeds[seed]).encode(), edits, cut))
    _expect_result_or_npuq_error(read, folder)


@FUZZ
@given(value=json_values)
def test_any_json_document(tmp_path, value):
    text = json.dumps(value)
    _expect_result_or_npuq_error(read_artifact, _folder(tmp_path, ARTIFACT_FILES, "config.json", text))
    _expect_result_or_npuq_error(read_manifest, _folder(tmp_path, EXPORT_FILES, "manifest.json", text))
    _expect_result_or_npuq_error(read_encodings, _folder(tmp_path, (), "encodings.json", text) / "encodings.json")


@SLOW
@pytest.mark.parametrize("name", ["decode.json", "weights.safetensors"])
@given(edits=byte_edits, cut=cuts)
def test_mutated_program_files(tiny_folders, tmp_path, name, edits, cut):
    """A damaged program graph or weights file loads or gives an NpuqError, nothing else."""
    folder = tmp_path / f"p{next(_count)}"
    folder.mkdir()
    for f in ("decode.json", "weights.safetensors"):
        data = (tiny_folders.artifact / f).read_bytes()
        (folder / f).write_bytes(mutate_bytes(data, edits, cut) if f == name else data)
    _expect_result_or_npuq_error(load_program, folder / "decode.json")


def test_npuqs_own_files_pass(tiny_folders, seeds):
    """The seeds themselves read back (so the mutations start from valid input)."""
    assert to_json(read_artifact(tiny_folders.artifact)) == seeds["config"]
    assert read_encodings(tiny_folders.artifact / "encodings.json") == seeds["encodings"]
    assert to_json(read_manifest(tiny_folders.onnx)) == seeds["manifest"]  # every key read, none added
