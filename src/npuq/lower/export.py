"""``npuq export``: a quantized artifact → decode.onnx + prefill.onnx + manifest.json.

    OUT/decode.onnx     AR-1 graph, opset 21 QDQ, static shapes, KV caches as quantized codes
    OUT/prefill.onnx    AR-N graph, same encodings
    OUT/encodings.json  the encodings of both graphs in AIMET's format 1.0.0, named by ONNX tensor
                        (npuq.lower.aimet, docs/design.md §11)
    OUT/decode.encodings.json, OUT/prefill.encodings.json   each graph's encodings as AIMET's QDQ
                        importer names them: what load_encodings_to_sim takes on that graph's sim
    OUT/<graph>_ctx.onnx + its .bin   with --compile: QNN HTP context binaries of both graphs
                        for the target's HTP arch (npuq.lower.compile, docs/design.md §11)
    OUT/genai_config.json, tokenizer files, genai_*.onnx   with --genai windowed|shared: the same
                        folder is an onnxruntime-genai model folder too (npuq.lower.genai, §11)
    OUT/<graph>.part-K-of-N.onnx, OUT/weights.part-K-of-N.data   an artifact quantized in parts
                        is exported in shards (--shards N|auto, npuq.lower.shards, docs/design.md §13):
                        each shard's decode and prefill graphs, their weights in one data file
    OUT/manifest.json   I/O names, shapes, dtypes and encodings; context; target (QNN version
                        and where it came from, HTP arch); the pattern chosen per embedding
                        and every other lowering decision; the tokenizer reference

Both graphs share their KV cache with the runner, so every cache input must carry the
encoding of the matching new-entries output, in both graphs alike: checked here.

:func:`npuq.lower.manifest.read_manifest` reads the folder back for the runtime: manifest.json
as its record (:class:`npuq.lower.manifest.Manifest`, which checks every field a runner uses),
then the graph files, refused when named outside the folder. The free disk is checked before
writing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import onnx
from google.protobuf.message import EncodeError
from tqdm import tqdm

from npuq import __version__
from npuq.fsio import atomic_dir, file_sha256, folder_lock
from npuq.errors import NpuqError
from npuq.lower.aimet import FORMAT_VERSION as AIMET_VERSION
from npuq.lower.aimet import graph_encodings, loadable_encodings, merge_encodings
from npuq.lower.compile import check_can_compile, compile_contexts
from npuq.lower import genai
from npuq.lower.manifest import (EXPORT_FORMAT, GENAI_CACHES, KV_PREFIXES, SHARDED_FORMAT, ArtifactRef, EncodingsFile,
                                 GraphEncodingsFile, GraphEntry, LoweringChoices, Manifest, ShardEntry, TargetInfo,
                                 TokenizerRef, PartRef, shard_tag)
from npuq.lower.onnx_writer import LoweredGraph, log_notes_once, lower_program, share_model_qdq_params
from npuq.lower.registry import EMBEDDING_NOTE, LowerOptions
from npuq.lower.shards import HIDDEN_PREFIX, ExternalData, ShardBuilder, part_io_names, part_prefix, plan_shards
from npuq.lower.target import Target, arch_of_soc, parse_htp_arch, parse_version, resolve_target
from npuq.models import load_tokenizer
from npuq.quantize.artifact import load_program, program_path, read_artifact, weights_path
from npuq.records import optional_key, to_json
from npuq.resources import check_free_disk, release_freed_memory

ENCODINGS_FILE = "encodings.json"  # AIMET 1.0.0 (the artifact's npuq-internal encodings.json is another format)
GRAPH_ENCODINGS_FILE = "{kind}.encodings.json"  # one graph's, as AIMET's QDQ importer names the tensors
PROTOBUF_LIMIT = 1_800_000_000  # bytes; larger models keep their weights in an external file
# Where an export's time goes, logged (DEBUG, logger npuq.lower.export) with the record
# attribute ``npuq_export_phases`` {phase: seconds}: reading the programs (graph JSON + weights), lowering them
# to ONNX models (and reading their AIMET encodings), encoding the models, writing the folder (files, sha256,
# manifest), compiling QNN contexts (--compile).
PHASES = ("load", "lower", "serialize", "write", "compile")
log = logging.getLogger("npuq.lower.export")


@contextmanager
def _timed(phases: dict[str, float], phase: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        phases[phase] += time.perf_counter() - start


def io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Graph input and output names, in the static decoder's order (docs/design.md §2)."""
    inputs = ["tokens", "mask", "positions"] + [f"k_cache_{i}" for i in range(num_layers)] + \
             [f"v_cache_{i}" for i in range(num_layers)]
    outputs = ["logits"] + [f"k_new_{i}" for i in range(num_layers)] + [f"v_new_{i}" for i in range(num_layers)]
    return inputs, outputs


def is_kv(name: str) -> bool:
    return name.startswith(KV_PREFIXES)


def is_carried(name: str) -> bool:
    """I/O a runner carries from one call (or shard) to the next as quantized codes: the KV
    caches, and the hidden states at a shard's boundary."""
    return is_kv(name) or name.startswith(HIDDEN_PREFIX)


def check_kv_encodings(graphs: dict[str, LoweredGraph]) -> None:
    """Every cache input must have the encoding of its new-entries output, in every graph."""
    reference: dict[str, tuple[str, Any]] = {}
    for kind, g in graphs.items():
        outs = {s.name: s for s in g.outputs}
        for spec in g.inputs:
            if not spec.name.startswith(("k_cache_", "v_cache_")):
                continue
            new = outs.get(spec.name.replace("_cache_", "_new_"))
            if spec.encoding is None or new is None or new.encoding is None:
                raise NpuqError(
                    f"{kind}: {spec.name} or its new-entries output is not quantized; the artifact's "
                    "quantizer must quantize the KV cache (quantize again)"
                )
            if not spec.encoding.same_as(new.encoding):
                raise NpuqError(
                    f"{kind}: {spec.name} and {new.name} have different encodings, so the runner could not copy "
                    "new entries into the cache; quantize again with KV encodings shared"
                )
            key = spec.name
            if key in reference and not reference[key][1].same_as(spec.encoding):
                raise NpuqError(
                    f"{spec.name} differs between the {reference[key][0]} and {kind} graphs; they share one "
                    "cache, so quantize again (decode and prefill must share encodings)"
                )
            reference.setdefault(key, (kind, spec.encoding))


def _serialize(model: onnx.ModelProto) -> bytes | None:
    """The model's bytes when it fits one protobuf file (below PROTOBUF_LIMIT), else None."""
    try:
        data = model.SerializeToString()
    except (ValueError, EncodeError):  # protobuf refuses messages of 2 GiB and more
        return None
    return data if len(data) < PROTOBUF_LIMIT else None


def _save_external(model: onnx.ModelProto, path: Path) -> list[str]:
    data = path.name + ".data"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=data)
    return [path.name, data]


def _write(data: bytes, path: Path) -> str:
    """Write ``data`` (what onnx.save writes for the model) and return its sha256, hashed from
    memory in a second thread while the file is written (both release the GIL)."""
    with ThreadPoolExecutor(1) as pool:
        digest = pool.submit(lambda: hashlib.sha256(data).hexdigest())
        with open(path, "wb") as f:
            f.write(data)
        return digest.result()


def _embedding_summary(notes_by_graph: dict[str, list]) -> tuple[str, dict[str, dict]]:
    per_node: dict[str, dict] = {}
    for notes in notes_by_graph.values():
        for n in notes:
            if n.kind == EMBEDDING_NOTE:
                per_node[n.node] = dict(n.detail)
    patterns = sorted({d["pattern"] for d in per_node.values()})
    return (patterns[0] if len(patterns) == 1 else ",".join(patterns)) if patterns else "plain", per_node


@dataclass(frozen=True)
class ExportOptions:
    """What an export lowers for; each field is the ``npuq export`` flag of the same name.

    Checked on construction without reading the environment; :meth:`target` adds what the
    environment says (the SDK version of ``$QNN_SDK_ROOT`` or of onnxruntime-qnn).
    """

    qnn_version: str | None = None  # X.Y[.Z]; None: from the environment, else unknown
    htp_arch: int | None = None  # 68 ... 81; None: from soc, else unknown (8-bit attention matmul inputs)
    soc: str | None = None  # a chip name such as SM8650 (sets htp_arch)
    embedding_pattern: str = "auto"  # auto | legacy | optimized
    embedding_storage: str = "u16"  # u16 | int8-rowscale
    # --compile: QNN HTP context binaries too; --share-weights: one binary for both graphs (device
    # only). None when off, so the key of an export without them is what it was before them.
    compile: bool | None = optional_key()
    share_weights: bool | None = optional_key()
    # --genai windowed|shared: also an onnxruntime-genai folder with that KV-cache contract (None: off)
    genai: str | None = optional_key()
    # --shards N: the decoder in N shards of whole artifact parts; None (no key): auto, the fewest
    # whose weights each fit one QNN HTP context (npuq.lower.shards.SHARD_BYTES)
    shards: int | None = optional_key()

    def __post_init__(self) -> None:
        if self.htp_arch is not None and self.soc is not None:
            raise NpuqError("pass either --htp-arch or --soc, not both")
        for flag in ("compile", "share_weights"):
            if not getattr(self, flag):
                object.__setattr__(self, flag, None)
        if self.share_weights and not self.compile:
            raise NpuqError("--share-weights applies to compiled contexts: add --compile, or drop --share-weights")
        if self.compile and self.htp_arch is None and self.soc is None:
            raise NpuqError("--compile needs the target chip, since a QNN context binary runs on one HTP "
                            "architecture only: add --soc NAME (e.g. SM8650) or --htp-arch A (68, 69, 73, 75, 79, 81)")
        if self.genai is not None and self.genai not in GENAI_CACHES:
            raise NpuqError(f"--genai {self.genai!r:.40}: choose windowed (onnxruntime-genai's NPU cache, uint8 KV) "
                            "or shared (its CPU provider's cache)")
        if self.shards is not None and (not isinstance(self.shards, int) or isinstance(self.shards, bool)
                                        or self.shards < 1):
            raise NpuqError(f"--shards {self.shards!r:.40}: give a whole number of at least 1, or auto")
        if self.qnn_version is not None:
            parse_version(self.qnn_version)
        if self.htp_arch is not None:
            object.__setattr__(self, "htp_arch", parse_htp_arch(self.htp_arch))
        if self.soc is not None:
            arch_of_soc(self.soc)
            object.__setattr__(self, "soc", self.soc.strip().upper())
        self.lower_options()

    def lower_options(self) -> LowerOptions:
        return LowerOptions(self.embedding_pattern, self.embedding_storage)

    def target(self) -> Target:
        return resolve_target(self.qnn_version, self.htp_arch, self.soc)


@dataclass(frozen=True)
class ExportResult:
    qnn_version: str | None
    qnn_version_source: str | None
    htp_arch: int | None
    soc: str | None
    embedding_pattern: str  # the pattern chosen (plain, legacy, optimized, or several joined by commas)
    files: dict[str, str]  # decode, prefill, encodings, manifest (and decode_ctx, decode_ctx_bin, ...) → path
    seconds: float
    compile_seconds: float | None = optional_key()  # with --compile
    share_weights: bool | None = optional_key()  # with --compile --share-weights
    genai: str | None = optional_key()  # with --genai: the cache contract of the onnxruntime-genai folder
    shards: int | None = optional_key()  # a sharded export: how many shards (None: one piece)

    def describe(self) -> str:
        qnn = f"QNN {self.qnn_version} ({self.qnn_version_source})" if self.qnn_version else "QNN version unknown"
        arch = (f"HTP v{self.htp_arch}" + (f" ({self.soc})" if self.soc else "")) if self.htp_arch else "HTP arch unknown"
        text = f"{qnn}, {arch}; embedding pattern {self.embedding_pattern}"
        if self.compile_seconds is not None:
            shared = ", weights shared (verified only on a device)" if self.share_weights else ""
            text += f"; QNN contexts compiled in {self.compile_seconds:.1f} s{shared}"
        if self.genai is not None:
            text += f"; onnxruntime-genai folder ({self.genai} KV cache)"
        if self.shards is not None:
            text += f"; {self.shards} shards"
        return text


def export_artifact(
    artifact: str | os.PathLike,
    out: str | os.PathLike,
    options: ExportOptions = ExportOptions(),
    *,
    force: bool = False,
    target: Target | None = None,
) -> ExportResult:
    """Lower both programs of ``artifact`` and write the export folder ``out`` atomically.
    ``target``: already resolved from ``options`` (:meth:`ExportOptions.target`), else resolved here."""
    with folder_lock(out, "npuq export"):  # one writer per folder
        return _export(Path(artifact), Path(out), options, force, target)


def _export(artifact: Path, out: Path, options: ExportOptions, force: bool, target: Target | None) -> ExportResult:
    start = time.perf_counter()
    if out.exists() and not force:
        raise NpuqError(f"{out} already exists: pass --force to replace it, or choose another --out")
    if target is None:
        target = options.target()
    if options.compile:
        check_can_compile()
    config = read_artifact(artifact)
    cfg = config.cfg
    L = cfg.num_layers
    parts = [p.layers for p in config.parts] if config.parts is not None else [(0, L)]
    plan = plan_shards([weights_path(artifact, config, k).stat().st_size for k in range(len(parts))],
                       "auto" if options.shards is None else options.shards)
    count = len(plan)
    in_names, out_names = io_names(L)
    tokenizer = None
    if options.genai:  # refused before any lowering: a window the runtime cannot run, no tokenizer
        genai.check_window(config.context, config.programs["prefill"].ar_len if "prefill" in config.programs else 1)
        tokenizer = _tokenizer(config)

    phases = dict.fromkeys(PHASES, 0.0)
    kinds = ("decode", "prefill")
    lowered: dict[str, LoweredGraph] = {}  # each graph's I/O and notes, its proto dropped once written
    encodings: dict[str, tuple[dict, dict]] = {}  # AIMET entries of each graph, read before the proto goes
    loadable: dict[str, dict] = {}  # each graph's document for AIMET's loader (docs/design.md §11)
    sizes: list[int] = []
    files: dict[str, str] = {}
    shard_graphs: list[dict[str, GraphEntry]] = []
    compiled = None
    # Each graph is written as soon as it is lowered, so only one graph's proto (as big as the
    # weights) is ever in memory, not both until the end: Qwen2.5-Coder-1.5B's export peaked at
    # 10.0 GB instead of 12.9 GB (/usr/bin/time -v), with byte-identical graphs. A graph of
    # several parts holds one part's weights at a time (npuq.lower.shards).
    bar = tqdm(total=len(kinds) * len(parts), desc=f"exporting ({count} shard{'s' * (count > 1)})",
               unit="graph" if config.parts is None else "part", file=sys.stderr, leave=False)
    with bar, atomic_dir(out) as tmp:
        for k, (first_part, end_part) in enumerate(plan):
            tag = shard_tag(k, count)
            layers = (parts[first_part][0], parts[end_part - 1][1])
            shard_parts = range(first_part, end_part)
            weight_bytes = sum(weights_path(artifact, config, p).stat().st_size for p in shard_parts)
            data = None
            if config.parts is not None and weight_bytes > PROTOBUF_LIMIT // 2:  # written as each part is lowered
                contexts = 0 if not options.compile else weight_bytes * (1 if options.share_weights else len(kinds))
                check_free_disk(out, weight_bytes + contexts + (8 << 20), f"the export {out}")
                data = ExternalData(tmp / f"weights{tag}.data")
            graphs: dict[str, GraphEntry] = {}
            for i, kind in enumerate(kinds):
                name = f"{kind}{tag}"
                if config.parts is None:  # the artifact's one program, as a whole
                    g = _lower(artifact, config, kind, 0, target, options, in_names, out_names, f"{cfg.arch}_{kind}", phases)
                    encodings[name] = graph_encodings(g.model)
                    bar.update()
                else:  # one graph of the shard's parts
                    io = (in_names, out_names) if count == 1 else part_io_names(*layers, L)
                    g, encodings[name], docs = _merge_parts(artifact, config, kind, shard_parts, io, f"{cfg.arch}_{name}",
                                                            data, target, options, phases, bar)
                with _timed(phases, "lower"):
                    if options.genai:
                        io_entries = [s.entry() for s in g.inputs + g.outputs]
                        genai.check_io(cfg, kind, io_entries, options.genai)
                        if options.genai == "windowed":  # the runtime's cache layout (batch 1: the same bytes)
                            genai.heads_first(g.model, io_entries)
                            g.inputs, g.outputs = genai.heads_first_specs(g.inputs), genai.heads_first_specs(g.outputs)
                            share_model_qdq_params(g.model)  # the Q/DQ pairs of the new edges, as AIMET pairs them
                    # AIMET's names are those of the file as written (heads-first edges included); a graph of
                    # several parts: each part's document as its own graph names them, joined
                    if config.parts is None or options.genai == "windowed":
                        loadable[name] = loadable_encodings(g.model, None if options.genai == "windowed" else encodings[name])
                    else:
                        loadable[name] = {"version": AIMET_VERSION,
                                          "activation_encodings": [e for d in docs for e in d["activation_encodings"]],
                                          "param_encodings": [e for d in docs for e in d["param_encodings"]]}
                with _timed(phases, "serialize"):
                    # None: too big for one protobuf file (saved with external data), or its weights already are
                    blob = _serialize(g.model) if data is None else None
                # Before writing: this graph (its serialized size is exact; external data holds the same
                # bytes), each graph still to come at about its size (decode and prefill share the weights),
                # --compile's context binaries (each about its graph's weights again, once if shared), the
                # genai stage graphs and tokenizer (a few MB) and the encodings and manifest. A shard whose
                # weights went to its data file was checked for them (and its contexts) before it began.
                if data is None:
                    size = len(blob) if blob is not None else g.model.ByteSize()
                    expected = sizes + [size] * (len(kinds) * (count - k) - i)
                    contexts = 0 if not options.compile else (max(expected) if options.share_weights else sum(expected))
                    extra = ((16 << 20) if options.genai else 0) + (8 << 20)
                    check_free_disk(out, sum(expected) - sum(sizes) + contexts + extra, f"the export {out}")
                else:
                    size = weight_bytes if i == 0 else 0
                sizes.append(size)
                path = tmp / f"{name}.onnx"
                with _timed(phases, "write"):
                    if blob is not None:
                        written, digest = [path.name], _write(blob, path)
                        del blob
                    elif data is not None:  # the weights are in the data file already
                        onnx.save(g.model, path)
                        written, digest = [path.name, data.path.name], file_sha256(path)
                    else:
                        written = _save_external(g.model, path)
                        digest = file_sha256(tmp / written[0])
                lowered[name] = dataclasses.replace(g, model=onnx.ModelProto())
                del g
                files[name] = str(out / written[0])
                graphs[kind] = GraphEntry(
                    file=written[0],
                    external_data=written[1] if len(written) > 1 else None,
                    sha256=digest,
                    ar_len=config.programs[kind].ar_len,
                    inputs=tuple(s.entry() for s in lowered[name].inputs),
                    outputs=tuple(s.entry() for s in lowered[name].outputs),
                    builders=lowered[name].builders,
                    notes=tuple({"kind": n.kind, "node": n.node, **n.detail} for n in lowered[name].notes
                                if n.kind != EMBEDDING_NOTE),
                    kv_heads_first=True if options.genai == "windowed" else None,
                    parts=None if config.parts is None else tuple(
                        PartRef(part_prefix(p), parts[p]) for p in shard_parts),
                )
            if data is not None:
                data.close()
                files[f"weights{tag}"] = str(out / data.path.name)
            shard_graphs.append(graphs)
        check_kv_encodings(lowered)
        aimet = merge_encodings(encodings)  # decode and prefill must agree on every tensor they share
        aimet_text = json.dumps(aimet, separators=(",", ":")) + "\n"
        log_notes_once([n for g in lowered.values() for n in g.notes])
        pattern, per_node = _embedding_summary({k: g.notes for k, g in lowered.items()})
        writing = time.perf_counter()
        (tmp / ENCODINGS_FILE).write_text(aimet_text, encoding="utf-8")
        files["encodings"] = str(out / ENCODINGS_FILE)
        per_graph: dict[str, GraphEncodingsFile] = {}
        for name, doc in loadable.items():
            file = GRAPH_ENCODINGS_FILE.format(kind=name)
            (tmp / file).write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
            files[f"{name}_encodings"] = str(out / file)
            per_graph[name] = GraphEncodingsFile(file, file_sha256(tmp / file), len(doc["activation_encodings"]),
                                                 len(doc["param_encodings"]))
        all_graphs = {f"{kind}{shard_tag(k, count)}": e for k, g in enumerate(shard_graphs) for kind, e in g.items()}
        if options.compile:
            with _timed(phases, "compile"):
                compiled = compile_contexts(tmp, {k: e.file for k, e in all_graphs.items()}, target.htp_arch,
                                            target.soc, bool(options.share_weights))
            for name, c in compiled.graphs.items():
                files[f"{name}_ctx"], files[f"{name}_ctx_bin"] = str(out / c.file), str(out / c.binary)
        genai_record = None
        if options.genai:
            contexts = None  # what a windowed (NPU) folder runs; weight-shared contexts: device only, not wired
            if compiled is not None and not compiled.share_weights and options.genai == "windowed":
                contexts = {kind: c.file for kind, c in compiled.graphs.items()}
            genai_record = genai.write_folder(tmp, cfg, config.context, options.genai, shard_graphs, tokenizer, contexts,
                                              target.htp_arch)
            files["genai_config"] = str(out / genai_record.config)
        model_info = config.model
        manifest = Manifest(
            format=EXPORT_FORMAT if count == 1 else SHARDED_FORMAT,
            npuq_version=__version__,
            artifact=ArtifactRef(str(Path(artifact).resolve()), config.format, config.versions.get("npuq")),
            model_config=config.model_config,
            context=config.context,
            tokenizer=TokenizerRef(model_info.name if model_info else None, model_info.source if model_info else None),
            target=TargetInfo(
                qnn_version=str(target.qnn_version) if target.qnn_version else None,
                qnn_version_source=target.qnn_version_source,
                htp_arch=target.htp_arch,
                soc=target.soc,
            ),
            opset=21,
            kv_cache=("quantized codes: copy k_new_i / v_new_i outputs into k_cache_i / v_cache_i as they are; "
                      "fill slots no token has written with each cache input's zero point (the code of 0.0)"
                      + ("" if count == 1 else "; each shard takes its own layers' caches, and the hidden_<L> "
                         "codes one shard returns as the next one's input")),
            embedding_pattern=pattern,
            embeddings=per_node,
            options=LoweringChoices(options.embedding_pattern, options.embedding_storage),
            graphs=shard_graphs[0] if count == 1 else None,
            encodings=EncodingsFile(ENCODINGS_FILE, f"aimet-{AIMET_VERSION}", file_sha256(tmp / ENCODINGS_FILE),
                                    len(aimet["activation_encodings"]), len(aimet["param_encodings"]), per_graph),
            compiled=compiled,
            genai=genai_record,
            shards=None if count == 1 else tuple(
                ShardEntry((parts[a][0], parts[b - 1][1]), g) for (a, b), g in zip(plan, shard_graphs)),
        )
        (tmp / "manifest.json").write_text(json.dumps(to_json(manifest), indent=2) + "\n", encoding="utf-8")
        files["manifest"] = str(out / "manifest.json")
        phases["write"] += time.perf_counter() - writing - phases["compile"]  # compiled inside the folder
    log.debug("export %s: %s", out, ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()),
              extra={"npuq_export_phases": phases})
    return ExportResult(manifest.target.qnn_version, target.qnn_version_source, target.htp_arch, target.soc,
                        pattern, files, time.perf_counter() - start,
                        compile_seconds=round(phases["compile"], 3) if compiled else None,
                        share_weights=True if compiled and compiled.share_weights else None,
                        genai=options.genai, shards=count if count > 1 else None)


def _merge_parts(artifact: Path, config, kind: str, shard_parts: range, io: tuple[list[str], list[str]], name: str,
                 data: ExternalData | None, target: Target, options: ExportOptions, phases: dict[str, float],
                 bar: tqdm) -> tuple[LoweredGraph, tuple[dict, dict], list[dict]]:
    """Program ``kind`` of the artifact's parts ``shard_parts`` as one graph (npuq.lower.shards):
    (the graph, its AIMET entries, each part's document for AIMET's loader). Each part is
    lowered, renamed and its weights moved to ``data`` before the next is read."""
    L = config.cfg.num_layers
    layers = [p.layers for p in config.parts]
    builder = ShardBuilder(name, data)
    entries: tuple[dict, dict] = ({}, {})
    docs: list[dict] = []
    for p in shard_parts:
        part = _lower(artifact, config, kind, p, target, options, *part_io_names(*layers[p], L),
                      f"{name}_{p}", phases)
        with _timed(phases, "lower"):
            part = builder.rename(part, p)
            found = graph_encodings(part.model)
            for table, more in zip(entries, found):
                table.update(more)
            docs.append(loadable_encodings(part.model, found))
            builder.keep(part)
        del part
        # A part's program and lowering hold reference cycles: without a collection its weights
        # (and the mapping of its weights file) outlived it until Python's collector ran, every few
        # parts, so Qwen2.5-Coder-1.5B's export held four or five parts at once (4.55 GiB).
        release_freed_memory()
        bar.update()
    return builder.finish(*io), entries, docs


def _lower(artifact: Path, config, kind: str, part: int, target: Target, options: ExportOptions,
           in_names: list[str], out_names: list[str], graph_name: str, phases: dict[str, float]) -> LoweredGraph:
    """Program ``kind`` of part ``part`` of the artifact, lowered (its caches and the hidden
    states at a part's ends carried as quantized codes)."""
    with _timed(phases, "load"):
        # 16-bit codes as stored (uint16), not widened to int32: the lowering writes them as uint16
        program = load_program(program_path(artifact, config, kind, part), narrow=True)
    with _timed(phases, "lower"):
        return lower_program(program, target, options.lower_options(), in_names, out_names, is_carried,
                             graph_name=graph_name, log_warnings=False)


def _tokenizer(config) -> Any:
    """The artifact's model's tokenizer, for --genai (its recorded source when still there, else its name)."""
    model = config.model
    for spec, is_path in ((model.source if model else None, True), (model.name if model else None, False)):
        if spec and "\x00" not in spec and (not is_path or Path(spec).exists()):
            try:
                return load_tokenizer(spec)
            except NpuqError as exc:
                raise NpuqError(f"--genai needs the model's tokenizer: {exc}") from None
    raise NpuqError("--genai needs the model's tokenizer, but the artifact records no model it can be loaded from "
                    "(quantize again from a model folder, GGUF file or built-in name)")
