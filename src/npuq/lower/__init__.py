"""Lowering: converted PT2E programs → QDQ ONNX for the QNN HTP, patterns gated by the target.

    target.py        QNN SDK version (flag, $QNN_SDK_ROOT build id, onnxruntime-qnn) and HTP arch
    ir.py            what a builder sees (NodeView) and returns (Lowered), Unsupported
    registry.py      builders keyed by op and minimum SDK / arch (register, LowerOptions)
    builders/        one module per op family (qdq, shape, elementwise, linear, matmul, embedding, norm);
                     select picks the newest builder that applies
    qparams.py       encodings (scale, zero point, range, storage type) and their integer arithmetic
    pcq.py           per-channel embedding patterns (legacy, optimized) in numpy
    patterns.py      multi-node patterns lowered as one op (RMSNorm)
    onnx_writer.py   walks the program, runs the builders, writes the graph
    export.py        artifact → decode.onnx + prefill.onnx + encodings.json + manifest.json (+ contexts)
    aimet.py         the graphs' encodings in AIMET's format 1.0.0 (encodings.json)
    compile.py       QNN HTP context binaries of the graphs (export --compile)
    manifest.py      manifest.json as records (one schema for writing and reading it)
    ort.py           ONNX Runtime sessions of an export folder (CPU exact QDQ, QNN HTP emulator)
"""

from npuq.lower.builders import select
from npuq.lower.ir import Unsupported
from npuq.lower.onnx_writer import IOSpec, LoweredGraph, UnsupportedOp, lower_program
from npuq.lower.registry import LowerOptions, register
from npuq.lower.target import QnnEnvironmentError, QnnVersion, Target, parse_version, resolve_target

__all__ = [
    "IOSpec", "LoweredGraph", "LowerOptions", "QnnEnvironmentError", "QnnVersion", "Target", "Unsupported",
    "UnsupportedOp", "lower_program", "parse_version", "register", "resolve_target", "select",
]
