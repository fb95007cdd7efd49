"""aten.matmul of two activations (Q @ Kᵀ, P @ V) and of an activation by a constant.

With 16-bit activations the HTP needs the second input as int16 symmetric (zero point 0),
which compiles only on HTP v73 and newer (docs/design.md §9: on older architectures the EP
silently turns a uint16 second input into uint8). Two builders:

    default (any arch)   second input re-encoded to uint8 over its range: runs everywhere,
                         recorded in the manifest and warned about once
    int16 (arch >= 73)   second input int16 symmetric (re-encoded if the quantizer gave uint16)
"""

from __future__ import annotations

from npuq.lower.qparams import affine_for_range, symmetric_for_range
from npuq.lower.ir import Emit, Lowered, NodeView
from npuq.lower.registry import BuildContext, register
from npuq.lower.target import INT16_MATMUL_ARCH


def _sixteen_bit(view: NodeView) -> bool:
    a, b = view.tensor(0), view.tensor(1)
    return (a.encoding is not None and b.encoding is not None and not b.is_static
            and a.encoding.bits == 16 and b.encoding.bits == 16)


@register("aten.matmul.default", "aten.bmm.default")
def matmul_8bit_second(view: NodeView, ctx: BuildContext) -> Lowered:
    a, b = view.tensor(0), view.tensor(1)
    e = Emit(view)
    second = b.name
    if _sixteen_bit(view):
        enc = affine_for_range(*b.encoding.range(), 8)
        second = e.qdq(b.name, enc, tag="second_u8")
        arch = f"v{ctx.target.htp_arch}" if ctx.target.htp_arch else "an unknown HTP arch"
        e.note("matmul_second_input", dtype="uint8", reason=f"16-bit x int16 MatMul needs HTP >= v{INT16_MATMUL_ARCH}",
               warn=f"MatMul second inputs lowered at 8 bits for {arch} (16-bit x int16 needs "
                    f"HTP v{INT16_MATMUL_ARCH}+); pass --htp-arch or --soc of the target chip to keep 16 bits")
    return e.done(e.out(e.node("MatMul", [a.name, second], view.name)))


@register("aten.matmul.default", "aten.bmm.default", min_arch=INT16_MATMUL_ARCH, variant="int16")
def matmul_int16_second(view: NodeView, ctx: BuildContext) -> Lowered:
    a, b = view.tensor(0), view.tensor(1)
    e = Emit(view)
    second = b.name
    if _sixteen_bit(view):
        if b.encoding.symmetric and b.encoding.bits == 16 and b.encoding.qmin < 0:
            e.note("matmul_second_input", dtype="int16", converted=False)
        else:
            enc = symmetric_for_range(*b.encoding.range(), 16)
            second = e.qdq(b.name, enc, tag="second_i16")
            e.note("matmul_second_input", dtype="int16", converted=True, source=b.encoding.type_name)
    return e.done(e.out(e.node("MatMul", [a.name, second], view.name)))
