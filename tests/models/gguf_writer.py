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


def write_tiny_llama_gguf(path, hf_model) -> None:
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), "llama")
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
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types([1] * c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in hf_model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied
        name = key.removeprefix("model.")
        if name == "norm.weight":
            name = "output_norm.weight"
        for hf, gg in _NAMES.items():
            name = name.replace(hf, gg)
        name = name.replace("layers.", "blk.")
        data = value.numpy().astype(np.float32)
        if name.endswith("attn_q.weight"):
            data = _permute(data, c.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            data = _permute(data, c.num_key_value_heads)
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
