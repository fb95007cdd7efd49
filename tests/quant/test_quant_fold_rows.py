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
