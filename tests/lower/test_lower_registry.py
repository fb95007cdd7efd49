"""Builder registry: selection by SDK version and HTP arch, forced variants, missing builders."""

import pytest

from npuq.errors import NpuqError
from npuq.lower import registry
from npuq.lower.builders import builders_for, known_ops, select
from npuq.lower.ir import Unsupported
from npuq.lower.registry import LowerOptions, register
from npuq.lower.target import QnnVersion, Target, parse_version


def _target(version=None, arch=None):
    return Target(parse_version(version) if version else None, "test" if version else None, arch)


@pytest.mark.parametrize("version, expected", [
    (None, "legacy"),  # unknown SDK: only patterns every version compiles
    ("2.37", "legacy"),
    ("2.47.9", "legacy"),
    ("2.48", "optimized"),
    ("2.51.0", "optimized"),
    ("3.0", "optimized"),  # compared as tuples: 3.0 > 2.48
])
def test_embedding_pattern_follows_sdk(version, expected):
    assert select("aten.embedding.default", _target(version)).variant == expected


@pytest.mark.parametrize("arch, expected", [(None, "default"), (68, "default"), (69, "default"), (73, "int16"),
                                            (75, "int16"), (81, "int16")])
def test_matmul_second_input_follows_arch(arch, expected):
    assert select("aten.matmul.default", _target("2.51", arch)).variant == expected


@pytest.mark.parametrize("version", [None, "2.37", "2.51"])
def test_forced_legacy_always_allowed(version):
    assert select("aten.embedding.default", _target(version), "legacy").variant == "legacy"


def test_forced_optimized_on_old_sdk_is_an_error():
    with pytest.raises(NpuqError, match=r"optimized pattern .* needs QNN >= 2.48.0, but the target is QNN 2.37.0"):
        select("aten.embedding.default", _target("2.37"), "optimized")


def test_forced_optimized_with_unknown_sdk_is_the_users_call():
    assert select("aten.embedding.default", _target(None), "optimized").variant == "optimized"


def test_unknown_variant():
    with pytest.raises(Unsupported, match="no 'fast' pattern; known: legacy, optimized"):
        select("aten.embedding.default", _target("2.51"), "fast")


def test_no_builder():
    with pytest.raises(Unsupported, match="no builder for aten.fft_fft.default"):
        select("aten.fft_fft.default", _target("2.51"))


def test_options_map_embedding_choice():
    assert LowerOptions("legacy").variant_for("aten.embedding.default") == "legacy"
    assert LowerOptions("auto").variant_for("aten.embedding.default") is None
    assert LowerOptions("legacy").variant_for("aten.linear.default") is None
    with pytest.raises(NpuqError, match="unknown embedding pattern"):
        LowerOptions("newest")
    with pytest.raises(NpuqError, match="unknown embedding storage"):
        LowerOptions("auto", "int4")


def test_newest_supported_builder_wins(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})

    for sdk in [(0, 0, 0), (2, 40, 0), (2, 50, 0), (3, 1, 0)]:
        register("test.op", min_sdk=sdk, variant=f"v{sdk[0]}.{sdk[1]}")(lambda view, ctx: None)
    picks = {v: select("test.op", _target(v)).variant for v in ["2.30", "2.45", "2.50", "2.99", "3.1"]}
    assert picks == {"2.30": "v0.0", "2.45": "v2.40", "2.50": "v2.50", "2.99": "v2.50", "3.1": "v3.1"}
    with pytest.raises(ValueError, match="two builders"):
        register("test.op", min_sdk=(2, 40, 0), variant="v2.40")(lambda view, ctx: None)


def test_requirement_that_nothing_meets(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", {})
    register("test.new", min_sdk=(2, 60, 0), min_arch=79)(lambda view, ctx: None)
    with pytest.raises(Unsupported, match=r"needs QNN >= 2.60.0 and HTP >= v79; the target is QNN 2.51.0"):
        select("test.new", Target(QnnVersion(2, 51, 0), "x", 73))


def test_every_builder_is_registered_once_per_requirement():
    for op in known_ops():
        keys = [(s.min_sdk, s.min_arch, s.variant) for s in builders_for(op)]
        assert len(keys) == len(set(keys)), op
