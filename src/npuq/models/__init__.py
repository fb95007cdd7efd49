"""Load a model from any source into the static decoder: config + float weights + tokenizer."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from npuq.errors import ModelLoadError, NpuqError
from npuq.models import gguf_cache
from npuq.models.config import ModelConfig, config_from_hf
from npuq.models.decoder import StaticDecoder, rope_tables
from npuq.models.sources import (BUILTINS, gguf_tokenizer, hf_checkpoint, hf_tokenizer, read_gguf, read_gguf_shapes,
                                 read_hf_config, read_hf_folder, resolve)
from npuq.models.stream import StreamedDecoder
from npuq.models.weights import Checkpoint
from npuq.resources import USABLE_FRACTION, available_memory, gib

__all__ = ["BUILTINS", "LoadedModel", "ModelConfig", "StaticDecoder", "StreamedDecoder", "load_model", "build_decoder",
           "model_info", "open_model", "open_streamed", "layer_bytes"]

DEFAULT_MAX_CONTEXT = 4096

log = logging.getLogger("npuq.models")


@dataclass
class LoadedModel:
    name: str  # what the user passed
    source: str  # the file or folder read
    config: ModelConfig
    hf_config: Any  # transformers PretrainedConfig (from the GGUF cache: one that loads on first use)
    model: StaticDecoder | StreamedDecoder
    _tokenizer_factory: Any
    _encoder_factory: Any = None  # () -> a light stand-in for encoding text, or None

    @functools.cached_property
    def tokenizer(self) -> Any:
        tokenizer = self._tokenizer_factory()
        check_tokenizer_vocab(tokenizer, self.config.vocab_size, self.source)
        return tokenizer

    @functools.cached_property
    def encoder(self) -> Any:
        """What encodes calibration and evaluation text (``encode`` without special tokens,
        ``decode``, BOS/EOS ids): the GGUF cache's light stand-in for the tokenizer when there is
        one (the same ids, without importing transformers), else the tokenizer itself."""
        if "tokenizer" not in self.__dict__ and self._encoder_factory is not None:
            encoder = self._encoder_factory()
            if encoder is not None:
                check_tokenizer_vocab(encoder, self.config.vocab_size, self.source)
                return encoder
        return self.tokenizer

    def info(self) -> ModelDescription:
        return describe(self.name, self.source, self.config)


def model_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """(parameters with a tied lm head counted once, bytes of the float32 StaticDecoder's
    parameters, whose lm head is always its own copy), from the shapes ``cfg`` gives: nothing
    is allocated."""
    with torch.device("meta"):
        skeleton = StaticDecoder(cfg, 1)
    tied = cfg.tie_word_embeddings
    parameters = sum(p.numel() for n, p in skeleton.named_parameters() if n != "lm_head.weight" or not tied)
    return parameters, sum(p.numel() for p in skeleton.parameters()) * 4


def layer_bytes(cfg: ModelConfig) -> list[int]:
    """Bytes of the float32 StaticDecoder's parameters by decoder layer, the embedding table
    counted with the first layer and the final norm and lm head (always its own copy) with the
    last: what each part of a model quantized in parts holds (:meth:`StreamedDecoder.part_names`).
    They sum to ``model_sizes(cfg)[1]``; nothing is allocated."""
    with torch.device("meta"):
        skeleton = StaticDecoder(cfg, 1)
    sizes = [0] * cfg.num_layers
    for name, p in skeleton.named_parameters():
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
        else:
            layer = 0 if name.startswith("embed_tokens.") else cfg.num_layers - 1
        sizes[layer] += p.numel() * 4
    return sizes


@dataclass(frozen=True)
class ModelDescription:
    """What ``npuq info`` prints and ``npuq run``'s model stage records: the config's sizes and
    the parameter count, from the shapes alone."""

    model: str  # as given (built-in name or path)
    source: str  # the file or folder read
    architecture: str
    parameters: int  # a tied lm head counted once
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    tied_embeddings: bool
    sliding_window_layers: int
    nope_layers: int
    float32_bytes: int  # the StaticDecoder's parameters as float32 (its lm head always its own)


def describe(name: str, source: str, cfg: ModelConfig) -> ModelDescription:
    """What ``npuq info`` prints."""
    parameters, float32_bytes = model_sizes(cfg)
    return ModelDescription(
        model=name, source=source, architecture=cfg.arch, parameters=parameters, layers=cfg.num_layers,
        hidden_size=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size, context_length=cfg.max_position_embeddings,
        tied_embeddings=cfg.tie_word_embeddings, sliding_window_layers=sum(t == "sliding" for t in cfg.layer_types),
        nope_layers=sum(not r for r in cfg.use_rope), float32_bytes=float32_bytes,
    )


def model_info(spec: str) -> ModelDescription:
    """``npuq info``: the config and the checkpoint's tensor names and shapes, checked against
    each other; no weight is read (a 7B folder is described in seconds, in little memory)."""
    kind, path = resolve(spec)
    if kind == "hf":
        cfg = config_from_hf(read_hf_config(path))
        shapes = hf_checkpoint(path).shapes()
    else:
        entry = gguf_cache.entry_for(path)
        if entry is not None and entry.check() is None:
            cfg, shapes = entry.model_config(), Checkpoint([entry.weights]).shapes()
        else:
            hf_config, shapes = read_gguf_shapes(path)
            cfg = config_from_hf(hf_config)
    with torch.device("meta"):
        StaticDecoder(cfg, 1).check_shapes(shapes, str(path))
    return describe(spec, str(path), cfg)


def model_config(spec: str, max_context: int | None = None) -> ModelConfig:
    """The config of ``spec`` as :func:`load_model` would build it, from its config file or GGUF
    header alone (no weight is read): to plan a run before choosing how to load the model."""
    kind, path = resolve(spec)
    if kind == "hf":
        return _model_config(read_hf_config(path), max_context)
    entry = gguf_cache.entry_for(path)
    if entry is not None and entry.check() is None:
        return _check_context(entry.model_config(), max_context)
    return _model_config(read_gguf_shapes(path)[0], max_context)


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


def build_decoder(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str, max_context: int | None = None,
                  own: bool = False) -> StaticDecoder:
    """A StaticDecoder with checked weights; RoPE tables cover ``max_context`` positions.

    ``own``: the tensors are the caller's to give away and become the parameters without a copy
    (no second copy of the weights in memory); otherwise they are copied and the caller's stay untouched.
    """
    max_context = _rope_length(cfg, max_context)
    with torch.device("meta"):  # skip random initialisation: every parameter is overwritten
        model = StaticDecoder(cfg, max_context)
    tensors = model.check_weights(tensors, source)  # before allocating what the config claims
    if own:
        model.adopt_weights(tensors)
    else:
        model = model.to_empty(device="cpu")
        model.load_weights(tensors, source, checked=True)
    # RoPE tables are no checkpoint tensors (and to_empty left them uninitialised): computed here.
    model.rope_cos, model.rope_sin = rope_tables(cfg.rope, cfg.head_dim, max_context)
    if cfg.local_rope is not None:
        model.local_rope_cos, model.local_rope_sin = rope_tables(cfg.local_rope, cfg.head_dim, max_context)
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise AssertionError(f"build_decoder left {', '.join(left)} on the meta device")
    return model.eval()


def _rope_length(cfg: ModelConfig, max_context: int | None) -> int:
    """Positions the RoPE tables cover: ``max_context``, else the model's limit up to 4096."""
    return max_context or min(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT)


def load_model(spec: str, max_context: int | None = None) -> LoadedModel:
    """Load ``spec`` (built-in name, Hugging Face folder or .gguf file) as a float32 StaticDecoder.

    A GGUF is converted once; later loads read the conversion from the user cache
    (:mod:`npuq.models.gguf_cache`) through the same checks as a Hugging Face folder.
    """
    kind, path = resolve(spec)
    if kind == "gguf":
        return _load_gguf(spec, path, max_context)
    hf_config, checkpoint, tokenizer = read_hf_folder(path)
    cfg = _model_config(hf_config, max_context)
    guard_model_memory(cfg, str(path))
    model = build_decoder(cfg, undo_norm_offset(cfg, checkpoint.load()), str(path), max_context)
    return LoadedModel(spec, str(path), cfg, hf_config, model, tokenizer)


def open_streamed(spec: str, max_context: int | None = None, progress: bool = False) -> LoadedModel:
    """``spec`` as a :class:`StreamedDecoder`: the weights stay on disk and are read one block
    at a time (docs/design.md §13). A GGUF streams from its cache entry (converted first if
    needed); with the cache off (``NPUQ_NO_MODEL_CACHE``) it is loaded whole."""
    kind, path = resolve(spec)
    if kind == "hf":
        hf_config = read_hf_config(path)
        cfg = _model_config(hf_config, max_context)
        checkpoint = hf_checkpoint(path)
        model = StreamedDecoder(cfg, checkpoint, _rope_length(cfg, max_context), norm_offset=True, progress=progress)
        return LoadedModel(spec, str(path), cfg, hf_config, model, hf_tokenizer(path))
    entry = gguf_cache.entry_for(path)
    if entry is None:
        return load_model(spec, max_context)
    if entry.check() is not None:
        _convert(path, entry, max_context)
    cached = _load_cached(spec, path, entry, max_context, stream=True, progress=progress)
    return cached if cached is not None else load_model(spec, max_context)


def open_model(spec: str, max_context: int | None = None, stream: bool | None = None) -> LoadedModel:
    """``spec`` loaded whole (:func:`load_model`) where its float32 weights fit the memory this
    process may use, else streamed (:func:`open_streamed`, one block resident at a time);
    ``stream`` True or False decides instead."""
    if stream is None:
        stream = not model_fits(model_config(spec, max_context))
    return open_streamed(spec, max_context=max_context) if stream else load_model(spec, max_context=max_context)


def model_fits(cfg: ModelConfig) -> bool:
    """Whether the float32 model of ``cfg`` fits the memory this process may use (what
    :func:`guard_model_memory` refuses otherwise)."""
    return model_sizes(cfg)[1] <= USABLE_FRACTION * available_memory()


def guard_model_memory(cfg: ModelConfig, source: str) -> None:
    """Refuse, before anything is read, a model whose float32 weights cannot fit the memory this
    process may use (docs/design.md §13): the kernel would kill the run half-way, silently."""
    needed, available = model_sizes(cfg)[1], available_memory()
    if not model_fits(cfg):
        raise NpuqError(
            f"{source}: the model needs {gib(needed)} as float32 but only {gib(available)} of memory is available "
            f"(at most {USABLE_FRACTION:.0%} of it is used): it does not fit this machine whole. 'npuq info' reads "
            "shapes only, 'npuq eval --model ... --stream' scores it block by block, and quantize (one-pass "
            "calibration, on the CPU), export, generate and run stream it on their own; what was asked here needs "
            "it whole: use a machine with more memory")


def load_tokenizer(spec: str) -> Any:
    """The tokenizer of ``spec`` without loading its weights: a Hugging Face folder's files; a
    GGUF's cached conversion when one is there, else built from the GGUF's metadata."""
    kind, path = resolve(spec)
    if kind == "hf":
        return hf_tokenizer(path)()
    entry = gguf_cache.entry_for(path)
    if entry is not None and entry.check() is None:
        try:
            return hf_tokenizer(entry.folder)()
        except ModelLoadError:
            pass  # a damaged entry: the GGUF still has it
    return gguf_tokenizer(path)


def _model_config(hf_config: Any, max_context: int | None) -> ModelConfig:
    return _check_context(config_from_hf(hf_config), max_context)


def _check_context(cfg: ModelConfig, max_context: int | None) -> ModelConfig:
    if max_context is not None and max_context > max(cfg.max_position_embeddings, DEFAULT_MAX_CONTEXT):
        # refused before RoPE tables that long are allocated (--context 10**12 would ask for terabytes)
        raise ModelLoadError(f"--context {max_context} exceeds the model's limit of {cfg.max_position_embeddings} "
                             f"tokens (max_position_embeddings): use at most {cfg.max_position_embeddings}")
    return cfg


def _load_gguf(spec: str, path: Path, max_context: int | None) -> LoadedModel:
    entry = gguf_cache.entry_for(path)
    if entry is not None:
        loaded = _load_cached(spec, path, entry, max_context)
        if loaded is not None:
            return loaded
    hf_config, tensors, tokenizer, cfg = _convert(path, entry, max_context)
    if entry is not None:
        loaded = _load_cached(spec, path, entry, max_context)
        if loaded is not None:
            return loaded
    guard_model_memory(cfg, str(path))
    # GGUF norms need no offset (llama.cpp added it); the decoded tensors are ours to give away.
    model = build_decoder(cfg, tensors.load(), str(path), max_context, own=True)
    return LoadedModel(spec, str(path), cfg, hf_config, model, tokenizer)


def _convert(path: Path, entry: gguf_cache.Entry | None, max_context: int | None) -> tuple[Any, Any, Any, ModelConfig]:
    """Read a GGUF's config, tokenizer and tensor table, check names and shapes against the
    config before any tensor is decoded, and stream the conversion into ``entry`` (tensor by
    tensor, each checked as it is written: docs/design.md §13) when there is one.
    Returns (transformers config, the lazy tensors, tokenizer factory, ModelConfig)."""
    hf_config, tensors, tokenizer = read_gguf(path)
    cfg = _model_config(hf_config, max_context)
    with torch.device("meta"):
        StaticDecoder(cfg, 1).check_shapes(tensors.shapes(), str(path))
    if entry is not None:
        entry.store(hf_config, tokenizer(), tensors, cfg)
    return hf_config, tensors, tokenizer, cfg


def _load_cached(spec: str, path: Path, entry: gguf_cache.Entry, max_context: int | None,
                 stream: bool = False, progress: bool = False) -> LoadedModel | None:
    """The model from ``entry``, with every tensor checked for name, shape and finiteness as from
    any checkpoint; None, after removing the entry, when it is absent or fails any check."""
    problem = entry.check()
    if problem is not None:
        reason, warn = problem
        if reason != "absent":
            entry.discard(reason, warn)
        return None
    try:
        cfg = entry.model_config()
    except Exception as exc:  # whatever is wrong with a cache entry, the GGUF is still there
        entry.discard(_reason(exc))
        return None
    _check_context(cfg, max_context)  # a --context beyond the model's limit is the user's error
    if not stream:
        guard_model_memory(cfg, str(path))  # the user's machine, not the entry, is too small
    try:
        # memory-mapped copy-on-write from a file only npuq writes (atomically): ours to give away
        checkpoint = Checkpoint([entry.weights], str(entry.folder))
        if stream:
            model = StreamedDecoder(cfg, checkpoint, _rope_length(cfg, max_context), progress=progress)
        else:
            model = build_decoder(cfg, checkpoint.load(), str(entry.folder), max_context, own=True)
    except MemoryError:
        raise
    except Exception as exc:
        entry.discard(_reason(exc))
        return None
    entry.remember()
    cached_tokenizer = hf_tokenizer(entry.folder)

    def tokenizer() -> Any:
        try:
            return cached_tokenizer()
        except ModelLoadError as exc:  # damaged after the load's checks: the GGUF still has it
            entry.discard(str(exc))
            return gguf_tokenizer(path)

    def encoder() -> Any:
        try:
            return entry.encoder()
        except ModelLoadError as exc:  # damaged after the load's checks: the tokenizer still serves
            log.warning("npuq: warning: %s; encoding with the tokenizer instead", exc)
            return None

    return LoadedModel(spec, str(path), cfg, gguf_cache.CachedHFConfig(entry.folder), model, tokenizer, encoder)


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, NpuqError) else f"{type(exc).__name__}: {exc}"
