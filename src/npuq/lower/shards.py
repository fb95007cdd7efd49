"""Sharded export (``npuq export --shards N|auto``, docs/design.md §13): an artifact quantized in
parts is exported as shards, each a run of consecutive decoder layers that one QNN HTP context
holds on the device.

- :func:`plan_shards` groups the artifact's parts into the fewest shards whose weights stay
  under the per-context limit (:data:`SHARD_BYTES`), or into as many as asked, as evenly as
  the parts allow (the largest shard as small as possible).
- :func:`part_io_names` names a part's graph I/O: the decoder's names (:func:`io_names`) for
  its own layers' caches, and ``hidden_<L>``, the hidden states that enter layer L, where a
  part starts or ends inside the model. Carried as quantized codes, like the caches.
- :class:`ShardBuilder` merges the lowered graphs of a shard's parts, one part at a time: each
  part's own tensor and node names get a prefix (parts repeat the mask and RoPE nodes of the
  whole graph under the same names), the hidden states one part returns become the next part's
  input inside the shard, and, with :class:`ExternalData`, each part's weights go to the shard's
  data file as soon as the part is lowered, so memory holds one part's weights, not the shard's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from npuq.errors import NpuqError
from npuq.lower.ir import Note
from npuq.lower.onnx_writer import IR_VERSION, IOSpec, LoweredGraph
from npuq.partition import fewest_runs, min_max_split

# A QNN HTP context holds at most 4 GB (ExecuTorch's Qualcomm LLM README: "4 GB per context",
# use more shards). A shard's weights are kept under 3.5 GiB, leaving room for its graph and
# buffers; Qualcomm AI Hub's 7-8 B models ship as 4-5 context binaries for the same reason.
SHARD_BYTES = 3584 << 20
HIDDEN_PREFIX = "hidden_"  # hidden_<L>: the hidden states that enter layer L (a shard's input or output)
EXTERNAL_MIN_BYTES = 64 << 10  # smaller initializers (scales, zero points, norms) stay inside the graph file
ALIGN = 4096  # each tensor in a data file starts on a page, so ONNX Runtime can map it


def part_prefix(part: int) -> str:
    """What the names inside the artifact's part ``part`` (from 0) carry in a shard."""
    return f"part{part + 1}/"


def hidden_name(layer: int) -> str:
    return f"{HIDDEN_PREFIX}{layer}"


def part_io_names(first: int, end: int, num_layers: int) -> tuple[list[str], list[str]]:
    """Graph input and output names of layers ``first`` … ``end - 1`` (a part of
    :func:`npuq.calibrate.graphs.part_graph`): the decoder's own (:func:`npuq.lower.export.io_names`)
    where the part starts at layer 0 or ends at the last layer, ``hidden_<L>`` where it does not."""
    inputs = ["tokens" if first == 0 else hidden_name(first), "mask", "positions"] + \
             [f"k_cache_{i}" for i in range(first, end)] + [f"v_cache_{i}" for i in range(first, end)]
    outputs = ["logits" if end == num_layers else hidden_name(end)] + \
              [f"k_new_{i}" for i in range(first, end)] + [f"v_new_{i}" for i in range(first, end)]
    return inputs, outputs


def plan_shards(part_bytes: Sequence[int], shards: int | str, limit: int = SHARD_BYTES) -> tuple[tuple[int, int], ...]:
    """The artifact's parts (their weight bytes, in order) grouped into shards, as (first part,
    end part) pairs. ``shards``: a count (at most one shard per part), or ``"auto"``: the fewest
    shards whose weights each stay within ``limit``; either way as even as the parts allow."""
    n = len(part_bytes)
    if shards == "auto":
        big = [k for k, b in enumerate(part_bytes) if b > limit]
        if big:
            k = big[0]
            raise NpuqError(f"part {k + 1} of the artifact holds {part_bytes[k] / 2**30:.2f} GiB of weights, over the "
                            f"{limit / 2**30:.2f} GiB a shard may hold (one QNN HTP context): quantize again with more "
                            "--parts, so that each part is smaller")
        return fewest_runs(part_bytes, limit)
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise NpuqError(f"--shards {shards!r:.40}: give a whole number of at least 1, or auto")
    if shards > n:
        raise NpuqError(f"--shards {shards}: the artifact holds {n} part{'s' * (n != 1)}, and a shard is one or more "
                        f"whole parts; quantize again with --parts {shards} (or more), or export with --shards {n} "
                        "or fewer")
    return min_max_split(part_bytes, shards)


class ExternalData:
    """One shard's weights file: initializers are appended as their graphs are built, each on a
    page boundary; an initializer whose bytes are already in the file (the decode and prefill
    graphs of a shard hold the same weights) points at them instead of writing them twice."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "wb")
        self._where: dict[bytes, tuple[int, int]] = {}
        self.bytes = 0

    def close(self) -> None:
        self._file.close()

    def move_out(self, graph: onnx.GraphProto) -> None:
        """Write the raw data of ``graph``'s larger initializers to the file and leave references."""
        for t in graph.initializer:
            if not t.HasField("raw_data") or len(t.raw_data) < EXTERNAL_MIN_BYTES:
                continue
            data = t.raw_data
            key = hashlib.blake2b(data, digest_size=20).digest() + len(data).to_bytes(8, "little")
            if key not in self._where:
                offset = -self.bytes % ALIGN + self.bytes
                self._file.write(b"\0" * (offset - self.bytes))
                self._file.write(data)
                self.bytes = offset + len(data)
                self._where[key] = (offset, len(data))
            offset, length = self._where[key]
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            del t.external_data[:]
            for k, v in (("location", self.path.name), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = k, v


def _prefix_names(graph: onnx.GraphProto, keep: set[str], prefix: str) -> None:
    """Give every tensor and node of ``graph`` not named in ``keep`` the name ``prefix + name``."""
    def rename(name: str) -> str:
        return name if not name or name in keep else prefix + name

    for i, node in enumerate(graph.node):
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise NpuqError(f"node {node.name!r} holds a subgraph, which sharded export does not rename")
        node.name = prefix + (node.name or f"{node.op_type}_{i}")  # every node: a part is cut by its prefix
        node.input[:] = [rename(x) for x in node.input]
        node.output[:] = [rename(x) for x in node.output]
    for t in graph.initializer:
        t.name = rename(t.name)
    for v in graph.value_info:
        v.name = rename(v.name)


@dataclass
class ShardBuilder:
    """The graph of one shard (one kind: decode or prefill), built from its parts' lowered
    graphs in order (:meth:`rename`, :meth:`keep`), then :meth:`finish`. Names inside part K get the
    prefix ``partK/`` (K from 1, as the artifact numbers its parts). With ``data``, each part's weights move
    to that file when the part is added."""

    name: str
    data: ExternalData | None = None
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    value_info: list[onnx.ValueInfoProto] = field(default_factory=list)
    opsets: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, IOSpec] = field(default_factory=dict)
    outputs: dict[str, IOSpec] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    builders: dict[str, str] = field(default_factory=dict)

    def rename(self, g: LoweredGraph, part: int) -> LoweredGraph:
        """Take the lowered graph of the shard's next part: its own names prefixed, its I/O
        joined to the shard's. Then :meth:`keep` it (between the two, its names are the
        shard's and its weights still inside it: read its encodings there)."""
        graph = g.model.graph
        io = {s.name for s in g.inputs + g.outputs}
        _prefix_names(graph, io, part_prefix(part))  # the artifact's part: unique across shards too
        for spec in g.inputs:
            if spec.name in self.outputs:  # the hidden states the part before returned: inside the shard now
                if spec.to_json() != self.outputs[spec.name].to_json():
                    raise NpuqError(f"{self.name}: {spec.name} leaves one part as {self.outputs[spec.name].to_json()} "
                                    f"and enters the next as {spec.to_json()}; quantize again")
                del self.outputs[spec.name]
            elif spec.name in self.inputs:  # the mask and positions every part takes
                if spec.to_json() != self.inputs[spec.name].to_json():
                    raise NpuqError(f"{self.name}: the parts take {spec.name} in different forms "
                                    f"({self.inputs[spec.name].to_json()}, {spec.to_json()}); quantize again")
            else:
                self.inputs[spec.name] = spec
        for spec in g.outputs:
            self.outputs[spec.name] = spec
        return g

    def keep(self, g: LoweredGraph) -> None:
        """Move the renamed part's nodes and initializers into the shard (its weights into the
        data file, when the shard has one)."""
        graph = g.model.graph
        if self.data is not None:
            self.data.move_out(graph)
        self.nodes.extend(graph.node)
        self.initializers.extend(graph.initializer)
        self.value_info.extend(graph.value_info)
        for op in g.model.opset_import:
            self.opsets[op.domain] = max(self.opsets.get(op.domain, 0), op.version)
        self.notes.extend(g.notes)
        self.builders.update(g.builders)

    def finish(self, input_order: Sequence[str], output_order: Sequence[str]) -> LoweredGraph:
        """The shard's model, its I/O in the order given (the decoder's order: ``io_names``)."""
        if sorted(input_order) != sorted(self.inputs) or sorted(output_order) != sorted(self.outputs):
            raise NpuqError(f"{self.name}: the parts' inputs {sorted(self.inputs)} and outputs {sorted(self.outputs)} "
                            "are not the shard's; quantize again")
        ins = [self.inputs[n] for n in input_order]
        outs = [self.outputs[n] for n in output_order]

        def info(s: IOSpec) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(s.name, helper.np_dtype_to_tensor_dtype(np.dtype(s.dtype)), s.shape)

        model = onnx.ModelProto()
        model.ir_version = IR_VERSION
        model.producer_name = "npuq"
        model.opset_import.extend(helper.make_opsetid(d, v) for d, v in self.opsets.items())
        graph = model.graph
        graph.name = self.name
        graph.node.extend(self.nodes)
        graph.input.extend(info(s) for s in ins)
        graph.output.extend(info(s) for s in outs)
        graph.initializer.extend(self.initializers)
        graph.value_info.extend(self.value_info)
        self.nodes, self.initializers, self.value_info = [], [], []
        return LoweredGraph(model, ins, outs, self.notes, self.builders)
