"""QNN HTP context binaries of an export's QDQ graphs (``npuq export --compile``, docs/design.md §10, §11).

Each graph is compiled by onnxruntime-qnn's HTP backend (CPU emulation on x86-64) into
``<graph>_ctx.onnx``, one EPContext node that names ``<graph>_ctx_qnn.bin`` beside it. A context
is built for one HTP architecture and must be loaded with it. With ``share_weights`` both
graphs go into one binary (the EP's shared-context mode, the last compile closing it): about
half the size on a device, but the emulator cannot load it, so npuq cannot verify it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import onnx

from npuq.errors import NpuqError
from npuq.fsio import resolve_inside
from npuq.lower.manifest import CompiledContexts, ContextEntry
from npuq.lower.ort import DISABLE_CPU_FALLBACK, htp_options, qnn_available, register_qnn
from npuq.lower.target import installed_ort_qnn_version

CONTEXT_SUFFIX = "_ctx.onnx"
SHARE_CONTEXTS = "ep.share_ep_contexts"
STOP_SHARING = "ep.stop_share_ep_contexts"
VERIFIED_EMULATOR = "emulator"  # loads on the HTP emulator; npuq's tests check it matches the QDQ graph bit for bit
VERIFIED_DEVICE_ONLY = "device only"  # weight-shared: the emulator cannot load it (docs/design.md §10)


def check_can_compile() -> None:
    """Refuse ``--compile`` before any work when the compiler is not installed."""
    reason = qnn_available()
    if reason:
        raise NpuqError(f"--compile needs the QNN HTP backend, but {reason}; install it or export without --compile")


def _binary_of(path: Path) -> str:
    """The binary an EPContext model names (its ep_cache_context attribute)."""
    model = onnx.load(str(path), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "EPContext":
            for a in node.attribute:
                if a.name == "ep_cache_context":
                    return a.s.decode("utf-8")
    raise NpuqError(f"{path}: the compiled model has no EPContext node; onnxruntime-qnn compiled nothing (try "
                    "without --compile, or another onnxruntime-qnn)")


def compile_contexts(folder: Path, graphs: dict[str, str], htp_arch: int, soc: str | None,
                     share_weights: bool = False) -> CompiledContexts:
    """Compile ``folder/graphs[kind]`` for each kind into ``folder/<kind>_ctx.onnx`` (+ its
    binary) for ``htp_arch``; returns the manifest's record of them."""
    import onnxruntime as ort  # loaded on use, as in npuq.lower.ort: importing npuq stays light

    qnn = register_qnn()
    devices = [d for d in ort.get_ep_devices() if d.ep_name == qnn.EP_NAME]
    if not devices:
        raise NpuqError("--compile: the QNN execution provider registered no device; is onnxruntime-qnn built for "
                        "this platform? Export without --compile")
    seconds: dict[str, float] = {}
    for i, (kind, file) in enumerate(graphs.items()):
        so = ort.SessionOptions()
        so.add_session_config_entry(DISABLE_CPU_FALLBACK, "1")  # the whole graph on the HTP, or an error
        so.log_severity_level = 3
        if share_weights:
            so.add_session_config_entry(SHARE_CONTEXTS, "1")
            if i == len(graphs) - 1:
                so.add_session_config_entry(STOP_SHARING, "1")  # the last graph writes the one binary
        so.add_provider_for_devices(devices, htp_options(htp_arch))
        start = time.perf_counter()
        try:
            ort.ModelCompiler(so, str(folder / file), embed_compiled_data_into_model=False).compile_to_file(
                str(folder / f"{kind}{CONTEXT_SUFFIX}"))
        except Exception as exc:  # noqa: BLE001  (ONNX Runtime raises its own exception types)
            raise NpuqError(f"--compile: the QNN HTP backend could not compile {file} for HTP v{htp_arch} ({exc}); "
                            "check that --htp-arch / --soc names the target chip, or export without --compile") from None
        seconds[kind] = time.perf_counter() - start
    entries = {}
    for kind in graphs:
        path = folder / f"{kind}{CONTEXT_SUFFIX}"
        binary = _binary_of(path)
        resolved = resolve_inside(folder, binary, f"--compile: {path.name}")
        if not resolved.is_file():
            raise NpuqError(f"--compile: {path.name} names {binary!r}, which was not written; export without --compile")
        entries[kind] = ContextEntry(path.name, binary, os.path.getsize(path), os.path.getsize(resolved),
                                     round(seconds[kind], 3))
    found = installed_ort_qnn_version()
    return CompiledContexts(
        compiler=f"onnxruntime {ort.__version__}, {found[1] if found else 'onnxruntime-qnn'}",
        qnn_version=str(found[0]) if found else None,
        htp_arch=htp_arch,
        soc=soc,
        share_weights=share_weights,
        verified=VERIFIED_DEVICE_ONLY if share_weights else VERIFIED_EMULATOR,
        graphs=entries,
    )
