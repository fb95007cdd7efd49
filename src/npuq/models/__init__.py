"""Load a model from any source into the static decoder: config + float weights + tokenizer."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from npuq.models.config import ModelConfig, config_from_hf
from npuq.models.decoder import StaticDecoder, rope_tables
from npuq.models.sources import BUILTINS, read_gguf, read_hf_folder, resolve

__all__ = ["BUILTINS", "LoadedModel", "ModelConfig", "StaticDecoder", "load_model", "build_decoder"]

DEFAULT_MAX_CONTEXT = 4096


@dataclass
class LoadedModel:
    name: str  # what the user passed
    source: str  # the file or folder read
    config: ModelConfig
    hf_config: Any  # transformers PretrainedConfig, for tokenizer/generation defaults
    model: StaticDecoder
    _tokenizer_factory: Any

    @functools.cached_property
    def tokenizer(self) -> Any:
        return self._tokenizer_factory()

    def info(self) -> dict[str, Any]:
        cfg = self.config
        params = sum(p.numel() for n, p in self.model.named_parameters() if n != "lm_head.weight" or not cfg.tie_word_embeddings)
        return {
            "model": self.name,
            "source": self.source,
            "architecture": cfg.arch,
            "parameters": params,
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size,
            "context_length": cfg.max_position_embeddings,
            "tied_embeddings": cfg.tie_word_embeddings,
            "sliding_window_layers": sum(t == "sliding" for t in cfg.layer_types),
            "nope_layers": sum(not r for r in cfg.use_rope),
        }


def undo_norm_offset(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gemma checkpoints store RMSNorm weights minus one; add it back (llama.cpp's GGUF already did)."""
    if not cfg.norm_weight_offset:
        return tensors
    return {k: (v + cfg.norm_weight_offset if k.endswith("norm.weight") else v) for k, v in tensors.items()}


def build_decoder(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str, max_context: int | None = None) -> StaticDecoder:
    """A StaticDecoder with checked weights; RoPE tables cover ``max_context`` positions."""
    max_context = max_context or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)
    with torch.device("meta"):  # skip random initialisation: every parameter is overwritten
        model = StaticDecoder(cfg, max_context)
    tensors = model.check_weights(tensors, source)  # before allocating what the config claims
    model = model.to_empty(device="cpu")
    # to_empty leaves the (non-checkpoint) RoPE tables uninitialised: compute them again.
    model.rope_cos, model.rope_sin = rope_tables(cfg.rope, cfg.head_dim, max_context)
    if cfg.local_rope is not None:
        model.local_rope_cos, model.local_rope_sin = rope_tables(cfg.local_rope, cfg.head_dim, max_context)
    model.load_weights(tensors, source)
    return model.eval()


def load_model(spec: str, max_context: int | None = None) -> LoadedModel:
    """Load ``spec`` (built-in name, Hugging Face folder or .gguf file) as a float32 StaticDecoder."""
    kind, path = resolve(spec)
    hf_config, tensors, tokenizer = read_gguf(path) if kind == "gguf" else read_hf_folder(path)
    cfg = config_from_hf(hf_config)
    if kind == "hf":
        tensors = undo_norm_offset(cfg, tensors)
    model = build_decoder(cfg, tensors, str(path), max_context)
    return LoadedModel(spec, str(path), cfg, hf_config, model, tokenizer)
