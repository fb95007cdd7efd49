"""PCQ embedding arithmetic against an integer reference (docs/design.md §6)."""

import numpy as np
import pytest
from onnx import TensorProto

from npuq.lower import pcq
from npuq.lower.qparams import Encoding, affine_for_range, dequantize

ROWS, DIM = 64, 32


def _table(bits: int, seed: int = 0, spread: float = 100.0):
    """Codes over the full symmetric range and row scales spanning ``spread``x."""
    rng = np.random.default_rng(seed)
    qmax = 2 ** (bits - 1) - 1
    codes = rng.integers(-qmax, qmax + 1, (ROWS, DIM)).astype(np.int8)
    codes[:, 0] = qmax  # every row reaches its range
    scales = np.geomspace(1e-3, 1e-3 * spread, ROWS).astype(np.float32)
    rng.shuffle(scales)
    enc = Encoding(scales, np.zeros(ROWS, np.int64), -qmax, qmax, TensorProto.INT8, 0)
    values = dequantize(codes, enc)
    out = affine_for_range(float(values.min()), float(values.max()), 16)
    ids = rng.integers(0, ROWS, (2, 7))
    return codes, enc, out, ids


@pytest.mark.parametrize("bits", [8, 4])
def test_optimized_u16_is_exact_per_row(bits):
    codes, enc, out, ids = _table(bits)
    ref = pcq.reference_gather(codes, enc, ids, out)
    got = pcq.u16_gather(codes, enc, ids, out)
    assert got.dtype == np.uint16 and got.shape == (2, 7, DIM)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("bits", [8, 4])
def test_rowscale_within_one_step(bits):
    codes, enc, out, ids = _table(bits)
    ref = pcq.reference_gather(codes, enc, ids, out).astype(int)
    got = pcq.rowscale_gather(pcq.rowscale_tables(codes, enc), ids, out).astype(int)
    assert np.abs(got - ref).max() <= 1


@pytest.mark.parametrize("bits", [8, 4])
def test_legacy_shows_the_max_scale_loss(bits):
    codes, enc, out, _ = _table(bits)
    ids = np.arange(ROWS)[None, :]
    ref = pcq.reference_gather(codes, enc, ids, out).astype(int)
    got = pcq.legacy_gather(codes, enc, ids, out).astype(int)
    err = np.abs(got - ref)[0]  # (rows, dim) in output steps
    s_max, s_out = float(enc.scale.max()), float(out.scale)
    # Each row is re-rounded at max(scale): at most half a max-scale step, plus the final rounding.
    assert err.max() <= np.ceil(0.5 * s_max / s_out) + 1
    assert err.max() > 1  # the published accuracy problem is visible
    exact_row = int(np.argmax(enc.scale))
    assert err[exact_row].max() <= 1  # the row with the largest scale keeps its resolution
    smallest = int(np.argmin(enc.scale))  # 100x below the max: its 255 levels collapse to ~3
    assert len(np.unique(pcq.legacy_table(codes, enc)[0][smallest])) <= 3
    assert err[smallest].max() > 1


def test_legacy_intermediate_is_the_published_one():
    codes, enc, _, _ = _table(8)
    zp = np.arange(ROWS) % 3
    enc_z = Encoding(enc.scale, zp, -127, 127, TensorProto.INT8, 0)
    inter = pcq.legacy_intermediate(enc_z)
    assert float(inter.scale) == pytest.approx(float(enc.scale.max()))
    assert int(inter.zero_point) == 2  # max of the zero points, as published
    assert not inter.per_channel


def test_table_checks():
    codes, enc, out, ids = _table(8)
    with pytest.raises(ValueError, match="one scale per row"):
        pcq.u16_gather(codes.T, enc, ids, out)
    per_tensor = Encoding.per_tensor(0.1, 0, -127, 127, TensorProto.INT8)
    with pytest.raises(ValueError, match="one scale per row"):
        pcq.legacy_gather(codes, per_tensor, ids, out)
