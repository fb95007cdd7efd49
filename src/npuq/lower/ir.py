"""What a builder sees and what it returns.

A builder lowers one node of the converted PT2E graph. It receives a :class:`NodeView`
(the op, its arguments resolved to :class:`Value` s, the output shape and, when a quantize
node consumes the output, the output encoding) and returns a :class:`Lowered` (ONNX nodes,
initializers, the values standing for the node's outputs, notes for the manifest). It builds
them with a private :class:`Emit`; nothing is shared between builders, so a builder can be
tested on its own and can never corrupt another's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import NodeProto, TensorProto, helper

from npuq.errors import NpuqError
from npuq.lower.qparams import NUMPY_OF, Encoding, constant_encoding, quantize


class Unsupported(NpuqError):
    """A builder cannot lower this node; the message is the reason."""


@dataclass(frozen=True, eq=False)
class Value:
    """One tensor of the ONNX graph under construction.

    ``encoding``/``quantized``/``codes`` are set when the value is the output of a
    DequantizeLinear: its encoding, the name of the quantized tensor it reads and, when that
    tensor is a constant, the codes themselves (so a builder can re-lay a weight out). An
    integer value (the output of a QuantizeLinear, a quantized graph input) carries its own
    encoding. ``const`` holds the value of an unquantized constant.
    """

    name: str
    shape: tuple[int, ...]
    elem_type: int = TensorProto.FLOAT
    encoding: Encoding | None = None
    quantized: str | None = None
    codes: np.ndarray | None = None
    const: np.ndarray | None = None

    @property
    def is_static(self) -> bool:
        return self.codes is not None or self.const is not None


@dataclass(frozen=True, eq=False)
class Initializer:
    """A constant of the graph, kept as its numpy array until the writer assembles the model:
    only the ones a node still reads once the graph is cleaned up are ever converted, and each
    is written once, straight into the model (``numpy_helper.from_array``'s encoding)."""

    name: str
    array: np.ndarray


@dataclass(frozen=True)
class Note:
    """A lowering decision worth recording in the manifest (and, if ``warn``, logging once)."""

    kind: str
    node: str
    detail: dict[str, Any] = field(default_factory=dict)
    warn: str | None = None


@dataclass(frozen=True, eq=False)
class NodeView:
    """One call_function node of the converted graph, arguments resolved."""

    name: str
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    shape: tuple[int, ...]
    elem_type: int
    out_encoding: Encoding | None = None  # the encoding its quantize consumer applies, if any

    def tensor(self, i: int) -> Value:
        v = self.args[i]
        if not isinstance(v, Value):
            raise Unsupported(f"argument {i} is {type(v).__name__}, expected a tensor")
        return v


@dataclass(frozen=True, eq=False)
class Lowered:
    outputs: tuple[Value, ...]
    nodes: tuple[NodeProto, ...] = ()
    initializers: tuple[Initializer | TensorProto, ...] = ()
    notes: tuple[Note, ...] = ()
    opsets: tuple[tuple[str, int], ...] = ()  # extra (domain, version) pairs the nodes need


def alias(value: Value) -> Lowered:
    """The node's output is its input (a no-op such as ``alias`` or a same-dtype ``to``)."""
    return Lowered(outputs=(value,))


class Emit:
    """Collects the ONNX nodes of one builder call; names derive from the fx node name."""

    def __init__(self, view: NodeView):
        self.view = view
        self.prefix = view.name
        self.nodes: list[NodeProto] = []
        self.initializers: list[Initializer | TensorProto] = []
        self.notes: list[Note] = []
        self.opsets: list[tuple[str, int]] = []
        self._count = 0

    def fresh(self, tag: str) -> str:
        self._count += 1
        return f"{self.prefix}/{tag}_{self._count}"

    def const(self, array: np.ndarray, tag: str = "const", name: str | None = None) -> str:
        name = name or self.fresh(tag)
        self.initializers.append(Initializer(name, np.asarray(array)))
        return name

    def node(self, op_type: str, inputs: list[str], output: str | None = None, tag: str | None = None,
             domain: str | None = None, **attrs) -> str:
        output = output or self.fresh(tag or op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, domain=domain, **attrs))
        return output

    def qparams(self, enc: Encoding, tag: str) -> tuple[str, str]:
        scale = self.const(enc.scale.astype(np.float32), f"{tag}_scale")
        zp = self.const(enc.zero_point.astype(NUMPY_OF[enc.onnx_type]), f"{tag}_zp")
        return scale, zp

    @staticmethod
    def _attrs(enc: Encoding) -> dict:
        attrs = {"axis": enc.axis} if enc.per_channel else {}
        if enc.block_size is not None:
            attrs["block_size"] = enc.block_size
        return attrs

    def quantize(self, x: str, enc: Encoding, output: str | None = None, tag: str = "q") -> str:
        scale, zp = self.qparams(enc, tag)
        return self.node("QuantizeLinear", [x, scale, zp], output, tag=tag, **self._attrs(enc))

    def dequantize(self, q: str, enc: Encoding, output: str | None = None, tag: str = "dq") -> str:
        scale, zp = self.qparams(enc, tag)
        return self.node("DequantizeLinear", [q, scale, zp], output, tag=tag, **self._attrs(enc))

    def static(self, codes: np.ndarray, enc: Encoding, tag: str) -> str:
        """A quantized constant and its DequantizeLinear; returns the float output name."""
        codes_name = self.const(np.asarray(codes).astype(NUMPY_OF[enc.onnx_type], copy=False), f"{tag}_codes")
        return self.dequantize(codes_name, enc, tag=f"{tag}_dq")

    def qdq(self, x: str, enc: Encoding, tag: str = "requant") -> str:
        """Re-encode a float tensor: QuantizeLinear then DequantizeLinear (on the HTP the pair
        after a DequantizeLinear becomes one Convert)."""
        return self.dequantize(self.quantize(x, enc, tag=f"{tag}_q"), enc, tag=f"{tag}_dq")

    def scalar(self, value: float, like: Value | None, tag: str = "scalar") -> str:
        """A scalar operand: quantized exactly to the type of ``like`` when that is quantized."""
        if like is None or like.encoding is None or like.encoding.per_channel:
            return self.const(np.array(value, dtype=np.float32), tag)
        enc = constant_encoding(value, like.encoding)
        return self.static(quantize(np.array(value, dtype=np.float32), enc), enc, tag)

    def note(self, kind: str, warn: str | None = None, **detail) -> None:
        self.notes.append(Note(kind, self.view.name, detail, warn))

    def done(self, *outputs: Value) -> Lowered:
        return Lowered(tuple(outputs), tuple(self.nodes), tuple(self.initializers), tuple(self.notes),
                       tuple(self.opsets))

    def out(self, name: str | None = None, **kw) -> Value:
        """The Value of the node's (single) output, shaped and typed from the graph's metadata."""
        return Value(name or self.view.name, self.view.shape, kw.pop("elem_type", self.view.elem_type), **kw)
