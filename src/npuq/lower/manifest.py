"""manifest.json of an export folder as records: written with :func:`npuq.records.to_json`
and read back with :func:`npuq.records.from_json`, so its fields are defined once, here.

Each record checks on construction what a runner relies on (the checks that need the folder,
graph files inside it and present, are :func:`read_manifest`'s): the format,
the model config, a context of at least 2, per graph a distinct ar_len from 1 to the context
and its inputs and outputs (names, dtypes, shapes, encodings) as
:class:`npuq.lower.ort.OrtGraph` uses them. Messages say what is wrong; the reader adds the
file and what to do.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npuq.errors import NpuqError
from npuq.fsio import read_json, resolve_inside
from npuq.models.config import ModelConfig
from npuq.records import from_json, optional_key

KV_PREFIXES = ("k_cache_", "v_cache_", "k_new_", "v_new_")  # the KV-cache inputs and outputs of both graphs
GENAI_CACHES = ("windowed", "shared")  # the KV-cache contracts of an onnxruntime-genai folder (npuq.lower.genai)

EXPORT_FORMAT = "npuq-export/1"
SHARDED_FORMAT = "npuq-export/2"  # an export in shards: ``shards`` lists them, ``graphs`` is absent
IO_DTYPES = ("float32", "float16", "int64", "int32", "int16", "uint16", "int8", "uint8", "bool")


def _numbers(v: float | tuple[float, ...] | int | tuple[int, ...]) -> tuple:
    """A number or a tuple of numbers, as a tuple of them."""
    return v if isinstance(v, tuple) else (v,)


@dataclass(frozen=True)
class IOEncoding:
    """The encoding of a quantized graph input or output (QNN convention: offset = -zero_point);
    scale and zero point are one number per tensor, or one per channel along ``axis``."""

    dtype: str  # storage type of the codes
    bits: int
    qmin: int
    qmax: int
    scale: float | tuple[float, ...]
    zero_point: int | tuple[int, ...]
    axis: int | None = optional_key()
    block_size: int | None = optional_key()

    def __post_init__(self) -> None:
        scales, zero_points = _numbers(self.scale), _numbers(self.zero_point)
        ok = (self.dtype in IO_DTYPES and self.qmin < self.qmax and scales and zero_points
              and all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in scales)
              and all(isinstance(z, int) and self.qmin <= z <= self.qmax for z in zero_points))
        if not ok:
            raise NpuqError("an encoding needs a dtype, qmin < qmax, scale > 0 and zero_point within [qmin, qmax]")


@dataclass(frozen=True)
class IOEntry:
    """One graph input or output as a runner feeds or reads it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy name: float32, int64, uint16, ...
    encoding: IOEncoding | None = optional_key()  # set when the tensor holds quantized codes

    def __post_init__(self) -> None:
        if not self.name:
            raise NpuqError("an entry has no name")
        if self.dtype not in IO_DTYPES:
            raise NpuqError(f"{self.name:.60}: dtype {self.dtype!r:.40} is not one of {', '.join(IO_DTYPES)}")
        if any(d < 0 for d in self.shape):
            raise NpuqError(f"{self.name:.60}: shape {list(self.shape)!r:.60} has a negative size")


@dataclass(frozen=True)
class PartRef:
    """One part of the artifact inside a graph exported from an artifact quantized in parts: its
    layers, and the prefix its nodes' and tensors' names carry (``partK/``). The graph can be run
    part by part (:func:`npuq.lower.ort.load_export`), cut at the ``hidden_<L>`` codes between them."""

    prefix: str
    layers: tuple[int, int]  # first, end


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the export: its file (inside the folder), how many tokens a call takes, and
    its inputs and outputs in call order."""

    file: str
    external_data: str | None  # the weights file beside a model too large for one protobuf
    sha256: str
    ar_len: int
    inputs: tuple[IOEntry, ...]
    outputs: tuple[IOEntry, ...]
    builders: dict[str, str]  # op → builder variant used
    notes: tuple[dict[str, Any], ...]  # lowering decisions: kind, node and their details
    # --genai windowed: the KV-cache I/O is declared [KV, 1, ...] (onnxruntime-genai's NPU layout)
    # instead of [1, KV, ...]; a runner swaps the first two axes (batch 1: the same bytes)
    kv_heads_first: bool | None = optional_key()
    # the artifact's parts in this graph, in order (exported from an artifact in parts); None: one program
    parts: tuple[PartRef, ...] | None = optional_key()

    def __post_init__(self) -> None:
        for side in ("inputs", "outputs"):
            if not getattr(self, side):
                raise NpuqError(f"{side} missing or empty")


@dataclass(frozen=True)
class ShardEntry:
    """One shard of a sharded export: layers first … end - 1 (the first shard holds the
    embedding, the last the final norm and head) and its decode and prefill graphs. A shard
    takes and returns the hidden states at its boundaries (``hidden_<L>``: what enters layer L,
    as quantized codes) and its own layers' caches."""

    layers: tuple[int, int]  # first, end
    graphs: dict[str, GraphEntry]  # decode, prefill

    def __post_init__(self) -> None:
        first, end = self.layers
        if not 0 <= first < end:
            raise NpuqError(f"shard layers {list(self.layers)} are not first < end")
        if not self.graphs:
            raise NpuqError("a shard lists no graphs")


def shard_tag(k: int, count: int) -> str:
    """What the files of shard ``k`` (from 0) of ``count`` carry in their names (nothing for one)."""
    return "" if count == 1 else f".part-{k + 1}-of-{count}"


@dataclass(frozen=True)
class ArtifactRef:
    """The artifact the export was lowered from."""

    path: str
    format: str
    npuq_version: str | None


@dataclass(frozen=True)
class TokenizerRef:
    """The model whose tokenizer goes with the graphs (the artifact's model name and source)."""

    model: str | None
    source: str | None


@dataclass(frozen=True)
class TargetInfo:
    """What the graphs were lowered for (npuq.lower.target)."""

    qnn_version: str | None
    qnn_version_source: str | None
    htp_arch: int | None
    soc: str | None


@dataclass(frozen=True)
class LoweringChoices:
    """The ``npuq export`` options that changed the lowering."""

    embedding_pattern: str
    embedding_storage: str


@dataclass(frozen=True)
class GraphEncodingsFile:
    """One graph's encodings in AIMET's format 1.0.0, named as AIMET's QDQ importer names the
    tensors of that graph, for its ``load_encodings_to_sim`` (docs/design.md §11)."""

    file: str  # <graph>.encodings.json
    sha256: str
    activations: int  # entries of each list
    params: int


@dataclass(frozen=True)
class EncodingsFile:
    """The export's encodings in AIMET's format 1.0.0: one file for every graph, and one per
    graph for AIMET's loader (docs/design.md §11)."""

    file: str
    format: str  # "aimet-1.0.0"
    sha256: str
    activations: int  # entries of each list
    params: int
    graphs: dict[str, GraphEncodingsFile] | None = optional_key()  # absent in exports of npuq before them


@dataclass(frozen=True)
class ContextEntry:
    """One graph compiled to a QNN context binary: an EPContext model and the binary it loads."""

    file: str  # <graph>_ctx.onnx
    binary: str  # the .bin it names (weight-shared contexts name the same one)
    file_bytes: int
    binary_bytes: int
    seconds: float  # compile time

    def __post_init__(self) -> None:
        if not self.file or not self.binary:
            raise NpuqError("a compiled context needs its file and its binary")


@dataclass(frozen=True)
class CompiledContexts:
    """``npuq export --compile``: QNN HTP context binaries of the graphs (docs/design.md §11)."""

    compiler: str  # onnxruntime and onnxruntime-qnn versions
    qnn_version: str | None  # QNN SDK of the compiler (its build id)
    htp_arch: int  # what the contexts were compiled for (and must be loaded with)
    soc: str | None
    share_weights: bool  # one binary for all graphs
    verified: str  # where loading them is verified: "emulator and device" or "device only"
    graphs: dict[str, ContextEntry]  # decode, prefill

    def __post_init__(self) -> None:
        if not self.graphs:
            raise NpuqError("compiled contexts list no graphs")


@dataclass(frozen=True)
class GenaiFolder:
    """``npuq export --genai``: the onnxruntime-genai model folder written into the export
    (docs/design.md §11)."""

    config: str  # genai_config.json
    cache: str  # windowed | shared: the KV-cache contract
    model_type: str  # decoder-pipeline
    window: int  # tokens per prompt call (the prefill graph's ar_len)
    pad_value: int | None  # windowed: what the runtime fills empty cache slots with
    stages: tuple[str, ...]  # the pipeline's ONNX files, in order
    tokenizer: tuple[str, ...]  # tokenizer files
    verified: str  # where npuq checked it runs
    chat_template: str | None = optional_key()  # the tokenizer file holding the model's chat template, if it has one

    def __post_init__(self) -> None:
        if self.cache not in GENAI_CACHES:
            raise NpuqError(f"genai cache {self.cache!r:.40} is not {' or '.join(GENAI_CACHES)}")
        if not self.stages or not self.config:
            raise NpuqError("the genai record lists no config or no stages")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """manifest.json: everything a runner needs besides the graph files. An export in one
    piece lists its graphs in ``graphs``; a sharded one (format :data:`SHARDED_FORMAT`) lists its
    shards in order in ``shards``, each with its graphs (:meth:`graph_entries` lists either)."""

    format: str
    npuq_version: str
    artifact: ArtifactRef
    model_config: dict[str, Any]  # ModelConfig.to_dict(); read with :attr:`cfg`
    context: int
    tokenizer: TokenizerRef
    target: TargetInfo
    opset: int
    kv_cache: str
    embedding_pattern: str  # the pattern chosen (plain, legacy, optimized, or several joined by commas)
    embeddings: dict[str, dict[str, Any]]  # per embedding node: the pattern and why
    options: LoweringChoices
    graphs: dict[str, GraphEntry] | None = optional_key()  # decode, prefill; None (no key): sharded
    encodings: EncodingsFile | None = optional_key()  # absent in exports of npuq before it
    compiled: CompiledContexts | None = optional_key()  # with --compile only
    genai: GenaiFolder | None = optional_key()  # with --genai only
    shards: tuple[ShardEntry, ...] | None = optional_key()  # a sharded export's shards, in order

    def __post_init__(self) -> None:
        expected = EXPORT_FORMAT if self.shards is None else SHARDED_FORMAT
        if self.format != expected:
            raise NpuqError(f"manifest format {self.format!r:.60} is not {expected!r}")
        cfg = ModelConfig.from_dict(self.model_config)  # a wrong key, type or value is an NpuqError
        if self.context < 2:
            raise NpuqError(f"context {self.context} is not a whole number of at least 2")
        if self.graphs is not None and self.shards is not None:
            raise NpuqError("give 'graphs' (an export in one piece) or 'shards' (a sharded one), not both")
        if self.shards is None and not self.graphs:
            raise NpuqError("'graphs' is missing or empty")
        if self.shards is not None and not self.shards:
            raise NpuqError("'shards' is empty")
        if self.shards is not None:
            ends = [0] + [s.layers[1] for s in self.shards]
            if [s.layers[0] for s in self.shards] != ends[:-1] or ends[-1] != cfg.num_layers:
                raise NpuqError(f"the shards' layers {[list(s.layers) for s in self.shards]} do not cover layers 0 to "
                                f"{cfg.num_layers} in order")
            if len({tuple(s.graphs) for s in self.shards}) != 1:
                raise NpuqError("the shards do not all have the same graphs")
        for graphs in [self.graphs] if self.shards is None else [s.graphs for s in self.shards]:
            seen: set[int] = set()
            for kind, entry in graphs.items():
                if not 1 <= entry.ar_len <= self.context or entry.ar_len in seen:
                    raise NpuqError(f"graph {kind!s:.40}: ar_len {entry.ar_len} is not a distinct whole number from 1 "
                                    f"to {self.context}")
                seen.add(entry.ar_len)
        if self.compiled is not None and set(self.compiled.graphs) != set(self.graph_entries()):
            raise NpuqError(f"compiled contexts of {sorted(self.compiled.graphs)} do not match the graphs "
                            f"{sorted(self.graph_entries())}")

    def graph_entries(self) -> dict[str, GraphEntry]:
        """Every graph of the export by name: ``decode`` and ``prefill``, or in a sharded export
        ``decode.part-K-of-N`` and ``prefill.part-K-of-N`` of each shard in order."""
        if self.shards is None:
            return dict(self.graphs or {})
        n = len(self.shards)
        return {f"{kind}{shard_tag(k, n)}": entry for k, s in enumerate(self.shards) for kind, entry in s.graphs.items()}

    @property
    def cfg(self) -> ModelConfig:
        """``model_config`` as the model's config (checked: a :class:`NpuqError` names what is wrong)."""
        return ModelConfig.from_dict(self.model_config)


def read_manifest(folder: str | os.PathLike) -> Manifest:
    """manifest.json of an export folder, checked before anything is opened: every field as its
    record checks it (:class:`Manifest`: the format, the model config, the
    context, per graph its ar_len and I/O specs as :class:`npuq.lower.ort.OrtGraph` uses them),
    then each graph's file, which must lie inside the folder and be there."""
    folder = Path(folder)
    where, again = f"--onnx {folder}", "export the artifact again"
    if not (folder / "manifest.json").is_file():
        raise NpuqError(f"{where}: no manifest.json; is this an `npuq export` folder?")
    data = read_json(folder / "manifest.json", where, again)
    if not isinstance(data, dict) or data.get("format") not in (EXPORT_FORMAT, SHARDED_FORMAT):  # before its keys
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise NpuqError(f"{where}: manifest format {found!r:.60} is not {EXPORT_FORMAT!r} or {SHARDED_FORMAT!r}; "
                        f"{again} with this npuq")
    try:
        manifest = from_json(Manifest, data, f"{where}: manifest.json")
    except NpuqError as exc:
        raise NpuqError(f"{exc}; {again}") from None
    for kind, entry in manifest.graph_entries().items():
        at = f"{where}, graph {kind!s:.40}"
        if not resolve_inside(folder, entry.file, at).is_file():
            raise NpuqError(f"{at}: {entry.file} is missing; {again}")
        if entry.external_data is not None:
            resolve_inside(folder, entry.external_data, at)
    if manifest.encodings is not None:
        resolve_inside(folder, manifest.encodings.file, f"{where}, encodings")
        for kind, entry in (manifest.encodings.graphs or {}).items():
            resolve_inside(folder, entry.file, f"{where}, encodings of graph {kind!s:.40}")
    if manifest.genai is not None:
        for name in (manifest.genai.config, *manifest.genai.stages):
            if not resolve_inside(folder, name, f"{where}, genai").is_file():
                raise NpuqError(f"{where}, genai: {name} is missing; {again} with --genai")
    if manifest.compiled is not None:
        for kind, c in manifest.compiled.graphs.items():
            at = f"{where}, compiled context {kind!s:.40}"
            for name in (c.file, c.binary):
                if not resolve_inside(folder, name, at).is_file():
                    raise NpuqError(f"{at}: {name} is missing; {again} with --compile")
    return manifest
