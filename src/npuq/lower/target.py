"""The lowering target: QNN SDK version and HTP architecture, both of which gate patterns.

The SDK version decides which backend patterns compile (the optimized per-channel embedding
needs 2.48, docs/design.md §6); the HTP architecture decides which numeric formats run (a
16-bit × int16 MatMul needs v73 or newer, §9). Where the version comes from, in order:

    1. ``--qnn-version X.Y[.Z]`` (an explicit choice always wins)
    2. ``$QNN_SDK_ROOT``: the build id inside lib/x86_64-linux-clang/libQnnHtp.so,
       a string like ``v2.51.0.260929181845``
    3. an installed ``onnxruntime-qnn`` wheel: the QNN version it bundles

When none of them yields a version the target is "unknown" and the lowering uses only
patterns valid on every SDK, after ONE warning that says how to choose. Versions compare as
(major, minor, patch) tuples, so 3.0 is newer than 2.48 (the published check compared minor
versions within major 2 only).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from npuq.errors import NpuqError

log = logging.getLogger("npuq.lower")

HTP_LIBRARY = Path("lib") / "x86_64-linux-clang" / "libQnnHtp.so"
SDK_ROOT_VARIABLE = "QNN_SDK_ROOT"

# HTP architectures the lowering knows (QNN_HTP_DEVICE_ARCH_Vxx).
HTP_ARCHS = (68, 69, 73, 75, 79, 81)

# Chip → HTP architecture, as the ExecuTorch Qualcomm backend maps them
# (backends/qualcomm/utils/utils.py, get_soc_to_arch_map).
SOC_TABLE: dict[str, int] = {
    "SM8350": 68,  # Snapdragon 888
    "SA8295": 68,
    "QCM6490": 68,
    "SM8450": 69,  # Snapdragon 8 Gen 1
    "SM8475": 69,  # Snapdragon 8+ Gen 1
    "SXR2230P": 69,
    "SM8550": 73,  # Snapdragon 8 Gen 2
    "SA8255": 73,
    "SSG2115P": 73,
    "SSG2125P": 73,
    "SXR1230P": 73,
    "QCS9100": 73,
    "SM8650": 75,  # Snapdragon 8 Gen 3
    "SM8750": 79,  # Snapdragon 8 Elite
    "SXR2330P": 79,
    "SM8850": 81,  # Snapdragon 8 Elite Gen 5
    "SM8845": 81,
    "SAR2230P": 81,
    "SW6100": 81,
}

# First SDK version with the optimized PCQ-embedding pattern (ExecuTorch PR #20686).
PCQ_EMBEDDING_OPTIMIZED_SDK = (2, 48, 0)
# First HTP architecture where a MatMul of uint16 × int16 symmetric runs (docs/design.md §9).
INT16_MATMUL_ARCH = 73


class QnnEnvironmentError(NpuqError, EnvironmentError):
    """The environment lacks what a helper needs (an unset variable, a missing library)."""


@dataclass(frozen=True, order=True)
class QnnVersion:
    """A QNN SDK version; instances order as (major, minor, patch) tuples."""

    major: int
    minor: int
    patch: int = 0

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)


_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.(\d+))?")
_BUILD_ID = re.compile(rb"v(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{6,})")


def parse_version(text: str) -> QnnVersion:
    """``"2.51"``, ``"2.51.0"``, ``"v2.51.0.260929181845"`` → QnnVersion; anything else raises."""
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        raise NpuqError(
            f"cannot read QNN version {text!r}: expected MAJOR.MINOR[.PATCH] such as 2.51 or 2.51.0"
        )
    major, minor, patch = (int(g) if g else 0 for g in match.groups()[:3])
    return QnnVersion(major, minor, patch)


def version_from_build_id(build_id: str | None) -> QnnVersion | None:
    """The version inside a build id such as ``v2.51.0.260929181845``; None when unreadable."""
    if not build_id:
        return None
    match = _BUILD_ID.search(build_id.encode("ascii", "replace"))
    if match is None:
        return None
    return QnnVersion(*(int(g) for g in match.groups()[:3]))


def find_build_id(data: bytes | mmap.mmap) -> str | None:
    """The first QNN build id (``vMAJOR.MINOR.PATCH.BUILD``) in a library's bytes, else None."""
    match = _BUILD_ID.search(data)
    return match.group(0).decode("ascii") if match else None


def read_build_id(library: str | os.PathLike) -> str | None:
    """Scan a QNN backend library for its build id; None when the file has none."""
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return find_build_id(data)


def sdk_htp_library(env: Mapping[str, str] | None = None) -> Path:
    """Path of the HTP backend library of the SDK at $QNN_SDK_ROOT.

    Raises :class:`QnnEnvironmentError` naming the variable when it is unset or empty (the
    published helper joined a path with None and failed with a TypeError instead).
    """
    env = os.environ if env is None else env
    root = env.get(SDK_ROOT_VARIABLE)
    if not root:
        raise QnnEnvironmentError(
            f"{SDK_ROOT_VARIABLE} is not set: pass --qnn-version or set it to the QNN SDK folder"
        )
    return Path(root) / HTP_LIBRARY


def installed_ort_qnn_version() -> tuple[QnnVersion, str] | None:
    """(QNN version, description) of an installed onnxruntime-qnn wheel, else None.

    The wheel records the version it bundles in ``onnxruntime_qnn.build_and_package_info
    .qnn_version``; older wheels without it are scanned for the build id of their libQnnHtp.so.
    """
    try:
        # optional: the QNN HTP execution provider (onnxruntime-qnn)
        import onnxruntime_qnn
    except ImportError:
        return None
    info = getattr(onnxruntime_qnn, "build_and_package_info", None)
    wheel = getattr(info, "__version__", "?")
    text = getattr(info, "qnn_version", None)
    if text:
        try:
            return parse_version(str(text)), f"onnxruntime-qnn {wheel}"
        except NpuqError:
            pass
    try:
        version = version_from_build_id(read_build_id(onnxruntime_qnn.get_qnn_htp_path()))
    except OSError:
        return None
    return (version, f"onnxruntime-qnn {wheel}") if version else None


@dataclass(frozen=True)
class VersionLookup:
    """The outcome of looking for the SDK version: the version (or None) and where it came from."""

    version: QnnVersion | None
    source: str | None  # "--qnn-version", "QNN_SDK_ROOT", "onnxruntime-qnn ..." or None
    detail: str  # one sentence for logs and the manifest


def detect_qnn_version(
    explicit: str | None = None,
    env: Mapping[str, str] | None = None,
    ort_qnn: Callable[[], tuple[QnnVersion, str] | None] | None = None,
) -> VersionLookup:
    """Find the target SDK version (see the module docstring for the order). Never raises for
    a missing or unreadable SDK; an unparseable ``explicit`` string is a user error."""
    if explicit is not None:
        return VersionLookup(parse_version(explicit), "--qnn-version", f"QNN {explicit} given on the command line")
    env = os.environ if env is None else env
    if env.get(SDK_ROOT_VARIABLE):
        library = sdk_htp_library(env)
        try:
            build_id = read_build_id(library)
        except (OSError, ValueError) as exc:  # missing, unreadable or empty file
            return VersionLookup(None, None, f"cannot read {library}: {exc}")
        version = version_from_build_id(build_id)
        if version is None:
            return VersionLookup(None, None, f"no QNN build id found in {library}")
        return VersionLookup(version, SDK_ROOT_VARIABLE, f"build id {build_id} in {library}")
    found = (ort_qnn or installed_ort_qnn_version)()
    if found is not None:
        version, where = found
        return VersionLookup(version, "onnxruntime-qnn", f"QNN {version} bundled with {where}")
    return VersionLookup(None, None, f"{SDK_ROOT_VARIABLE} is not set and onnxruntime-qnn is not installed")


def parse_htp_arch(value: int | str) -> int:
    """68 | 69 | 73 | 75 | 79 | 81 (also "v73"); anything else is a user error listing the known ones."""
    text = str(value).strip().lower().lstrip("v")
    if not text.isdigit() or int(text) not in HTP_ARCHS:
        raise NpuqError(
            f"unknown HTP architecture {value!r}; known: {', '.join(str(a) for a in HTP_ARCHS)}"
        )
    return int(text)


def arch_of_soc(soc: str) -> int:
    """HTP architecture of a chip name such as SM8650; unknown chips list the known ones."""
    try:
        return SOC_TABLE[soc.strip().upper()]
    except KeyError:
        known = ", ".join(f"{name} (v{arch})" for name, arch in sorted(SOC_TABLE.items(), key=lambda kv: (kv[1], kv[0])))
        raise NpuqError(f"unknown chip {soc!r}; known chips: {known}; or pass --htp-arch") from None


@dataclass(frozen=True)
class Target:
    """What the lowering may assume about the backend. None means unknown: use what every
    version (or architecture) accepts."""

    qnn_version: QnnVersion | None = None
    qnn_version_source: str | None = None
    htp_arch: int | None = None
    soc: str | None = None

    def __post_init__(self) -> None:
        if self.htp_arch is not None and self.htp_arch not in HTP_ARCHS:
            raise NpuqError(f"unknown HTP architecture {self.htp_arch}; known: {', '.join(map(str, HTP_ARCHS))}")

    def sdk_at_least(self, version: tuple[int, int, int]) -> bool:
        return self.qnn_version is not None and self.qnn_version.as_tuple() >= tuple(version)

    def arch_at_least(self, arch: int) -> bool:
        return self.htp_arch is not None and self.htp_arch >= arch

    def describe(self) -> str:
        sdk = f"QNN {self.qnn_version} ({self.qnn_version_source})" if self.qnn_version else "QNN version unknown"
        arch = f"HTP v{self.htp_arch}" + (f" ({self.soc})" if self.soc else "") if self.htp_arch else "HTP arch unknown"
        return f"{sdk}, {arch}"


def resolve_target(
    qnn_version: str | None = None,
    htp_arch: int | str | None = None,
    soc: str | None = None,
    env: Mapping[str, str] | None = None,
    ort_qnn: Callable[[], tuple[QnnVersion, str] | None] | None = None,
) -> Target:
    """Build the target from command-line choices and the environment.

    Logs exactly one warning when the SDK version cannot be determined (the lowering then
    keeps to patterns every SDK compiles).
    """
    if htp_arch is not None and soc is not None:
        raise NpuqError("pass either --htp-arch or --soc, not both")
    arch = parse_htp_arch(htp_arch) if htp_arch is not None else (arch_of_soc(soc) if soc is not None else None)
    lookup = detect_qnn_version(qnn_version, env, ort_qnn)
    if lookup.version is None:
        log.warning(
            "QNN SDK version unknown (%s): lowering with patterns valid on every SDK version "
            "(legacy PCQ embedding); pass --qnn-version X.Y or set %s to the SDK folder to choose",
            lookup.detail, SDK_ROOT_VARIABLE,
        )
    return Target(lookup.version, lookup.source, arch, soc.strip().upper() if soc else None)
