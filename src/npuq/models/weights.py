"""Checkpoint tensors read one at a time: the unit a streamed model is loaded in.

A :class:`Checkpoint` is a lazy view of a Hugging Face folder's safetensors files, one file or
many (``model.safetensors.index.json`` maps each tensor to its shard; without an index every
``*.safetensors`` file is read). Opening it reads only the files' headers: names, dtypes and
shapes, so a 7B model's folder (15 GB of bf16) is described in milliseconds. A tensor's bytes
are read when :meth:`Checkpoint.get` asks for it, as float32:

    float32 on disk     memory-mapped, copy-on-write: no memory until pages are touched
    bf16 / fp16         read and widened to float32 (exact: every bf16/fp16 value is a float32)

so a caller that asks for one block's tensors at a time holds one block, never the model
(docs/design.md §13).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open

from npuq.errors import ModelLoadError
from npuq.models.decoder import all_finite

INDEX_FILE = "model.safetensors.index.json"
FLOAT32_BYTES = 4
# safetensors dtype names → bytes per element (the ones a checkpoint of ours can hold).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def hf_name(key: str) -> str:
    """A checkpoint key under npuq's names: the Hugging Face key less its ``model.`` prefix
    (also ``model.language_model.`` and ``language_model.model.`` of multimodal wrappers)."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    key: str  # the name inside the file
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Checkpoint:
    """Lazy safetensors tensors under npuq's names (module docstring)."""

    def __init__(self, files: Iterable[Path], source: str | None = None) -> None:
        self.files = [Path(f) for f in files]
        self.source = source or (str(self.files[0].parent) if self.files else "checkpoint")
        self.entries: dict[str, TensorEntry] = {}
        for file in self.files:
            for key, (dtype, shape) in _header(file).items():
                name = hf_name(key)
                if name in self.entries:
                    raise ModelLoadError(f"{file}: tensor {key!r} is also in {self.entries[name].file.name}; "
                                         "a checkpoint holds each tensor once")
                self.entries[name] = TensorEntry(file, key, dtype, shape)

    @classmethod
    def of_folder(cls, folder: Path) -> Checkpoint:
        """The safetensors files of a Hugging Face folder: the shards its index names, else every
        ``*.safetensors`` file (sorted)."""
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                shards = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); "
                                     "it needs a \"weight_map\" object of tensor name → shard file") from None
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                raise ModelLoadError(f"{index} names shard(s) {', '.join(missing[:3])} that are not in {folder}: "
                                     "copy every shard of the checkpoint")
            return cls([folder / s for s in shards], str(folder))
        return cls(sorted(folder.glob("*.safetensors")), str(folder))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: e.shape for name, e in self.entries.items()}

    def float32_bytes(self, names: Iterable[str] | None = None) -> int:
        """Bytes the tensors ``names`` (default: all) take as float32."""
        chosen = self.entries.values() if names is None else (self.entries[n] for n in names)
        return sum(e.numel for e in chosen) * FLOAT32_BYTES

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as float32 (module docstring: mapped, or widened from bf16/fp16)."""
        return self.load((name,))[name]

    def load(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (default: all) as float32, file by file (each file opened once)."""
        wanted = list(self.entries) if names is None else list(names)
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            by_file.setdefault(self.entries[name].file, []).append(name)
        tensors: dict[str, torch.Tensor] = {}
        for file, chosen in by_file.items():
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in chosen:
                        tensors[name] = f.get_tensor(self.entries[name].key).float()
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise ModelLoadError(f"{file}: unreadable safetensors file (truncated or corrupt?): {exc}") from None
        return {name: tensors[name] for name in wanted}


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], get: Callable[[str], torch.Tensor]) -> None:
    """Write float32 tensors ``shapes`` (name → shape) to the safetensors file ``path``, asking
    ``get(name)`` for one tensor at a time, so the writer holds one tensor, never all of them.

    The layout is known before any tensor is: 8 bytes little-endian header length, the JSON
    header (each name's dtype, shape and byte range, in the order written; padded with spaces
    to a multiple of 8 bytes, as the reference writer does), then each tensor's bytes in that
    order, little-endian. A tensor with another shape, or with NaN/Inf values, stops the write
    with :class:`ModelLoadError` (the caller removes the half-written file)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        size = math.prod(shape) * FLOAT32_BYTES
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, shape in shapes.items():
            t = get(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != torch.float32:
                raise ModelLoadError(f"{path}: tensor {name} is {t.dtype} {tuple(t.shape)}, expected float32 {shape}")
            if not all_finite(t):
                raise ModelLoadError(f"{path}: tensor {name} contains NaN or Inf values")
            f.write(t.contiguous().numpy().astype("<f4", copy=False).tobytes())
            del t  # before the next tensor is decoded: one at a time


def _header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{key: (dtype, shape)} from a safetensors file's header, without reading any tensor; a
    file whose size is not what its header describes (a truncated copy) is refused here.

    Layout: 8 bytes little-endian header length N, then N bytes of JSON mapping each key to
    ``{"dtype", "shape", "data_offsets": [begin, end]}`` (and an optional ``__metadata__``),
    then the data: offsets count from the end of the header."""
    try:
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise ValueError("shorter than the 8-byte header length")
            size = int.from_bytes(prefix, "little")
            if size > 100 << 20:  # the format's own limit on the header
                raise ValueError(f"header of {size} bytes")
            raw = f.read(size)
            if len(raw) != size:
                raise ValueError(f"header cut short ({len(raw)} of {size} bytes)")
        header = json.loads(raw)
        out, data_end = {}, 0
        for key, value in header.items():
            if key == "__metadata__":
                continue
            dtype, shape = value["dtype"], tuple(int(d) for d in value["shape"])
            begin, end = (int(o) for o in value["data_offsets"])
            if dtype not in _DTYPE_BYTES or any(d < 0 for d in shape) or end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
                raise ValueError(f"tensor {key!r}: dtype {dtype!r}, shape {shape}, bytes {begin}..{end}")
            out[key] = (dtype, shape)
            data_end = max(data_end, end)
        actual = file.stat().st_size - 8 - size
        if actual != data_end:
            raise ValueError(f"its header describes {data_end} bytes of tensor data but the file holds {actual}")
        return out
    except OSError as exc:
        raise ModelLoadError(f"{file}: cannot read ({exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{file}: unreadable safetensors header (truncated or corrupt?): {exc}") from None
