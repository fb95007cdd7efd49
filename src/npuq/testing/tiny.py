"""Tiny random models built from real Hugging Face config classes, one per supported family.

Used by the tests and benchmarks: each is a few hundred kB, but it exercises every
architecture feature of its family (GQA, biases, q/k norms, sandwich norms, sliding windows,
NoPE layers, Llama 3 RoPE scaling).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from npuq.models import build_decoder, undo_norm_offset
from npuq.models.config import config_from_hf
from npuq.models.weights import hf_name

# name → (transformers config class name, kwargs)
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(_COMMON, num_hidden_layers=2, tie_word_embeddings=True)),
    "llama3.2": ("LlamaConfig", dict(_COMMON, num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(_COMMON, num_hidden_layers=2, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(_COMMON, num_hidden_layers=2, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(_COMMON, num_hidden_layers=3, query_pre_attn_scalar=16, sliding_window=6,
                                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                          "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    "smollm3": ("SmolLM3Config", dict(_COMMON, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
                                      tie_word_embeddings=True)),
}


def tiny_hf_model(name: str, seed: int = 0) -> Any:
    """A transformers causal LM with random weights (norm weights perturbed too), eval mode, fp32."""
    # transformers (0.7 s) loads on use
    import transformers

    cls_name, kwargs = TINY_CONFIGS[name]
    config = getattr(transformers, cls_name)(**kwargs, initializer_range=0.1)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight") or pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def tiny_decoder(name: str, seed: int = 0, max_context: int = 64):
    """(hf_model, npuq StaticDecoder with the same weights)."""
    hf = tiny_hf_model(name, seed)
    cfg = config_from_hf(hf.config)
    tensors = undo_norm_offset(cfg, {hf_name(k): v for k, v in hf.state_dict().items()})
    return hf, build_decoder(cfg, tensors, f"tiny-{name}", max_context)


def save_tiny_hf_folder(folder: Any, name: str = "llama", seed: int = 0, words: int = 200) -> Any:
    """Write a loadable Hugging Face folder (safetensors + a word-level tokenizer over the words
    ``w0`` … ``w{words-1}``) of the tiny ``name`` model, for end-to-end CLI tests."""
    # transformers (0.7 s) loads on use
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)  # words + 3 above vocab_size (256) makes a mismatched folder, for tests of that
    tiny_hf_model(name, seed).save_pretrained(folder, safe_serialization=True)
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, **{f"w{i}": i + 3 for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(folder)
    return folder
