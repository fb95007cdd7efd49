"""The GGUF conversion cache: a second load gives the very same model without reading the GGUF;
a changed file is never served from a stale entry; a damaged entry is rebuilt with one warning."""

import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from npuq.errors import ModelLoadError
from npuq.models import gguf_cache, load_model
from npuq.records import to_json
from npuq.testing.tiny import tiny_hf_model

sys.path.insert(0, str(Path(__file__).parent))
from gguf_writer import write_tiny_llama_gguf  # noqa: E402

TEXTS = ["<t5><t7><t200>", "hello world", "<t1> <t2>  <t255>"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(root))
    monkeypatch.delenv(gguf_cache.DISABLE_VARIABLE, raising=False)
    return root / "gguf"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """Two tiny Llama GGUFs of the same size and layout, different weights."""
    root = tmp_path_factory.mktemp("ggufs")
    paths = []
    for seed in (0, 1):
        path = root / f"tiny{seed}.gguf"
        write_tiny_llama_gguf(path, tiny_hf_model("llama", seed=seed))
        paths.append(path)
    assert paths[0].stat().st_size == paths[1].stat().st_size
    return paths


@pytest.fixture
def gguf(ggufs, tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(ggufs[0].read_bytes())
    return path


@pytest.fixture
def bpe_gguf(tmp_path):
    """A tiny Llama GGUF with a byte-level BPE tokenizer (SmolLM2's kind) that encodes any text."""
    path = tmp_path / "bpe.gguf"
    write_tiny_llama_gguf(path, tiny_hf_model("llama", seed=0), tokenizer="bpe")
    return path


def _uncached(path, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv(gguf_cache.DISABLE_VARIABLE, "1")
        return load_model(str(path))


def _gguf_not_read(monkeypatch):
    """Make any conversion from the GGUF fail: what loads now came from the cache."""
    import npuq.models as models

    def refuse(path):
        raise AssertionError(f"{path} was converted again")

    monkeypatch.setattr(models, "read_gguf", refuse)


def assert_same_model(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    for name in ("rope_cos", "rope_sin"):
        assert torch.equal(getattr(a.model, name), getattr(b.model, name))
    facts = lambda m: {k: v for k, v in to_json(m.info()).items() if k not in ("model", "source")}  # noqa: E731
    assert a.config == b.config and facts(a) == facts(b)
    ta, tb = a._tokenizer_factory(), b._tokenizer_factory()
    assert ta.get_vocab() == tb.get_vocab()
    for text in TEXTS:
        assert ta(text)["input_ids"] == tb(text)["input_ids"]
    strip = lambda d: {k: v for k, v in d.items() if k != "_name_or_path"}  # noqa: E731
    assert strip(a.hf_config.to_dict()) == strip(b.hf_config.to_dict())
    tokens = torch.arange(10).unsqueeze(0)
    from npuq.runtime.runner import forward_logits

    assert torch.equal(forward_logits(a.model, tokens), forward_logits(b.model, tokens))


def _entries(cache):
    return sorted(p.name for p in cache.iterdir() if p.is_dir()) if cache.is_dir() else []


def test_second_load_is_from_the_cache_and_bit_identical(cache, gguf, monkeypatch):
    reference = _uncached(gguf, monkeypatch)
    assert _entries(cache) == []  # NPUQ_NO_MODEL_CACHE=1 writes nothing
    first = load_model(str(gguf))
    sha = gguf_cache.file_sha256(gguf)
    assert _entries(cache) == [sha]
    assert {"config.json", "model.safetensors", "tokenizer.json", gguf_cache.MANIFEST} <= {
        p.name for p in (cache / sha).iterdir()}
    hashed = []
    real_hash = gguf_cache.file_sha256
    monkeypatch.setattr(gguf_cache, "file_sha256", lambda p: hashed.append(Path(p)) or real_hash(p))
    _gguf_not_read(monkeypatch)
    second = load_model(str(gguf))
    assert gguf.resolve() not in hashed  # the index knew the file: it was not hashed again
    assert second.source == str(gguf) and isinstance(second.hf_config, gguf_cache.CachedHFConfig)
    assert_same_model(reference, first)
    assert_same_model(reference, second)
    # the parameters are the memory-mapped cache file's (copy-on-write), each its own
    lm_head, embed = second.model.lm_head.weight, second.model.embed_tokens.weight
    assert lm_head.untyped_storage().data_ptr() != embed.untyped_storage().data_ptr()
    with torch.no_grad():
        embed.mul_(0)
    assert load_file(cache / sha / "model.safetensors")["embed_tokens.weight"].abs().sum() > 0


def test_a_changed_gguf_is_converted_again(cache, gguf, ggufs, monkeypatch):
    load_model(str(gguf))
    old_sha = gguf_cache.file_sha256(gguf)
    gguf.write_bytes(ggufs[1].read_bytes())  # same size, other weights
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = load_model(str(gguf))
    assert_same_model(_uncached(gguf, monkeypatch), changed)
    assert not torch.equal(changed.model.embed_tokens.weight, _uncached(ggufs[0], monkeypatch).model.embed_tokens.weight)
    assert _entries(cache) == [gguf_cache.file_sha256(gguf)]  # the stale entry went with the old content
    assert old_sha not in _entries(cache)


def test_a_rewrite_that_keeps_size_and_mtime_is_still_noticed(cache, gguf, ggufs, monkeypatch):
    """The index also keys on ctime and inode, which no rewrite can set back."""
    load_model(str(gguf))
    st = gguf.stat()
    gguf.write_bytes(ggufs[1].read_bytes())
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert gguf.stat().st_size == st.st_size and gguf.stat().st_mtime_ns == st.st_mtime_ns
    assert_same_model(_uncached(ggufs[1], monkeypatch), load_model(str(gguf)))


def _corrupt(kind, entry):
    weights = entry / "model.safetensors"
    manifest = json.loads((entry / gguf_cache.MANIFEST).read_text())

    def resave(tensors):
        save_file(tensors, weights)
        manifest["files"]["model.safetensors"]["size"] = weights.stat().st_size  # past the size check
        (entry / gguf_cache.MANIFEST).write_text(json.dumps(manifest))

    if kind == "missing weights":
        weights.unlink()
    elif kind == "truncated weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif kind == "unreadable weights (size kept)":
        data = bytearray(weights.read_bytes())
        data[:8] = (10**12).to_bytes(8, "little")  # a header length beyond the file
        weights.write_bytes(bytes(data))
    elif kind == "shape mismatch":
        tensors = load_file(weights)
        tensors["layers.0.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"][:-1].clone()
        resave(tensors)
    elif kind == "missing tensor":
        tensors = load_file(weights)
        del tensors["layers.1.self_attn.q_proj.weight"]
        resave(tensors)
    elif kind == "NaN weight":
        tensors = load_file(weights)
        tensors["norm.weight"][3] = float("nan")
        resave(tensors)
    elif kind == "edited tokenizer":
        (entry / "tokenizer.json").write_text("{}")
    elif kind == "edited light tokenizer":
        (entry / gguf_cache.FAST_TOKENIZER).write_text("{}")
    elif kind == "missing manifest":
        (entry / gguf_cache.MANIFEST).unlink()
    elif kind == "garbage manifest":
        (entry / gguf_cache.MANIFEST).write_bytes(b"\xff{not json")
    elif kind == "bad model_config":
        manifest["model_config"]["num_layers"] = -1
        (entry / gguf_cache.MANIFEST).write_text(json.dumps(manifest))
    elif kind == "manifest names a file outside":
        manifest["files"]["../../escape"] = {"size": 1, "sha256": None}
        (entry / gguf_cache.MANIFEST).write_text(json.dumps(manifest))
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", [
    "missing weights", "truncated weights", "unreadable weights (size kept)", "shape mismatch", "missing tensor",
    "NaN weight", "edited tokenizer", "edited light tokenizer", "missing manifest", "garbage manifest", "bad model_config",
    "manifest names a file outside",
])
def test_a_damaged_entry_is_rebuilt_with_one_warning(cache, gguf, monkeypatch, caplog, kind):
    reference = load_model(str(gguf))
    # its weights are mapped from the entry's file, which the damage below rewrites in place
    reference.model = copy.deepcopy(reference.model)
    (sha,) = _entries(cache)
    _corrupt(kind, cache / sha)
    with caplog.at_level(logging.WARNING, logger="npuq.models"):
        rebuilt = load_model(str(gguf))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "unusable" in warnings[0] and "rebuilding" in warnings[0] and sha in warnings[0]
    assert_same_model(reference, rebuilt)
    caplog.clear()
    _gguf_not_read(monkeypatch)  # and the rebuilt entry serves the next load, quietly
    with caplog.at_level(logging.WARNING, logger="npuq.models"):
        assert_same_model(reference, load_model(str(gguf)))
    assert not caplog.records


def test_the_first_load_decodes_one_tensor_at_a_time(cache, gguf, monkeypatch):
    """The conversion streams into the cache: when a tensor is decoded, none decoded before is
    still alive (the model is then mapped from the entry, not held as decoded tensors)."""
    import weakref

    from npuq.models.sources import GGUFTensors

    real, decoded, alive_at_decode = GGUFTensors.get, [], []

    def get(self, name):  # no gc.collect(): a tensor kept alive only by a reference cycle would be held too
        alive_at_decode.append(sum(ref() is not None for ref in decoded))
        t = real(self, name)
        decoded.append(weakref.ref(t))
        return t

    monkeypatch.setattr(GGUFTensors, "get", get)
    loaded = load_model(str(gguf))
    assert len(decoded) == len(loaded.model.state_dict()) - 1  # every tensor but the tied lm head, once
    assert max(alive_at_decode) == 0
    _gguf_not_read(monkeypatch)
    assert_same_model(loaded, load_model(str(gguf)))


def test_a_gguf_with_a_non_finite_tensor_is_refused_and_not_cached(cache, tmp_path, monkeypatch):
    from npuq.models.sources import GGUFTensors

    real = GGUFTensors.get

    def poisoned(self, name):
        t = real(self, name)
        if name == "layers.1.mlp.up_proj.weight":
            t[0, 0] = float("inf")
        return t

    monkeypatch.setattr(GGUFTensors, "get", poisoned)
    path = tmp_path / "poisoned.gguf"
    write_tiny_llama_gguf(path, tiny_hf_model("llama", seed=0))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj\.weight contains NaN or Inf"):
        load_model(str(path))
    assert _entries(cache) == [] and [p.name for p in cache.iterdir() if p.name.startswith(".")] == []


def test_an_interrupted_conversion_leaves_nothing(cache, gguf, monkeypatch):
    import npuq.models.gguf_cache

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(npuq.models.gguf_cache, "write_safetensors", interrupted)
        with pytest.raises(KeyboardInterrupt):
            load_model(str(gguf))
    assert _entries(cache) == [] and [p.name for p in cache.iterdir() if p.name.startswith(".")] == []
    load_model(str(gguf))
    assert _entries(cache) == [gguf_cache.file_sha256(gguf)]


def test_an_unwritable_cache_only_costs_time(tmp_path, gguf, monkeypatch, caplog):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(blocker))
    monkeypatch.delenv(gguf_cache.DISABLE_VARIABLE, raising=False)
    with caplog.at_level(logging.WARNING, logger="npuq.models"):
        loaded = load_model(str(gguf))
    assert loaded.info().architecture == "llama"
    (message,) = [r.getMessage() for r in caplog.records]
    assert "cannot cache" in message and "\n" not in message


def test_a_damaged_index_only_costs_a_rehash(cache, gguf, monkeypatch):
    load_model(str(gguf))
    (cache / gguf_cache.INDEX).write_text("[1, 2")
    _gguf_not_read(monkeypatch)
    load_model(str(gguf))
    index = json.loads((cache / gguf_cache.INDEX).read_text())
    assert index["files"][str(gguf.resolve())]["sha256"] == gguf_cache.file_sha256(gguf)


def test_entries_of_other_versions_are_rebuilt_quietly(cache, gguf, monkeypatch, caplog):
    load_model(str(gguf))
    (sha,) = _entries(cache)
    manifest = json.loads((cache / sha / gguf_cache.MANIFEST).read_text())
    manifest["versions"]["transformers"] = "0.0.1"
    (cache / sha / gguf_cache.MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="npuq.models"):
        load_model(str(gguf))
    assert not caplog.records
    assert json.loads((cache / sha / gguf_cache.MANIFEST).read_text())["versions"] == gguf_cache._versions()


def test_a_context_beyond_the_limit_is_the_users_error_not_a_damaged_entry(cache, gguf):
    load_model(str(gguf))
    (sha,) = _entries(cache)
    with pytest.raises(ModelLoadError, match="exceeds the model's limit"):
        load_model(str(gguf), max_context=10**9)
    assert _entries(cache) == [sha]


def test_a_tokenizer_damaged_after_the_load_comes_from_the_gguf(cache, gguf, monkeypatch, caplog):
    reference = _uncached(gguf, monkeypatch)
    load_model(str(gguf))
    cached = load_model(str(gguf))
    (cache / _entries(cache)[0] / "tokenizer.json").write_text("{")
    with caplog.at_level(logging.WARNING, logger="npuq.models"):
        tokenizer = cached._tokenizer_factory()
    assert len(caplog.records) == 1
    assert tokenizer.get_vocab() == reference._tokenizer_factory().get_vocab()


def test_a_cached_load_and_encoding_import_neither_transformers_nor_dynamo(cache, bpe_gguf, monkeypatch):
    expected = _uncached(bpe_gguf, monkeypatch).tokenizer.encode("the end", add_special_tokens=False)
    load_model(str(bpe_gguf))
    code = ("import sys; from npuq.models import load_model; m = load_model(sys.argv[1]); "
            "assert type(m.hf_config).__name__ == 'CachedHFConfig'; "
            "assert type(m.encoder).__name__ == 'CachedEncoder'; print(m.encoder.encode('the end')); "
            "print(sorted(n for n in ('transformers', 'torch._dynamo', 'gguf') if n in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(bpe_gguf)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NPUQ_CACHE_DIR": str(cache.parent)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [str(expected), "[]"]


def _texts_to_encode():
    from npuq.data import load_corpus

    return TEXTS + [gguf_cache._PROBE] + [d.target for split in ("calib", "eval") for d in load_corpus("builtin", split)]


def test_the_cached_encoder_encodes_and_decodes_as_the_tokenizer(cache, bpe_gguf, monkeypatch):
    reference = _uncached(bpe_gguf, monkeypatch).tokenizer
    load_model(str(bpe_gguf))
    _gguf_not_read(monkeypatch)
    encoder = load_model(str(bpe_gguf)).encoder
    assert isinstance(encoder, gguf_cache.CachedEncoder)
    assert (encoder.bos_token_id, encoder.eos_token_id, len(encoder)) == (
        reference.bos_token_id, reference.eos_token_id, len(reference))
    for text in _texts_to_encode():
        ids = reference.encode(text, add_special_tokens=False)
        assert len(ids) >= len(text.encode()) // 4  # this tokenizer encodes everything
        assert encoder.encode(text) == ids
        assert encoder.decode(ids[:50]) == reference.decode(ids[:50])
    from npuq.data.corpora import corpus_tokens

    assert corpus_tokens(encoder, "builtin", 3000) == corpus_tokens(reference, "builtin", 3000)
    with pytest.raises(ValueError, match="without special tokens"):
        encoder.encode("hi", add_special_tokens=True)


@pytest.mark.parametrize("difference", ["splits special tokens", "cleans up decoded spaces", "encodes otherwise"])
def test_no_light_encoder_when_the_tokenizer_does_more_than_its_pipeline(cache, bpe_gguf, monkeypatch, difference):
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained

    def different(*args, **kwargs):
        tokenizer = real(*args, **kwargs)
        if difference == "splits special tokens":
            tokenizer.split_special_tokens = True
        elif difference == "cleans up decoded spaces":
            tokenizer.clean_up_tokenization_spaces = True
        else:
            encode = tokenizer.encode
            tokenizer.encode = lambda text, **kw: encode(text, **kw)[::-1]
        return tokenizer

    with monkeypatch.context() as m:
        m.setattr(AutoTokenizer, "from_pretrained", different)
        load_model(str(bpe_gguf))
    (sha,) = _entries(cache)
    assert json.loads((cache / sha / gguf_cache.MANIFEST).read_text())["fast_tokenizer"] is None
    assert not (cache / sha / gguf_cache.FAST_TOKENIZER).exists()
    loaded = load_model(str(bpe_gguf))
    assert loaded.encoder is loaded.tokenizer  # the transformers tokenizer serves


def test_a_qwen2_gguf_tokenizes_the_same_from_the_gguf_and_from_the_cache(cache, monkeypatch, tmp_path):
    """transformers adds Qwen2's NFC normalizer only when it loads a tokenizer from files, so a
    decomposed accent ("cafe" + U+0301) used to be 3 tokens on the converting load, 2 after."""
    path = tmp_path / "qwen2.gguf"
    write_tiny_llama_gguf(path, tiny_hf_model("qwen2", seed=0), tokenizer="bpe")
    text = "cafe\u0301 u\u0308ber"
    uncached = _uncached(path, monkeypatch).tokenizer
    first = load_model(str(path))
    _gguf_not_read(monkeypatch)
    cached = load_model(str(path))
    nfc = uncached.encode("caf\u00e9 \u00fcber", add_special_tokens=False)
    assert isinstance(cached.encoder, gguf_cache.CachedEncoder) and cached.encoder.encode(text) == nfc
    for loaded in (first, cached):
        assert loaded.tokenizer.encode(text, add_special_tokens=False) == nfc
    assert uncached.encode(text, add_special_tokens=False) == nfc


def test_a_conversion_parses_the_gguf_once(cache, bpe_gguf, monkeypatch):
    """npuq's reader serves transformers' config and tokenizer builders too (each parsed the
    file again: 1.8 s apiece for SmolLM2-135M); the gguf module is left as it was."""
    import gguf
    from gguf.gguf_reader import GGUFReader

    parses = []
    real = GGUFReader._build_fields
    monkeypatch.setattr(GGUFReader, "_build_fields", lambda self, *a, **k: parses.append(1) or real(self, *a, **k))
    loaded = load_model(str(bpe_gguf))
    assert len(parses) == 1
    assert gguf.GGUFReader is GGUFReader
    assert loaded.tokenizer.encode("the end", add_special_tokens=False)  # built from the shared reader
