"""Shared fixtures of the lowering tests: converted tiny decoders (built once per session)."""

import pytest

from npuq.lower.export import io_names, is_kv
from npuq.lower.onnx_writer import lower_program
from npuq.lower.target import QnnVersion, Target

TARGET_73 = Target(QnnVersion(2, 51, 0), "test", 73)


@pytest.fixture(scope="session")
def tiny_programs():
    """{(family, mode): (model, calibration inputs, converted GraphModule)}, built on demand."""
    from pt2e_tiny import converted_tiny

    cache = {}

    def get(name="llama", mode="decode"):
        if (name, mode) not in cache:
            cache[name, mode] = converted_tiny(name, mode=mode)
        return cache[name, mode]

    return get


def lower_tiny(model, cgm, target=TARGET_73, **kw):
    inputs, outputs = io_names(model.config.num_layers)
    return lower_program(cgm, target, input_names=inputs, output_names=outputs, quantized_io=is_kv, **kw)
