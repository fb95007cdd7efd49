"""Folding a large weight's dequantize a block of rows at a time (npuq.quantize.passes._in_rows)
must give the op's own result exactly: each element goes through the same subtraction and
multiplication whatever block it is in. Reference: the op on the whole tensor."""

import pytest
import torch
import torchao.quantization.pt2e  # noqa: F401  (registers the quantized_decomposed ops)

from npuq.quantize import passes

DQ_CHANNEL = torch.ops.quantized_decomposed.dequantize_per_channel.default
DQ_TENSOR = torch.ops.quantized_decomposed.dequantize_per_tensor.default


@pytest.mark.parametrize("rows", [1000, 999])  # blocks that divide the rows, and a shorter last block
def test_row_blocks_give_the_whole_ops_values(monkeypatch, rows):
    monkeypatch.setattr(passes, "FOLD_ROWS_ELEMENTS", 7 * 300)  # blocks of 7 rows
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (rows, 300), dtype=torch.int8, generator=g)
    scales = torch.rand(rows, generator=g) * 0.01 + 1e-4
    zero_points = torch.randint(-3, 3, (rows,), generator=g)
    args = (codes, scales, zero_points, 0, -128, 127, torch.int8)
    assert torch.equal(passes._in_rows(DQ_CHANNEL, args, {}), DQ_CHANNEL(*args))
    table = torch.randint(0, 65536, (rows, 300), dtype=torch.int32, generator=g)
    args = (table, 0.00123, 31000, 0, 65535, torch.int32)
    assert torch.equal(passes._in_rows(DQ_TENSOR, args, {}), DQ_TENSOR(*args))
    # per channel along another axis: the whole op, untouched
    args = (codes, torch.rand(300, generator=g) + 0.1, torch.zeros(300, dtype=torch.int64), 1, -128, 127, torch.int8)
    assert torch.equal(passes._in_rows(DQ_CHANNEL, args, {}), DQ_CHANNEL(*args))


Q_CHANNEL = torch.ops.quantized_decomposed.quantize_per_channel.default
Q_TENSOR = torch.ops.quantized_decomposed.quantize_per_tensor


@pytest.mark.parametrize("rows", [1000, 999])
def test_quantizing_a_constant_in_row_blocks_gives_the_ops_codes(monkeypatch, rows):
    """convert's weight folding (``_quantize_per_tensor``, ``_quantize_per_channel``) quantizes a
    block of rows at a time into one output; the codes must be the op's on the whole tensor,
    ties (round half to even) and clamped values included, for every output dtype."""
    monkeypatch.setattr(passes, "FOLD_ROWS_ELEMENTS", 7 * 300)  # blocks of 7 rows
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 300, generator=g) * 4
    x[0, :6] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 1e6]) * 0.01  # halves of the scale below, one far out
    for qmin, qmax, dtype in ((0, 65535, torch.int32), (-128, 127, torch.int8), (0, 255, torch.uint8)):
        args = (x, 0.01, (qmin + qmax + 1) // 2, qmin, qmax, dtype)
        want = Q_TENSOR.default(*args)
        got = passes._quantize_per_tensor(*args)
        assert got.dtype == want.dtype and torch.equal(got, want)
        # the .tensor overload: scale and zero point as one-element tensors
        t_args = (x, torch.tensor(0.01), torch.tensor(args[2]), qmin, qmax, dtype)
        assert torch.equal(passes._quantize_per_tensor(*t_args), Q_TENSOR.tensor(*t_args))
        for axis in (0, 1, -1):
            n = x.shape[axis]
            scales = torch.rand(n, generator=g) * 0.02 + 1e-3
            zero_points = torch.randint(-3, 4, (n,), generator=g)
            c_args = (x, scales, zero_points, axis, qmin, qmax, dtype)
            got = passes._quantize_per_channel(*c_args)
            assert got.dtype == dtype and torch.equal(got, Q_CHANNEL(*c_args)), (dtype, axis)
    with pytest.raises(AssertionError, match="quant_max out of bounds"):  # the op's own checks still apply
        passes._quantize_per_tensor(x, 0.01, 0, 0, 300, torch.uint8)
