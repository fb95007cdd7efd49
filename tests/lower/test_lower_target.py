"""Target resolution: version parsing and ordering, SDK build ids, HTP arch and chip tables."""

import logging

import pytest

from npuq.errors import NpuqError
from npuq.lower.target import (
    QnnEnvironmentError,
    QnnVersion,
    Target,
    arch_of_soc,
    detect_qnn_version,
    find_build_id,
    parse_htp_arch,
    parse_version,
    resolve_target,
    sdk_htp_library,
    version_from_build_id,
)

NO_ORT = lambda: None  # noqa: E731  (no onnxruntime-qnn installed)


@pytest.mark.parametrize("text, expected", [
    ("2.48", (2, 48, 0)),
    ("2.51.0", (2, 51, 0)),
    ("v2.51.0", (2, 51, 0)),
    ("2.51.0.260929181845", (2, 51, 0)),
    (" 3.0 ", (3, 0, 0)),
    ("10.2.7", (10, 2, 7)),
])
def test_parse_version(text, expected):
    assert parse_version(text).as_tuple() == expected


@pytest.mark.parametrize("text", ["", "2", "two.48", "2.48-rc1", "2..48", "latest", "2.48.0.1.2"])
def test_parse_version_rejects_garbage(text):
    with pytest.raises(NpuqError, match="cannot read QNN version"):
        parse_version(text)


@pytest.mark.parametrize("a, b", [
    ("3.0", "2.48"),  # the published check saw 3.0 as older than 2.48
    ("2.48", "2.37"),
    ("2.48.1", "2.48.0"),
    ("2.100", "2.99.9"),
    ("10.0", "9.99"),
])
def test_versions_order_as_tuples(a, b):
    assert parse_version(a) > parse_version(b)
    assert not parse_version(b) > parse_version(a)


@pytest.mark.parametrize("version, optimized", [("2.37", False), ("2.47.9", False), ("2.48", True), ("2.51", True), ("3.0", True)])
def test_sdk_gate(version, optimized):
    assert Target(parse_version(version)).sdk_at_least((2, 48, 0)) is optimized


def test_unknown_target_supports_nothing_newer():
    assert not Target().sdk_at_least((0, 0, 1))
    assert not Target().arch_at_least(68)


@pytest.mark.parametrize("build_id, expected", [
    ("v2.51.0.260929181845", (2, 51, 0)),
    ("QNN v3.0.2.270101000000 release", (3, 0, 2)),
    ("v2.51", None),  # no build number: not a build id
    ("garbage", None),
    ("", None),
    (None, None),
])
def test_version_from_build_id(build_id, expected):
    v = version_from_build_id(build_id)
    assert (v.as_tuple() if v else None) == expected


def test_find_build_id_in_bytes():
    blob = b"\x00\x7fELF junk 2.51 v9 \x00 vX.Y.Z \x00 v2.51.0.260929181845\x00 more v2.1.0.1"
    assert find_build_id(blob) == "v2.51.0.260929181845"
    assert find_build_id(b"\x00" * 100) is None


def _fake_sdk(tmp_path, content: bytes):
    lib = tmp_path / "lib" / "x86_64-linux-clang"
    lib.mkdir(parents=True)
    (lib / "libQnnHtp.so").write_bytes(content)
    return {"QNN_SDK_ROOT": str(tmp_path)}


def test_version_from_sdk_root(tmp_path):
    env = _fake_sdk(tmp_path, b"\x00ELF\x00" * 50 + b"v2.45.0.250101000000\x00")
    found = detect_qnn_version(None, env, NO_ORT)
    assert found.version == QnnVersion(2, 45, 0) and found.source == "QNN_SDK_ROOT"


def test_explicit_version_wins(tmp_path):
    env = _fake_sdk(tmp_path, b"v2.45.0.250101000000")
    found = detect_qnn_version("2.50", env, NO_ORT)
    assert found.version == QnnVersion(2, 50, 0) and found.source == "--qnn-version"


@pytest.mark.parametrize("content", [b"no build id here", b""])
def test_sdk_without_build_id_is_unknown(tmp_path, content):
    env = _fake_sdk(tmp_path, content)
    found = detect_qnn_version(None, env, lambda: (QnnVersion(2, 51), "wheel"))
    assert found.version is None and "libQnnHtp.so" in found.detail


def test_sdk_root_missing_library_is_unknown(tmp_path):
    found = detect_qnn_version(None, {"QNN_SDK_ROOT": str(tmp_path / "nowhere")}, NO_ORT)
    assert found.version is None and "cannot read" in found.detail


def test_falls_back_to_onnxruntime_qnn():
    found = detect_qnn_version(None, {}, lambda: (QnnVersion(2, 51, 0), "onnxruntime-qnn 2.7.0"))
    assert found.version == QnnVersion(2, 51, 0) and found.source == "onnxruntime-qnn"


def test_installed_onnxruntime_qnn_is_read():
    pytest.importorskip("onnxruntime_qnn")
    from npuq.lower.target import installed_ort_qnn_version

    version, where = installed_ort_qnn_version()
    assert version >= QnnVersion(2, 0, 0) and where.startswith("onnxruntime-qnn")


@pytest.mark.parametrize("env", [{}, {"QNN_SDK_ROOT": ""}])
def test_sdk_helper_names_the_variable(env):
    with pytest.raises(QnnEnvironmentError, match="QNN_SDK_ROOT is not set"):
        sdk_htp_library(env)


@pytest.mark.parametrize("env", [{}, {"QNN_SDK_ROOT": ""}])
def test_unset_sdk_root_gives_legacy_and_one_warning(env, caplog):
    """The published bug: QNN_SDK_ROOT unset raised a TypeError from os.path.join(None, ...)."""
    with caplog.at_level(logging.WARNING, logger="npuq.lower"):
        target = resolve_target(env=env, ort_qnn=NO_ORT)
    assert target.qnn_version is None and target.qnn_version_source is None
    assert not target.sdk_at_least((2, 48, 0))  # → legacy embedding pattern
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "--qnn-version" in warnings[0].getMessage() and "QNN_SDK_ROOT" in warnings[0].getMessage()


def test_known_version_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="npuq.lower"):
        target = resolve_target("2.51", env={}, ort_qnn=NO_ORT)
    assert target.sdk_at_least((2, 48, 0)) and not caplog.records


@pytest.mark.parametrize("value, arch", [(73, 73), ("79", 79), ("v68", 68), ("V81", 81)])
def test_parse_htp_arch(value, arch):
    assert parse_htp_arch(value) == arch


@pytest.mark.parametrize("value", [70, "74", "v", "latest", -1])
def test_unknown_arch_lists_known(value):
    with pytest.raises(NpuqError, match="68, 69, 73, 75, 79, 81"):
        parse_htp_arch(value)


@pytest.mark.parametrize("soc, arch", [("SM8350", 68), ("SM8450", 69), ("SM8550", 73), ("sm8650", 75),
                                       ("SM8750", 79), ("SM8850", 81)])
def test_soc_table(soc, arch):
    assert arch_of_soc(soc) == arch
    assert resolve_target("2.51", soc=soc, env={}, ort_qnn=NO_ORT).htp_arch == arch


def test_unknown_soc_lists_known():
    with pytest.raises(NpuqError, match=r"unknown chip 'SM9999'.*SM8650 \(v75\)"):
        arch_of_soc("SM9999")


def test_arch_and_soc_are_exclusive():
    with pytest.raises(NpuqError, match="either --htp-arch or --soc"):
        resolve_target("2.51", htp_arch=73, soc="SM8650", env={}, ort_qnn=NO_ORT)


def test_unparseable_flag_is_a_user_error():
    with pytest.raises(NpuqError, match="cannot read QNN version 'two'"):
        resolve_target("two", env={}, ort_qnn=NO_ORT)
