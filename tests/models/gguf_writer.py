"""Test helper: write a tiny Llama GGUF the way llama.cpp's converter lays it out."""

import gguf
import numpy as np

_NAMES = {
    "embed_tokens": "token_embd", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved per head pair (its LlamaModel.permute).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table: printable Latin-1 bytes
    stand for themselves, the others for the characters from U+0100 on, in byte order)."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(others)}}


# Merges of a tiny English byte-level BPE, in priority order ("Ġ" is the space byte).
_MERGES = ["Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "r e", "a t", "e n", "Ġ s", "Ġ w", "Ġ o",
           "Ġ c", "Ġ f", "Ġ p", "Ġ b", "Ġ m", "n d", "o r", "e s", "i s", "Ġ i", "Ġ Ġ", "in g"]


def _bpe_tokens(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """SmolLM2's layout at a tiny size: two control tokens, the byte alphabet less the rarest
    control bytes, then one token per merge; exactly ``vocab_size`` tokens."""
    chars = _byte_chars()
    kept = vocab_size - 2 - len(_MERGES)  # byte tokens
    rare = [b for b in range(32) if b not in (9, 10, 13)][: 256 - kept]
    alphabet = [chars[b] for b in range(256) if b not in rare]
    tokens = ["<|endoftext|>", "<|im_end|>", *alphabet, *(m.replace(" ", "") for m in _MERGES)]
    assert len(tokens) == vocab_size and len(set(tokens)) == vocab_size
    return tokens, [3, 3] + [1] * (vocab_size - 2), list(_MERGES)


def write_tiny_llama_gguf(path, hf_model, tokenizer: str = "llama") -> None:
    """``tokenizer``: "llama" (SentencePiece-style tokens <t0>... that encode no text) or "bpe"
    (a byte-level BPE that encodes any text, with SmolLM2's pre-tokenizer). A Qwen2 ``hf_model``
    is written as llama.cpp writes Qwen2 (architecture qwen2, q/k rows as they are)."""
    c = hf_model.config
    arch = "qwen2" if c.model_type == "qwen2" else "llama"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    if tokenizer == "bpe":
        tokens, types, merges = _bpe_tokens(c.vocab_size)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_add_bos_token(False)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
        w.add_token_scores([0.0] * c.vocab_size)
        w.add_token_types([1] * c.vocab_size)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    for key, value in hf_model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = key.removeprefix("model.")
        if name == "norm.weight":
            name = "output_norm.weight"
        elif name == "lm_head.weight":
            name = "output.weight"
        for hf, gg in _NAMES.items():
            name = name.replace(hf, gg)
        name = name.replace("layers.", "blk.")
        data = value.numpy().astype(np.float32)
        if arch != "llama":
            pass  # llama.cpp permutes q/k rows for llama only
        elif name.endswith("attn_q.weight"):
            data = _permute(data, c.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            data = _permute(data, c.num_key_value_heads)
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
