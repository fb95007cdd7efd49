"""Scheme presets are data: one table, validated formats, the storage conventions of docs/design.md §1."""

import pytest
import torch

from npuq.errors import NpuqError
from npuq.quant.schemes import SCHEMES, UINT8_SYM, PerBlock, PerChannel, PerTensor, TensorFormat, get_scheme

# name → (activation dtype, qmin, qmax), (weight dtype, qmin, qmax, granularity)
EXPECTED = {
    "16a16w": ((torch.int32, 0, 65535), (torch.int16, -32767, 32767, PerChannel(0))),
    "16a8w": ((torch.int32, 0, 65535), (torch.int8, -127, 127, PerChannel(0))),
    "16a4w": ((torch.int32, 0, 65535), (torch.int8, -7, 7, PerChannel(0))),
    "16a4w_block": ((torch.int32, 0, 65535), (torch.int8, -7, 7, PerBlock(32))),
    "8a8w": ((torch.uint8, 0, 255), (torch.int8, -127, 127, PerChannel(0))),
}


def test_table_has_exactly_the_presets():
    assert set(SCHEMES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_formats(name):
    (a_dtype, a_min, a_max), (w_dtype, w_min, w_max, w_gran) = EXPECTED[name]
    s = SCHEMES[name]
    assert (s.activation.torch_dtype, s.activation.quant_min, s.activation.quant_max) == (a_dtype, a_min, a_max)
    assert s.activation.qscheme == torch.per_tensor_affine and isinstance(s.activation.granularity, PerTensor)
    assert (s.weight.torch_dtype, s.weight.quant_min, s.weight.quant_max) == (w_dtype, w_min, w_max)
    assert s.weight.granularity == w_gran and s.weight.symmetric
    assert s.weight.qscheme == torch.per_channel_symmetric


def test_kv8_format_is_uint8_symmetric():
    assert (UINT8_SYM.torch_dtype, UINT8_SYM.qscheme) == (torch.uint8, torch.per_tensor_symmetric)


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=5, signed=True), "bits must be"),
    (dict(bits=4, signed=False), "unsigned 4-bit"),
    (dict(bits=8, signed=True, symmetric=False), "symmetric"),
    (dict(bits=16, signed=False, symmetric=True), "8-bit KV-cache"),
    (dict(bits=8, signed=False, granularity=PerChannel(0)), "per-tensor"),
    (dict(bits=8, signed=True, granularity=PerBlock(32)), "4-bit weights only"),
])
def test_invalid_formats_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TensorFormat(**kwargs)


def test_granularity_validation():
    with pytest.raises(ValueError):
        PerBlock(24)
    with pytest.raises(ValueError):
        PerChannel(-1)


def test_unknown_scheme_names_the_choices():
    with pytest.raises(NpuqError, match=r"unknown scheme '4a4w'.*16a8w"):
        get_scheme("4a4w")
