"""Random and mutated model files give a model or npuq's own error, never another exception."""

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from npuq.errors import NpuqError
from npuq.models import load_model
from npuq.testing.tiny import tiny_hf_model

sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
from gguf_writer import write_tiny_llama_gguf  # noqa: E402

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_counter = iter(range(10**9))


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("valid")
    model = tiny_hf_model("llama")
    write_tiny_llama_gguf(root / "tiny.gguf", model)
    model.save_pretrained(root / "hf", safe_serialization=True)
    # A callable, not the bytes: hypothesis would print megabytes of repr on a failure.
    files = ((root / "tiny.gguf").read_bytes(), (root / "hf" / "model.safetensors").read_bytes(),
             (root / "hf" / "config.json").read_text())
    return lambda i: files[i]


def _mutate(data: bytes, edits, cut) -> bytes:
    buf = bytearray(data)
    for pos, value in edits:
        buf[pos % len(buf)] = value
    return bytes(buf[: max(1, int(len(buf) * cut))])


def _load(path):
    try:
        load_model(str(path))
    except NpuqError:
        pass


edits = st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), max_size=8)
cuts = st.one_of(st.just(1.0), st.floats(0.0, 1.0))


@FUZZ
@given(edits=edits, cut=cuts, header_only=st.booleans())
@example(edits=[(175, 2)], cut=1.0, header_only=False)  # once asked for a 34 GB allocation
def test_mutated_gguf(valid_files, tmp_path, edits, cut, header_only):
    data = valid_files(0)
    if header_only:  # concentrate edits on the header and metadata, where parsing happens
        edits = [(pos % 4096, v) for pos, v in edits]
    path = tmp_path / f"m{next(_counter)}.gguf"
    path.write_bytes(_mutate(data, edits, cut))
    _load(path)


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_as_gguf(tmp_path, data):
    path = tmp_path / f"r{next(_counter)}.gguf"
    path.write_bytes(b"GGUF" + data)
    _load(path)


@FUZZ
@given(edits=edits, cut=cuts)
def test_mutated_safetensors(valid_files, tmp_path, edits, cut):
    folder = tmp_path / f"hf{next(_counter)}"
    folder.mkdir()
    (folder / "config.json").write_text(valid_files(2))
    data = valid_files(1)
    edits = [(pos % 2048, v) for pos, v in edits]  # the JSON header of the file
    (folder / "model.safetensors").write_bytes(_mutate(data, edits, cut))
    _load(folder)


@FUZZ
@given(changes=st.dictionaries(
    st.sampled_from(["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "vocab_size", "intermediate_size", "rms_norm_eps", "model_type",
                     "max_position_embeddings", "rope_parameters"]),
    st.one_of(st.integers(-3, 300), st.floats(allow_nan=True), st.text(max_size=8), st.none()),
    max_size=3,
))
def test_mutated_config(valid_files, tmp_path, changes):
    folder = tmp_path / f"cfg{next(_counter)}"
    folder.mkdir()
    config = json.loads(valid_files(2))
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(valid_files(1))
    _load(folder)


def test_huge_sizes_in_metadata_are_refused_before_allocating(valid_files, tmp_path):
    """Found by the fuzzer: one flipped header byte made the config claim 34 GB of weights."""
    import gguf

    from npuq.testing.tiny import tiny_hf_model

    model = tiny_hf_model("llama")
    path = tmp_path / "huge.gguf"
    write_tiny_llama_gguf(path, model)
    data = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key) + 4  # skip the value type (uint32)
    data[at:at + 4] = (1 << 30).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    assert gguf.GGUFReader(str(path)).fields["llama.feed_forward_length"].parts[-1][0] == 1 << 30
    with pytest.raises(NpuqError, match="ffn|mlp|shape"):
        load_model(str(path))
