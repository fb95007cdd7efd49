"""AIMET's own readers on one export folder: run with the Python that has aimet-onnx (its own
venv, made by ``bench/aimet.py``), not npuq's. Standalone: numpy, onnx and aimet_onnx only.

    python bench/aimet_check.py FOLDER [--json FILE]

FOLDER holds, per graph KIND (decode, prefill): ``KIND.onnx`` (the exported QDQ graph),
``KIND.aimet.onnx`` (the same graph as AIMET's importer takes it:
``npuq.lower.aimet.aimet_import_graph``) and ``KIND.encodings.json`` (the export's file for
that graph). For each graph (docs/design.md §11):

- ``imported``: ``QuantizationSimModel.from_onnx_qdq`` builds a sim from the graph, with no
  QuantizeLinear / DequantizeLinear left over; ``from_graph`` counts the quantizers it set
  from the graph's Q/DQ nodes;
- ``lpbq``: every LPBQ entry parsed by AIMET's reader (``LPBQEncoding.from_qnn_encoding_dict``
  with the weight's shape and axes) gives, per block, multiplier · base scale equal to the
  graph's DequantizeLinear(k, base) (float64 products of float32 values and small integers:
  exact), and the multipliers equal the graph's up to one power-of-two factor;
- ``loaded``: ``load_encodings_to_sim`` takes the graph's file on that sim, and each loaded
  quantizer writes back (its own 1.0.0 writer) exactly the entry it was given; ``agree_with_graph``
  counts the entries whose quantizer the import had already set from the graph and which the
  file reproduces exactly (LPBQ multipliers included, so AIMET's own reading of the graph
  checks the file's block order).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

KEYS = ("enc_type", "bw", "offset", "per_block_int_scale", "block_size", "compressed_bw", "is_sym")


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _same(exported: dict | None, entry: dict) -> bool:
    """AIMET's 1.0.0 dict of a quantizer equals npuq's entry (scales compared as float32, the
    values the graph holds)."""
    if exported is None:
        return False
    if any(k in entry and exported.get(k) != entry[k] for k in KEYS if k != "is_sym"):
        return False
    return np.array_equal(np.float32(exported["scale"]), np.float32(entry["scale"]))


def check_lpbq(model: onnx.ModelProto, doc: dict) -> dict:
    from aimet_onnx._encoding import LPBQEncoding

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    entries = [e for e in doc["param_encodings"] if e["enc_type"] == "LPBQ"]
    equal, wrong = 0, []
    for e in entries:
        node = producer[e["name"]]  # DequantizeLinear(codes, DequantizeLinear(k, base), zp)
        scales = producer[node.input[1]]
        shape = tuple(inits[node.input[0]].dims)
        k = numpy_helper.to_array(inits[scales.input[0]]).astype(np.int64)
        base = numpy_helper.to_array(inits[scales.input[1]]).astype(np.float64)
        channel, block = _attr(scales, "axis", 1), _attr(node, "axis", 1)
        parsed = LPBQEncoding.from_qnn_encoding_dict(e, input_shape=shape, default_channel_axis=channel,
                                                     default_block_axis=block)
        got_k = np.asarray(parsed.per_block_int_scale).astype(np.int64).reshape(k.shape)
        got_base = np.asarray(parsed.per_channel_float_scale, dtype=np.float64)
        bshape = [1] * k.ndim
        bshape[channel] = -1
        want = k * base.reshape(bshape)
        got = got_k * got_base.reshape(bshape)
        ratio = got_k // np.maximum(k, 1)
        if np.array_equal(got, want) and np.all(got_k == k * ratio.flat[0]):
            equal += 1
        else:
            wrong.append(e["name"])
    return {"entries": len(entries), "equal_to_graph": equal, "wrong": wrong[:20]}


def check_graph(folder: Path, kind: str) -> dict:
    from aimet_onnx.quantsim import QuantizationSimModel, load_encodings_to_sim

    model = onnx.load(str(folder / f"{kind}.onnx"))
    doc = json.loads((folder / f"{kind}.encodings.json").read_text())
    result: dict = {"activations": len(doc["activation_encodings"]), "params": len(doc["param_encodings"])}
    result["lpbq"] = check_lpbq(model, doc)
    try:
        sim = QuantizationSimModel.from_onnx_qdq(onnx.load(str(folder / f"{kind}.aimet.onnx")))
    except Exception as exc:  # noqa: BLE001  (AIMET raises RuntimeError, AssertionError, ...)
        result["imported"] = False
        result["import_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return result
    left = [n.op_type for n in sim.model.model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")]
    result["imported"] = not left
    quantizers = sim.qc_quantize_op_dict
    before = {name: q.export_encodings("1.0.0") for name, q in quantizers.items() if q.enabled and q.is_initialized()}
    result["from_graph"] = len(before)
    entries = doc["activation_encodings"] + doc["param_encodings"]
    try:
        mismatched = load_encodings_to_sim(sim, doc, strict=False)
    except Exception as exc:  # noqa: BLE001
        result["loaded"] = False
        result["load_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        return result
    result["loaded"] = True
    result["settings_changed"] = len(mismatched)  # quantizers the default-config sim had set otherwise
    after = {e["name"]: quantizers[e["name"]].export_encodings("1.0.0") if e["name"] in quantizers else None
             for e in entries}
    differ = [e["name"] for e in entries if not _same(after[e["name"]], e)]
    result["written_back_equal"] = len(entries) - len(differ)
    result["written_back_differ"] = differ[:20]
    shared = [e for e in entries if e["name"] in before]
    disagree = [e["name"] for e in shared if not _same(before[e["name"]], e)]
    result["agree_with_graph"] = len(shared) - len(disagree)
    result["disagree_with_graph"] = disagree[:20]
    result["graph_only"] = sorted(set(before) - {e["name"] for e in entries})[:20]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--json", type=Path, help="write the result here (default: stdout)")
    args = p.parse_args(argv)
    logging.disable(logging.WARNING)  # AIMET logs every mismatch of its default config
    import aimet_onnx

    report = {"aimet_onnx": getattr(aimet_onnx, "__version__", "?"),
              "graphs": {kind: check_graph(args.folder, kind) for kind in ("decode", "prefill")
                         if (args.folder / f"{kind}.onnx").is_file()}}
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
