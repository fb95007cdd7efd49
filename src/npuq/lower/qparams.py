"""Quantization encodings as the lowering sees them, and the pure integer arithmetic on them.

An :class:`Encoding` is what one QuantizeLinear / DequantizeLinear pair carries: scale and
zero point (per tensor, or one per index of ``axis``), the integer range and the ONNX storage
type. PT2E carries every format in a wider torch dtype (uint16 as int32 over [0, 65535],
int4 as int8 over [-7, 7], docs/design.md §1); :func:`storage_type` maps the quant range back
to the narrowest ONNX type that holds it.

    value = (code - zero_point) · scale          code = clamp(round_half_even(value / scale) + zero_point)
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
from onnx import TensorProto

# ONNX storage type → numpy dtype of its codes.
NUMPY_OF = {
    TensorProto.UINT8: np.dtype(np.uint8),
    TensorProto.INT8: np.dtype(np.int8),
    TensorProto.UINT16: np.dtype(np.uint16),
    TensorProto.INT16: np.dtype(np.int16),
    TensorProto.INT32: np.dtype(np.int32),
    TensorProto.INT4: np.dtype(ml_dtypes.int4),
}
TYPE_NAME = {TensorProto.UINT8: "uint8", TensorProto.INT8: "int8", TensorProto.UINT16: "uint16",
             TensorProto.INT16: "int16", TensorProto.INT32: "int32", TensorProto.INT4: "int4"}
# (type, lowest, highest) in order of preference: the first that holds a quant range wins.
_RANGES = (
    (TensorProto.INT4, -8, 7),
    (TensorProto.UINT8, 0, 255),
    (TensorProto.INT8, -128, 127),
    (TensorProto.UINT16, 0, 65535),
    (TensorProto.INT16, -32768, 32767),
    (TensorProto.INT32, -(2**31), 2**31 - 1),
)


def storage_type(qmin: int, qmax: int, static: bool = False) -> int:
    """Narrowest ONNX type holding [qmin, qmax]. 4-bit only for static tensors (weights):
    activations of 4 bits do not exist on the HTP."""
    for onnx_type, lo, hi in _RANGES:
        if onnx_type == TensorProto.INT4 and not static:
            continue
        if lo <= qmin and qmax <= hi:
            return onnx_type
    raise ValueError(f"quant range [{qmin}, {qmax}] fits no ONNX integer type")


@dataclass(frozen=True, eq=False)
class Encoding:
    """Scale and zero point (0-d per tensor, 1-d along ``axis`` per channel) and the code range."""

    scale: np.ndarray  # float32, () or (C,)
    zero_point: np.ndarray  # int64, same shape as scale
    qmin: int
    qmax: int
    onnx_type: int
    axis: int | None = None
    block_size: int | None = None  # blocked along ``axis``: scale has the tensor's rank

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", np.asarray(self.scale, dtype=np.float32))
        object.__setattr__(self, "zero_point", np.asarray(self.zero_point, dtype=np.int64))
        if self.scale.shape != self.zero_point.shape:
            raise ValueError(f"scale {self.scale.shape} and zero point {self.zero_point.shape} differ in shape")
        if self.block_size is not None:
            if self.axis is None or self.scale.ndim == 0:
                raise ValueError("a blocked encoding needs an axis and a scale of the tensor's rank")
        elif (self.axis is None) != (self.scale.ndim == 0):
            raise ValueError("a per-channel encoding needs an axis and 1-d scales; per tensor needs 0-d")
        if not np.all(self.scale > 0):
            raise ValueError("scales must be positive")

    @classmethod
    def per_tensor(cls, scale: float, zero_point: int, qmin: int, qmax: int, onnx_type: int | None = None) -> Encoding:
        return cls(np.float32(scale), np.int64(zero_point), qmin, qmax,
                   storage_type(qmin, qmax) if onnx_type is None else onnx_type)

    @property
    def per_channel(self) -> bool:
        return self.axis is not None

    @property
    def bits(self) -> int:
        return {TensorProto.INT4: 4, TensorProto.UINT8: 8, TensorProto.INT8: 8, TensorProto.UINT16: 16,
                TensorProto.INT16: 16, TensorProto.INT32: 32}[self.onnx_type]

    @property
    def symmetric(self) -> bool:
        return bool(np.all(self.zero_point == 0)) and self.qmin < 0

    @property
    def type_name(self) -> str:
        return TYPE_NAME[self.onnx_type]

    def range(self) -> tuple[float, float]:
        """Lowest and highest representable value (per tensor only)."""
        if self.per_channel:
            raise ValueError("range() of a per-channel encoding")
        s, z = float(self.scale), int(self.zero_point)
        return (self.qmin - z) * s, (self.qmax - z) * s

    def same_as(self, other: Encoding | None) -> bool:
        return (
            other is not None and self.onnx_type == other.onnx_type and self.axis == other.axis
            and self.qmin == other.qmin and self.qmax == other.qmax
            and self.scale.shape == other.scale.shape
            and bool(np.all(self.scale == other.scale)) and bool(np.all(self.zero_point == other.zero_point))
        )

    def with_type(self, onnx_type: int) -> Encoding:
        return Encoding(self.scale, self.zero_point, self.qmin, self.qmax, onnx_type, self.axis, self.block_size)


def _broadcast(enc: Encoding, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    if not enc.per_channel:
        return enc.scale, enc.zero_point
    if enc.block_size is not None:
        return (np.repeat(enc.scale, enc.block_size, axis=enc.axis),
                np.repeat(enc.zero_point, enc.block_size, axis=enc.axis))
    shape = [1] * ndim
    shape[enc.axis] = -1
    return enc.scale.reshape(shape), enc.zero_point.reshape(shape)


def quantize(x: np.ndarray, enc: Encoding) -> np.ndarray:
    """Float values → codes (round half to even, as torch.round and ONNX QuantizeLinear)."""
    x = np.asarray(x, dtype=np.float32)
    scale, zp = _broadcast(enc, x.ndim)
    codes = np.rint(x / scale).astype(np.int64) + zp
    return np.clip(codes, enc.qmin, enc.qmax).astype(NUMPY_OF[enc.onnx_type])


def dequantize(codes: np.ndarray, enc: Encoding) -> np.ndarray:
    codes = np.asarray(codes)
    scale, zp = _broadcast(enc, codes.ndim)
    return ((codes.astype(np.int64) - zp) * scale.astype(np.float64)).astype(np.float32)


def requantize(codes: np.ndarray, src: Encoding, dst: Encoding) -> np.ndarray:
    """Codes of ``src`` → codes of ``dst`` through exact (float64) values: one rounding."""
    codes = np.asarray(codes)
    s_scale, s_zp = _broadcast(src, codes.ndim)
    d_scale, d_zp = _broadcast(dst, codes.ndim)
    value = (codes.astype(np.int64) - s_zp) * s_scale.astype(np.float64)
    out = np.rint(value / d_scale.astype(np.float64)).astype(np.int64) + d_zp
    return np.clip(out, dst.qmin, dst.qmax).astype(NUMPY_OF[dst.onnx_type])


def affine_for_range(lo: float, hi: float, bits: int) -> Encoding:
    """Unsigned affine encoding covering [lo, hi] (widened to include 0, as observers do)."""
    qmax = 2**bits - 1
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max((hi - lo) / qmax, 1e-4 / qmax)
    zp = int(np.clip(np.rint(-lo / scale), 0, qmax))
    return Encoding.per_tensor(scale, zp, 0, qmax)


def symmetric_for_range(lo: float, hi: float, bits: int) -> Encoding:
    """Signed symmetric encoding (zero point 0, narrow range ±(2^(b-1) - 1)) covering [lo, hi]."""
    qmax = 2 ** (bits - 1) - 1
    amax = max(abs(lo), abs(hi))
    return Encoding.per_tensor(max(amax / qmax, 1e-4 / qmax), 0, -qmax, qmax)


def constant_encoding(value: float, like: Encoding) -> Encoding:
    """Per-tensor encoding of the type of ``like`` in which ``value`` is exactly an end code.

    Used to quantize a scalar operand (an epsilon, an attention scale) so the op stays a
    quantized op on the HTP: value = qmax·scale (positive) or (qmin - zp)·scale (negative).
    """
    lo, hi = like.qmin, like.qmax
    magnitude = abs(float(value)) or 1.0
    if value >= 0 or lo < 0:  # signed types hold either sign around zero point 0
        return Encoding.per_tensor(magnitude / hi, 0, lo, hi, like.onnx_type)
    return Encoding.per_tensor(magnitude / hi, hi, lo, hi, like.onnx_type)


def lpbq_split(scales: np.ndarray, max_bits: int = 8) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Per-block scales (C, blocks) → (base (C,), integer multipliers k (C, blocks), bits) with
    scales = base · k, base = max over blocks / 2^bits (LPBQ, docs/design.md §1); None when no
    bit width up to ``max_bits`` makes every k an integer."""
    scales = np.asarray(scales, dtype=np.float64)
    top = scales.max(axis=1, keepdims=True)
    for bits in range(1, max_bits + 1):
        base = top / 2**bits
        k = scales / base
        if np.all(np.abs(k - np.rint(k)) < 1e-3) and np.all(np.rint(k) >= 1):
            return base[:, 0].astype(np.float32), np.rint(k).astype(np.uint8), bits
    return None
