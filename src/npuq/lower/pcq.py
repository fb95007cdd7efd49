"""Per-channel-quantized (PCQ) embedding lowering as pure integer arithmetic (docs/design.md §6).

The table holds int8/int4 codes with one scale per token row (axis 0); the output is a
uint16 per-tensor activation. Two published patterns, plus the two storage forms npuq uses
to express the optimized one on the HTP (which rejects a per-channel DequantizeLinear
feeding a Gather, §9):

legacy (every SDK)
    Gather into an intermediate per-tensor tensor with scale = max(row scales) and zero point
    = max(zero points), then Convert to the output encoding. Rows whose scale is below the
    maximum are re-rounded at the coarser step: lossy, as published.
optimized (SDK >= 2.48), stored as
    ``u16``            the table converted ahead of time to the output encoding; Gather moves
                       codes. Every row keeps its own scale: exact, 2 bytes per element.
    ``int8-rowscale``  int8 codes (per-tensor scale 1) plus a uint16 vector of row scales
                       gathered with the same indices; codes × row scale, then the output
                       encoding. 1 byte per element plus 2 per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from npuq.lower.qparams import Encoding, affine_for_range, dequantize, quantize, requantize


def check_table(codes: np.ndarray, enc: Encoding) -> None:
    if codes.ndim != 2 or not enc.per_channel or enc.axis != 0 or enc.scale.shape != (codes.shape[0],):
        raise ValueError(
            f"a PCQ embedding needs a (rows, dim) table with one scale per row (axis 0); "
            f"got table {codes.shape}, axis {enc.axis}, {enc.scale.shape[0] if enc.scale.ndim else 1} scales"
        )


def reference_gather(codes: np.ndarray, enc: Encoding, ids: np.ndarray, out: Encoding) -> np.ndarray:
    """Integer reference: each gathered row's exact value (code - zp_r) · s_r, quantized once to ``out``."""
    check_table(codes, enc)
    return quantize(dequantize(codes, enc)[ids], out)


# --------------------------------------------------------------------------- legacy
def legacy_intermediate(enc: Encoding) -> Encoding:
    """The published per-tensor stand-in: scale = max(row scales), zero point = max(zero points)."""
    return Encoding.per_tensor(float(enc.scale.max()), int(enc.zero_point.max()), enc.qmin, enc.qmax, enc.onnx_type)


def legacy_table(codes: np.ndarray, enc: Encoding) -> tuple[np.ndarray, Encoding]:
    """The table re-expressed at the intermediate encoding (every row re-rounded at max scale)."""
    check_table(codes, enc)
    inter = legacy_intermediate(enc)
    return requantize(codes, enc, inter), inter


def legacy_gather(codes: np.ndarray, enc: Encoding, ids: np.ndarray, out: Encoding) -> np.ndarray:
    table, inter = legacy_table(codes, enc)
    return requantize(table[ids], inter, out)


# --------------------------------------------------------------------------- optimized, u16 storage
def u16_table(codes: np.ndarray, enc: Encoding, out: Encoding) -> np.ndarray:
    """The table converted to the output encoding (the Convert the backend folds ahead of time)."""
    check_table(codes, enc)
    return requantize(codes, enc, out)


def u16_gather(codes: np.ndarray, enc: Encoding, ids: np.ndarray, out: Encoding) -> np.ndarray:
    return u16_table(codes, enc, out)[ids]


# --------------------------------------------------------------------------- optimized, int8 + row scales
@dataclass(frozen=True, eq=False)
class RowScaleTables:
    codes: np.ndarray  # (rows, dim) int8, the original codes minus their zero points
    codes_enc: Encoding  # int8 per tensor, scale 1: a DequantizeLinear yields the integer codes
    codes_u16: Encoding  # uint16 encoding the gathered codes are converted to before the Mul
    row_scales: np.ndarray  # (rows,) uint16 codes of the row scales
    row_enc: Encoding  # uint16, zero point 0, step max(scale) / 65535


def rowscale_tables(codes: np.ndarray, enc: Encoding) -> RowScaleTables:
    check_table(codes, enc)
    centred = codes.astype(np.int64) - enc.zero_point[:, None]
    if centred.min() < -128 or centred.max() > 127:
        raise ValueError("row zero points push the codes outside int8; use the u16 storage")
    codes_enc = Encoding.per_tensor(1.0, 0, -128, 127, TensorProto.INT8)
    lim = float(max(abs(centred.min()), abs(centred.max()), 1))
    codes_u16 = affine_for_range(-lim, lim, 16)
    row_enc = Encoding.per_tensor(float(enc.scale.max()) / 65535, 0, 0, 65535, TensorProto.UINT16)
    return RowScaleTables(centred.astype(np.int8), codes_enc, codes_u16, quantize(enc.scale, row_enc), row_enc)


def rowscale_gather(t: RowScaleTables, ids: np.ndarray, out: Encoding) -> np.ndarray:
    """What the int8-rowscale graph computes: codes → uint16, × gathered row scale → ``out``."""
    gathered = t.codes[ids]
    as_u16 = dequantize(requantize(gathered, t.codes_enc, t.codes_u16), t.codes_u16)
    scales = dequantize(t.row_scales[ids], t.row_enc)[..., None]
    return quantize(as_u16 * scales, out)
