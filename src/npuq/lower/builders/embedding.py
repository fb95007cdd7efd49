"""aten.embedding → Gather; a per-channel-quantized (PCQ) table gets a version-gated pattern.

A per-tensor (or float) table is a plain Gather: gather moves codes, the output keeps the
table's encoding. A PCQ table (int8/int4, one scale per row) uses one of the published
patterns (docs/design.md §6), arithmetic in :mod:`npuq.lower.pcq`:

    legacy     (any SDK)     Gather at scale = max(row scales), then Convert to the output
                             encoding (lossy for rows with small scales)
    optimized  (SDK >= 2.48) every row keeps its own scale; stored as a uint16 table in the
                             output encoding (``u16``) or as int8 codes + gathered uint16 row
                             scales (``int8-rowscale``)

The QNN EP rejects any per-channel DequantizeLinear feeding a Gather (§9), so both patterns
are expressed with per-tensor tables, re-encoded here ahead of time.
"""

from __future__ import annotations

import numpy as np

from npuq.lower import pcq
from npuq.lower.ir import Emit, Lowered, NodeView, Unsupported, Value
from npuq.lower.registry import EMBEDDING_NOTE, BuildContext, register
from npuq.lower.target import PCQ_EMBEDDING_OPTIMIZED_SDK


def _is_pcq(table: Value) -> bool:
    return table.encoding is not None and table.encoding.per_channel


def _plain(view: NodeView, table: Value, ids: Value) -> Lowered:
    e = Emit(view)
    return e.done(e.out(e.node("Gather", [table.name, ids.name], view.name, axis=0)))


def _pcq_codes(table: Value):
    if table.codes is None:
        raise Unsupported("a per-channel embedding table must be a constant")
    try:
        pcq.check_table(table.codes, table.encoding)
    except ValueError as exc:
        raise Unsupported(str(exc)) from None
    return table.codes, table.encoding


@register("aten.embedding.default", variant="legacy")
def embedding_legacy(view: NodeView, ctx: BuildContext) -> Lowered:
    table, ids = view.tensor(0), view.tensor(1)
    if not _is_pcq(table):
        return _plain(view, table, ids)
    codes, enc = _pcq_codes(table)
    legacy, inter = pcq.legacy_table(codes, enc)
    e = Emit(view)
    gathered = e.node("Gather", [e.static(legacy, inter, "table"), ids.name], tag="gather", axis=0)
    out = e.qdq(gathered, inter, tag="max_scale")  # the per-tensor intermediate; Convert follows
    e.note(EMBEDDING_NOTE, pattern="legacy", storage=inter.type_name,
           intermediate_scale=float(inter.scale), rows=int(codes.shape[0]))
    return e.done(e.out(out))


@register("aten.embedding.default", min_sdk=PCQ_EMBEDDING_OPTIMIZED_SDK, variant="optimized")
def embedding_optimized(view: NodeView, ctx: BuildContext) -> Lowered:
    table, ids = view.tensor(0), view.tensor(1)
    if not _is_pcq(table):
        return _plain(view, table, ids)
    codes, enc = _pcq_codes(table)
    e = Emit(view)
    storage = ctx.options.embedding_storage
    if storage == "u16":
        out_enc = view.out_encoding
        if out_enc is None or out_enc.per_channel:
            raise Unsupported("the optimized u16 table needs a quantized (per-tensor) embedding output")
        table_u16 = pcq.u16_table(codes, enc, out_enc)
        out = e.node("Gather", [e.static(table_u16, out_enc, "table"), ids.name], view.name, axis=0)
    else:
        t = pcq.rowscale_tables(codes, enc)
        g = e.node("Gather", [e.static(t.codes, t.codes_enc, "codes"), ids.name], tag="gather_codes", axis=0)
        g = e.qdq(e.qdq(g, t.codes_enc, tag="codes"), t.codes_u16, tag="codes_u16")
        s = e.node("Gather", [e.static(t.row_scales, t.row_enc, "row_scales"), ids.name], tag="gather_scales", axis=0)
        s = e.qdq(s, t.row_enc, tag="row_scales")
        s = e.node("Reshape", [s, e.const(np.array([*ids.shape, 1], np.int64), "shape")], tag="row_scales_col")
        s = e.qdq(s, t.row_enc, tag="row_scales_col")
        out = e.node("Mul", [g, s], view.name)
    e.note(EMBEDDING_NOTE, pattern="optimized", storage=storage, rows=int(codes.shape[0]))
    return e.done(e.out(out))
