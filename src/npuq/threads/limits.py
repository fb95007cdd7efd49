"""How many CPUs this process may use: the ceiling for every thread count npuq picks.

Two limits apply and neither shows in the other:
- the affinity mask (taskset, cgroup cpusets), read with ``os.sched_getaffinity(0)``;
- the CFS bandwidth quota of the cgroup (``docker --cpus``, Kubernetes CPU limits), CPU time per
  period, which leaves the affinity mask alone: a 4-CPU container on a 64-CPU host sees 64 CPUs.

Unlike the published version (docs/design.md §4) the ceiling is not capped by
``torch.get_num_threads()``: that number is torch's default or an earlier setting, not a limit,
and capping by it would stop a tuner that runs after ``OMP_NUM_THREADS=1`` or inside a narrower
scope from ever trying more threads. A user who wants fewer threads passes them explicitly.

The parsers take file text or a root folder, so tests feed them fixture files.
"""

from __future__ import annotations

import os
import platform
import warnings
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 mounts the cpu controller under one of these names, depending on the distribution.
V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def quota_cpus(quota_us: int, period_us: int) -> int:
    """CPUs a quota of ``quota_us`` per ``period_us`` allows, rounded up, at least 1."""
    return max(1, -(-quota_us // period_us))


def parse_cpu_max(text: str) -> int | None:
    """cgroup v2 ``cpu.max``: "QUOTA PERIOD" in µs, or "max PERIOD" (no limit → None)."""
    fields = text.split()
    if not fields:
        raise ValueError("empty cpu.max")
    if fields[0] == "max":
        return None
    quota = int(fields[0])
    period = int(fields[1]) if len(fields) > 1 else 100_000  # the kernel's default period
    if quota <= 0 or period <= 0:
        raise ValueError(f"cpu.max {text.strip()!r}: quota and period must be positive")
    return quota_cpus(quota, period)


def parse_cfs(quota_text: str, period_text: str) -> int | None:
    """cgroup v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` (quota -1 = no limit → None)."""
    quota, period = int(quota_text), int(period_text)
    if quota < 0:
        return None
    if quota == 0 or period <= 0:
        raise ValueError(f"cfs quota {quota} / period {period}: both must be positive")
    return quota_cpus(quota, period)


def parse_self_cgroup(text: str) -> tuple[str | None, str | None]:
    """The cgroup paths of this process from ``/proc/self/cgroup``: (v2 path, v1 cpu path).

    Lines read "HIERARCHY:CONTROLLERS:PATH"; v2 is hierarchy 0 with no controllers.
    """
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _own_and_ancestors(base: Path, rel: str | None) -> list[Path]:
    """``base/rel`` and every folder above it up to ``base``; just ``base`` if that is all there is.

    Inside a container the cgroup namespace usually mounts the container's own cgroup at
    ``base`` while /proc/self/cgroup names a path that does not exist there.
    """
    rel_parts = [p for p in (rel or "").split("/") if p]
    folders = [base.joinpath(*rel_parts[:i]) for i in range(len(rel_parts), -1, -1)]
    return [f for f in folders if f.is_dir()] or [base]


def _read_limit(parse, *files: Path) -> int | None:
    """Parse the limit in ``files`` (None when a file is missing; a warning when it is unreadable)."""
    try:
        texts = [f.read_text() for f in files]
    except OSError:
        return None
    try:
        return parse(*texts)
    except ValueError as exc:
        warnings.warn(f"ignoring the CPU quota in {files[0]}: {exc}", stacklevel=3)
        return None


def cgroup_cpu_limit(root: str | os.PathLike = CGROUP_ROOT, self_cgroup: str | None = None) -> int | None:
    """CPUs allowed by the cgroup v2 or v1 CPU quota of this process, or None when there is none.

    ``self_cgroup`` is the text of /proc/self/cgroup (read when None). The tightest quota of the
    process's cgroup and its ancestors wins, as the kernel enforces every one of them.
    """
    root = Path(root)
    if self_cgroup is None:
        try:
            self_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            self_cgroup = ""
    v2_path, v1_path = parse_self_cgroup(self_cgroup)
    limits = [_read_limit(parse_cpu_max, d / "cpu.max") for d in _own_and_ancestors(root, v2_path)]
    for name in V1_CPU_DIRS:
        if (root / name).is_dir():
            for d in _own_and_ancestors(root / name, v1_path):
                limits.append(_read_limit(parse_cfs, d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"))
    found = [n for n in limits if n is not None]
    return min(found) if found else None


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (taskset, cpusets); os.cpu_count() where unsupported."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuLimits:
    affinity: int  # CPUs in the affinity mask
    quota: int | None  # CPUs the cgroup quota allows (rounded up), None = no quota

    @property
    def ceiling(self) -> int:
        return max(1, min(self.affinity, self.quota) if self.quota is not None else self.affinity)


def cpu_limits(root: str | os.PathLike = CGROUP_ROOT, self_cgroup: str | None = None) -> CpuLimits:
    return CpuLimits(affinity_cpus(), cgroup_cpu_limit(root, self_cgroup))


def cpu_ceiling() -> int:
    """The most threads worth running here: the affinity mask capped by the cgroup CPU quota."""
    return cpu_limits().ceiling


def parse_cpu_model(cpuinfo: str) -> str | None:
    """The CPU's name from /proc/cpuinfo text ("model name" on x86, "Hardware"/"CPU part" on Arm)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    for key in ("model name", "Hardware", "Processor", "CPU part"):
        if fields.get(key):
            return fields[key]
    return None


def cpu_model() -> str:
    """This host's CPU model, for cache keys; the platform's machine name when /proc is absent."""
    try:
        name = parse_cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        name = None
    return name or platform.processor() or platform.machine() or "unknown"
