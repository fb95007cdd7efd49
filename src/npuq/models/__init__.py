"""Load a model from any source into the static decoder: config + float weights + tokenizer."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from npuq.errors import ModelLoadError
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
        tokenizer = self._tokenizer_factory()
        check_tokenizer_vocab(tokenizer, self.config.vocab_size, self.source)
        return tokenizer

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


def check_tokenizer_vocab(tokenizer: Any, vocab_size: int, source: str) -> None:
    """Refuse a tokenizer that can produce ids the model has no embedding row for.

    A tokenizer smaller than the config's ``vocab_size`` is normal (tables padded to a multiple
    of 64 or 128, e.g. Qwen2.5's 151936 rows for 151665 tokens); a larger one is a tokenizer
    from another checkpoint, and its extra ids would fail deep inside the embedding gather.
    """
    if tokenizer is None:
        return
    size = len(tokenizer)  # includes added tokens, which the tokenizer also emits
    if size > vocab_size:
        raise ModelLoadError(
            f"{source}: the tokenizer has {size} tokens but the model's vocab_size is {vocab_size}, so ids "
            f"{vocab_size} to {size - 1} have no embedding row; use the tokenizer files saved with these weights "
            "(or correct vocab_size in config.json if the weights really have more rows)"
        )


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
    if max_context is not None and max_context > max(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT):
        # refused before RoPE tables that long are allocated (--context 10**12 would ask for terabytes)
        raise ModelLoadError(f"--context {max_context} exceeds the model's limit of {cfg.max_position_embeddings} "
                             f"tokens (max_position_embeddings): use at most {cfg.max_position_embeddings}")
    if kind == "hf":
        tensors = undo_norm_offset(cfg, tensors)
    model = build_decoder(cfg, tensors, str(path), max_context)
    return LoadedModel(spec, str(path), cfg, hf_config, model, tokenizer)
