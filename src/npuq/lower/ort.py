"""Run exported QDQ ONNX graphs with ONNX Runtime: exactly on the CPU, or on the QNN HTP
backend (in CPU emulation on x86-64 hosts, on the NPU on a device).

- :func:`cpu_session` disables graph optimizations: the default CPU provider rewrites int8
  per-channel MatMul into an int8-activation kernel, while the unoptimized graph computes
  QDQ semantics exactly (docs/design.md §9).
- :func:`htp_session` registers the onnxruntime-qnn plugin, points it at its HTP backend
  library and disables CPU fallback, so session creation proves the whole graph runs on the
  HTP. ``htp_arch`` must be the target chip's (v73+ for 16-bit × int16 MatMul).
- :func:`load_export` opens an export folder; on ``htp`` it loads the folder's compiled QNN
  contexts when it has them (``npuq export --compile``, docs/design.md §11), else the QDQ graphs.
  On the CPU each graph's weights are dequantized once, not at every call
  (:func:`dequantized_weights`: the same values, 3-4x faster calls).
- :class:`OrtGraph` is a graph callable for :class:`npuq.runtime.runner.StaticRunner`: it
  feeds KV caches as quantized codes and returns the new entries as codes, the way a device
  runner copies them, plus dequantized logits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto as T, helper, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor

from npuq.fsio import resolve_inside
from npuq.errors import NpuqError
from npuq.lower.manifest import GraphEntry, IOEncoding, IOEntry, Manifest, PartRef, read_manifest, shard_tag
from npuq.lower.onnx_writer import IR_VERSION
from npuq.lower.shards import HIDDEN_PREFIX, part_io_names
from npuq.runtime.runner import PartChain, Residency

DISABLE_CPU_FALLBACK = "session.disable_cpu_ep_fallback"
PROVIDERS = ("cpu", "htp")
_registered = False


def _ort():
    # onnxruntime (0.1 s) loads when a session is opened
    import onnxruntime

    return onnxruntime


def _model_arg(model) -> str | bytes:
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    return model.SerializeToString()


_arena_registered: bool | None = None  # None: not tried yet


def _shared_arena(ort) -> bool:
    """Register one CPU arena for every session of the process that asks for it, growing by
    what is requested (ONNX Runtime's default rounds each extension up to a power of two).
    False where this ONNX Runtime cannot: its sessions then keep their own arenas."""
    global _arena_registered
    if _arena_registered is None:
        try:
            cfg = ort.OrtArenaCfg(0, 1, -1, -1)  # no limit, kSameAsRequested, default chunk sizes
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, cfg)
            _arena_registered = True
        except Exception:  # noqa: BLE001  (an older or other build of ONNX Runtime: memory, not correctness)
            _arena_registered = False
    return _arena_registered


def cpu_session(model, threads: int = 1):
    """An exact QDQ session on the CPU provider (graph optimizations disabled).

    With graph optimizations off every weight is dequantized to float at each call, so a call
    allocates about 4x the graph's weight codes. Two settings keep that from multiplying:
    the memory pattern is off (it pre-plans one more block as large as a whole call's
    allocations), and sessions share one arena that grows by what is requested. Measured on
    `npuq eval --onnx` (1024 tokens of Qwen2.5-Coder-0.5B, 2048 of SmolLM2-135M), peak memory
    9.5 -> 7.4 GB and 2.72 -> 2.16 GB (with the decode graph opened only when called,
    :func:`load_export`), at the same speed."""
    ort = _ort()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = threads
    so.enable_mem_pattern = False
    if _shared_arena(ort):
        so.add_session_config_entry("session.use_env_allocators", "1")
    so.log_severity_level = 3
    return ort.InferenceSession(_model_arg(model), so, providers=["CPUExecutionProvider"])


def qnn_available() -> str | None:
    """None when the QNN HTP backend can be used, else the reason it cannot."""
    try:
        import onnxruntime_qnn  # noqa: F401
    except ImportError:
        return "onnxruntime-qnn is not installed (pip install onnxruntime-qnn)"
    return None


def register_qnn():
    """Register the onnxruntime-qnn plugin once per process; returns the module."""
    global _registered
    reason = qnn_available()
    if reason:
        raise NpuqError(f"cannot use the QNN HTP backend: {reason}")
    # optional: the QNN HTP execution provider (onnxruntime-qnn)
    import onnxruntime_qnn

    if not _registered:
        _ort().register_execution_provider_library(onnxruntime_qnn.EP_NAME, onnxruntime_qnn.get_library_path())
        _registered = True
    return onnxruntime_qnn


def htp_options(htp_arch: int | None = None, soc_model: int | None = None) -> dict[str, str]:
    qnn = register_qnn()
    options = {"backend_path": qnn.get_qnn_htp_path()}
    if htp_arch is not None:
        options["htp_arch"] = str(htp_arch)
    if soc_model is not None:
        options["soc_model"] = str(soc_model)
    return options


def htp_session(model, htp_arch: int | None = None, log_level: int = 3):
    """A session on the QNN HTP backend with CPU fallback disabled: creation fails unless
    every node runs on the HTP."""
    ort = _ort()
    qnn = register_qnn()
    devices = [d for d in ort.get_ep_devices() if d.ep_name == qnn.EP_NAME]
    if not devices:
        raise NpuqError("the QNN execution provider registered no device; is onnxruntime-qnn built for this platform?")
    so = ort.SessionOptions()
    so.add_session_config_entry(DISABLE_CPU_FALLBACK, "1")
    so.log_severity_level = log_level
    so.add_provider_for_devices(devices, htp_options(htp_arch))
    try:
        return ort.InferenceSession(_model_arg(model), so)
    except Exception as exc:  # ORT raises its own exception types
        raise NpuqError(f"the QNN HTP backend rejected the graph (htp_arch={htp_arch}): {exc}") from exc


_UNIT = re.compile(r"Validation PASSED for (\d+) nodes in OrtNodeUnit \((\w+)\)")


def htp_node_units(model_path: str | os.PathLike, htp_arch: int | None = None, timeout: float = 300) -> Counter:
    """Count the QNN EP's node units by (size, op type) from its verbose log.

    Runs in a subprocess because the log goes to the process's stderr. A compute op in a
    unit of one node ran in float, not quantized (docs/design.md §9); Q/DQ units of one node
    are the graph's float I/O conversions.
    """
    code = (
        "import sys; from npuq.lower.ort import htp_session; "
        f"htp_session(sys.argv[1], {htp_arch!r}, log_level=0)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(model_path)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise NpuqError(f"HTP session failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return Counter((int(n), op) for n, op in _UNIT.findall(proc.stdout + proc.stderr))


def float_compute_units(units: Counter) -> list[str]:
    """Op types that ran unquantized on the HTP (single-node units other than Q/DQ)."""
    return sorted({op for (n, op) in units if n == 1 and op not in ("QuantizeLinear", "DequantizeLinear")})


# --------------------------------------------------------------------------- graph callables
def _quantize(x: np.ndarray, enc: IOEncoding) -> np.ndarray:
    scale = np.float32(enc.scale)
    q = np.rint(np.asarray(x, np.float32) / scale) + enc.zero_point
    return np.clip(q, enc.qmin, enc.qmax).astype(enc.dtype)


def _dequantize(q: np.ndarray, enc: IOEncoding) -> np.ndarray:
    return ((q.astype(np.int64) - enc.zero_point) * np.float64(enc.scale)).astype(np.float32)


class OrtGraph:
    """One exported graph as a callable taking and returning torch tensors.

    ``io`` is the graph's entry of manifest.json (inputs/outputs with names, shapes, dtypes
    and encodings: :class:`npuq.lower.manifest.GraphEntry`). KV-cache inputs holding quantized codes are passed as codes in any
    tensor dtype (a float32 buffer holds uint16 codes exactly) and come back as int32 codes, as
    do the hidden states a shard of a sharded export takes and returns (``hidden_<L>``);
    float inputs that the graph takes quantized are quantized here, and quantized outputs
    other than the caches (e.g. logits) are dequantized. A graph whose cache I/O is declared
    heads first, [KV, B, ...] (``kv_heads_first``: ``npuq export --genai windowed``), gets and
    returns the runner's [B, KV, ...] with the first two axes swapped (for batch 1 a relabelling).
    ``session`` is an ONNX Runtime session or a function that opens one on the first call, so a
    graph that a run never calls (the decode graph while scoring whole prefill chunks) never
    holds its weights in memory.
    """

    def __init__(self, session, io: GraphEntry,
                 cache_prefixes: Sequence[str] = ("k_cache", "v_cache", "k_new", "v_new", HIDDEN_PREFIX),
                 file: str | None = None, on_release=None):
        self._session, self._open = (session, None) if hasattr(session, "run") else (None, session)
        self._on_release = on_release
        self.file = file or io.file  # the file the session runs: the QDQ graph or its compiled context
        self.inputs = io.inputs
        self.outputs = io.outputs
        self._codes = {s.name for s in self.inputs + self.outputs if s.name.startswith(tuple(cache_prefixes))}
        self._swap = self._codes if io.kv_heads_first else set()
        # What an empty cache slot holds (npuq.runtime.runner.Graph): each cache input's zero
        # point, the code of 0.0; 0.0 for a float cache.
        self.empty_cache = tuple(float(s.encoding.zero_point) if s.encoding is not None else 0.0
                                 for s in self.inputs if s.name in self._codes and not s.name.startswith(HIDDEN_PREFIX))

    @property
    def session(self):
        if self._session is None:
            self._session = self._open()
        return self._session

    def release(self) -> None:
        """Close a session this graph opened itself (it opens again on the next call), freeing
        its weights: :func:`npuq.runtime.runner.run_in_turn` runs a sharded export one shard at a time."""
        if self._open is not None:
            self._session = None
            if self._on_release is not None:
                self._on_release()

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        if len(args) != len(self.inputs):
            raise NpuqError(f"graph takes {len(self.inputs)} inputs, got {len(args)}")
        feeds = {}
        for spec, arg in zip(self.inputs, args):
            a = arg.detach().cpu().numpy()
            enc = spec.encoding
            if enc is None:
                feeds[spec.name] = a.astype(spec.dtype)
            elif spec.name in self._codes:
                a = np.swapaxes(a, 0, 1) if spec.name in self._swap else a
                feeds[spec.name] = np.ascontiguousarray(np.clip(np.rint(a), enc.qmin, enc.qmax).astype(spec.dtype))
            else:
                feeds[spec.name] = _quantize(a, enc)
        results = self.session.run([s.name for s in self.outputs], feeds)
        out = []
        for spec, r in zip(self.outputs, results):
            enc = spec.encoding
            if enc is not None and spec.name not in self._codes:
                r = _dequantize(r, enc)
            elif enc is not None:
                r = r.astype(np.int32)
                r = np.swapaxes(r, 0, 1) if spec.name in self._swap else r
            out.append(torch.from_numpy(np.ascontiguousarray(r)))
        return out


def context_use(manifest: Manifest, provider: str, htp_arch: int | None = None) -> tuple[bool, str]:
    """(whether :func:`load_export` runs the compiled contexts, why in a few words): on ``htp``
    when the folder has contexts that the emulator loads, compiled for the arch asked for."""
    compiled = manifest.compiled
    if compiled is None:
        return False, "none compiled"
    if provider != "htp":
        return False, f"{provider} provider runs the QDQ graphs"
    if compiled.share_weights:
        return False, "weight-shared contexts load on a device only: the QDQ graphs ran"
    if htp_arch is not None and htp_arch != compiled.htp_arch:
        return False, f"compiled for HTP v{compiled.htp_arch}, not v{htp_arch}: the QDQ graphs ran"
    return True, f"QNN contexts compiled for HTP v{compiled.htp_arch}"


def load_export(folder: str | os.PathLike, provider: str = "cpu", htp_arch: int | None = None) -> tuple[Manifest, dict[int, OrtGraph | PartChain]]:
    """(manifest, {ar_len: graph}) for a folder written by ``npuq export``; the manifest is
    checked first (:func:`npuq.lower.manifest.read_manifest`: graph files must lie inside
    ``folder``), and a graph ONNX Runtime cannot open is an :class:`NpuqError`. On ``htp`` the
    compiled contexts run when :func:`context_use` says so (their outputs are the QDQ graph's,
    bit for bit, and they load in a fraction of the time). A sharded export's graphs of one
    ar_len run as one (:class:`npuq.runtime.runner.PartChain`: each shard gets the hidden states
    the one before it returned, and its own layers' caches); each shard's session opens on its
    first call."""
    folder = Path(folder)
    if provider not in PROVIDERS:
        raise NpuqError(f"unknown provider {provider!r}; choose {', '.join(PROVIDERS)}")
    manifest = read_manifest(folder)
    arch = htp_arch if htp_arch is not None else manifest.target.htp_arch
    contexts, _ = context_use(manifest, provider, htp_arch)
    shared: dict = {}  # the weights a shard's CPU graphs both feed (dequantized_weights)

    def graph(name: str, entry: GraphEntry) -> OrtGraph:
        if contexts:
            file = manifest.compiled.graphs[name].file
            path = resolve_inside(folder, file, f"--onnx {folder}")
            return OrtGraph(htp_session(path, manifest.compiled.htp_arch), entry, file=file)
        path = resolve_inside(folder, entry.file, f"--onnx {folder}")
        session = functools.partial(_open_cpu, path, shared) if provider == "cpu" else htp_session(path, arch)
        return OrtGraph(session, entry)

    # A graph exported from an artifact in parts runs part by part on the CPU when it scores
    # (PartChain.in_turn): each part's nodes are cut out of its graph and opened alone, its
    # weights dequantized once, and closed before the next part opens, so the peak is one part.
    by_part = provider == "cpu" and not contexts and all(e.parts for e in manifest.graph_entries().values())
    chains: dict[int, list[tuple[tuple[int, int], Any]]] = {}
    shards = manifest.shards or (None,)
    part_weights: dict[str, dict] = {}  # per part: the weights its decode and prefill graphs both feed
    for k, shard in enumerate(shards):
        graphs = manifest.graphs if shard is None else shard.graphs
        for kind, entry in graphs.items():
            name = f"{kind}{shard_tag(k, len(shards))}" if shard is not None else kind
            steps = chains.setdefault(entry.ar_len, [])
            if not by_part:
                steps.append((shard.layers if shard is not None else (0, manifest.cfg.num_layers), graph(name, entry)))
                continue
            path = resolve_inside(folder, entry.file, f"--onnx {folder}")
            for ref, io in zip(entry.parts, _part_entries(path, entry, manifest.cfg)):
                weights = part_weights.setdefault(ref.prefix, {})
                steps.append((ref.layers, OrtGraph(functools.partial(_open_part, path, ref, io, weights), io,
                                                   on_release=weights.clear)))
    if manifest.shards is None and not by_part:
        return manifest, {ar: steps[0][1] for ar, steps in chains.items()}
    residency = Residency()  # the graphs of one ar_len and the other read the same parts
    return manifest, {ar: PartChain([layers for layers, _ in steps], [g for _, g in steps], in_turn=True,
                                    residency=residency)
                      for ar, steps in chains.items()}


def _part_entries(path: Path, entry: GraphEntry, cfg: Any) -> list[GraphEntry]:
    """Each part of ``entry`` (a graph exported from an artifact in parts) as a graph of its own:
    the graph's I/O where the part's I/O is the graph's, and the ``hidden_<L>`` codes between
    two parts inside it, in the encoding of the QuantizeLinear that writes them. Reads the
    graph's nodes and small initializers, not its weights."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    known = {s.name: s for s in entry.inputs + entry.outputs}

    def io(name: str) -> IOEntry:
        if name in known:
            return known[name]
        q = producer.get(name)
        if q is None or q.op_type != "QuantizeLinear" or len(q.input) < 3:
            raise NpuqError(f"{path.name}: {name} between two parts is not written by a QuantizeLinear; export again")
        scale, zero = (numpy_helper.to_array(inits[x]) for x in q.input[1:3])
        info = np.iinfo(zero.dtype)
        enc = IOEncoding(zero.dtype.name, info.bits, int(info.min), int(info.max), float(scale), int(zero))
        return IOEntry(name, (1, entry.ar_len, cfg.hidden_size), zero.dtype.name, enc)

    entries = []
    for ref in entry.parts:
        ins, outs = part_io_names(*ref.layers, cfg.num_layers)
        entries.append(dataclasses.replace(entry, inputs=tuple(io(n) for n in ins), outputs=tuple(io(n) for n in outs),
                                           parts=None))
    return entries


def _open_part(path: Path, ref: PartRef, io: GraphEntry, weights: dict):
    """The CPU session of part ``ref`` of the graph in ``path``: its nodes (named with its
    prefix), the initializers they read (the part's weights only, from the data file) and the
    part's I/O, its weights dequantized once (:func:`dequantized_weights`, shared through
    ``weights`` by the part's decode and prefill graphs)."""
    try:
        shard = onnx.load(str(path), load_external_data=False)
        part = onnx.ModelProto()  # filled in place: each weight is read once, into it
        part.ir_version = IR_VERSION
        part.opset_import.extend(shard.opset_import)
        graph = part.graph
        graph.name = f"{shard.graph.name}_{ref.prefix.rstrip('/')}"
        graph.node.extend(n for n in shard.graph.node if n.name.startswith(ref.prefix))
        read = {x for n in graph.node for x in n.input if x}
        for t in shard.graph.initializer:
            if t.name in read:
                tensor = graph.initializer.add()
                tensor.CopyFrom(t)
                if tensor.data_location == T.EXTERNAL:
                    load_external_data_for_tensor(tensor, str(path.parent))
                    tensor.data_location = T.DEFAULT
                    del tensor.external_data[:]
        del shard
        for side, specs in ((graph.input, io.inputs), (graph.output, io.outputs)):
            side.extend(helper.make_tensor_value_info(s.name, helper.np_dtype_to_tensor_dtype(np.dtype(s.dtype)),
                                                      s.shape) for s in specs)
        part, fed = dequantized_weights(part, weights)
        return _WeightsFed(cpu_session(part, threads=torch.get_num_threads()), fed)
    except Exception as exc:  # noqa: BLE001  (ONNX Runtime raises its own exception types)
        raise NpuqError(f"{path} ({ref.prefix.rstrip('/')}): ONNX Runtime cannot open it ({exc}); export the artifact "
                        "again") from None


def _open_cpu(path: Path, weights: dict):
    """The CPU session of ``path`` with its weights dequantized once (:func:`dequantized_weights`;
    ``weights`` is shared by the graphs of one folder), at the torch thread count in force when
    it opens (the graph opens on its first call, inside the caller's thread scope: the phase's
    planned count)."""
    try:
        model, fed = dequantized_weights(onnx.load(str(path)), weights)
        return _WeightsFed(cpu_session(model, threads=torch.get_num_threads()), fed)
    except Exception as exc:  # noqa: BLE001  (ONNX Runtime raises its own exception types)
        raise NpuqError(f"{path}: ONNX Runtime cannot open it ({exc}); export the artifact again") from None


def dequantized_weights(model, shared: dict) -> tuple[object, dict[str, np.ndarray]]:
    """(``model`` without the DequantizeLinear nodes whose inputs are all initializers, whose
    outputs become float graph inputs; the values to feed them).

    With graph optimizations off (:func:`cpu_session`) ONNX Runtime dequantizes every weight
    at every call: 3/4 of a 32-token prefill call of SmolLM2-135M (0.43 s of which 0.32 s).
    The values are computed once, by ONNX Runtime's own DequantizeLinear on the same inputs
    (fed as arrays where numpy holds their type, so no protobuf carries the codes again), so
    each call computes what it computed before, bit for bit. ``shared`` maps a node's inputs
    (names, attributes and bytes) to its values, so the prefill and decode graphs of one
    export hold one float copy of the weights. The weights' codes are moved out of ``model``
    (it holds none of them afterwards): pass a model you drop."""
    fed_types = {T.FLOAT, T.INT8, T.UINT8, T.INT16, T.UINT16, T.INT32, T.UINT32, T.INT64}  # int4 & co. stay initializers
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    constant = [n for n in graph.node if n.op_type == "DequantizeLinear" and n.output[0] not in outputs
                and all(x in inits for x in n.input if x)]
    arrays = {name: numpy_helper.to_array(inits[name])
              for name in dict.fromkeys(x for n in constant for x in n.input if x) if inits[name].data_type in fed_types}
    # the codes of weights no other node reads are in ``arrays`` now: freed from ``model`` (the
    # caller's, about to be dropped), so they are not held twice while the values are computed
    still_read = {x for n in graph.node if n.op_type != "DequantizeLinear" or n not in constant for x in n.input}
    for name in arrays.keys() - still_read - outputs:
        inits[name].ClearField("raw_data")
    values: dict[str, np.ndarray] = {}
    todo: dict[str, tuple] = {}  # output name: key
    for node in constant:
        digest = hashlib.blake2b(digest_size=16)
        for name in filter(None, node.input):
            digest.update(np.ascontiguousarray(arrays[name]) if name in arrays else inits[name].SerializeToString())
        key = (tuple(node.input), tuple(a.SerializeToString() for a in node.attribute), digest.digest())
        if key in shared:
            values[node.output[0]] = shared[key]
        else:
            todo[node.output[0]] = key
    if todo:
        dq = [n for n in constant if n.output[0] in todo]
        read = dict.fromkeys(x for n in dq for x in n.input if x)
        feeds = {name: arrays[name] for name in read if name in arrays}
        sub = helper.make_graph(
            dq, "weights",
            [helper.make_tensor_value_info(name, inits[name].data_type, a.shape) for name, a in feeds.items()],
            [helper.make_tensor_value_info(n.output[0], inits[n.input[1]].data_type, None) for n in dq],
            initializer=[inits[name] for name in read if name not in feeds])
        sub_model = helper.make_model(sub, opset_imports=model.opset_import, ir_version=model.ir_version)
        results = cpu_session(sub_model, threads=torch.get_num_threads()).run([n.output[0] for n in dq], feeds)
        for node, value in zip(dq, results):
            values[node.output[0]] = shared[todo[node.output[0]]] = value
    nodes = [n for n in graph.node if n.op_type != "DequantizeLinear" or n.output[0] not in values]
    used = {x for n in nodes for x in n.input} | outputs
    inputs = list(graph.input) + [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                                  for name, v in values.items()]
    new_graph = helper.make_graph(nodes, graph.name, inputs, list(graph.output),
                                  initializer=[i for i in graph.initializer if i.name in used],
                                  value_info=list(graph.value_info))
    return helper.make_model(new_graph, opset_imports=model.opset_import, ir_version=model.ir_version), values


class _WeightsFed:
    """A session whose weights are graph inputs (:func:`dequantized_weights`), fed at every
    call; ONNX Runtime reads contiguous arrays in place, without a copy."""

    def __init__(self, session, weights: dict[str, np.ndarray]) -> None:
        self._session, self._weights = session, weights

    def run(self, names, feeds):
        return self._session.run(names, {**feeds, **self._weights})
