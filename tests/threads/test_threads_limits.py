"""The CPU ceiling: cgroup v1/v2 quotas from fixture trees, affinity, CPU model names."""

from pathlib import Path

import pytest

from npuq.threads.limits import (
    CpuLimits, cgroup_cpu_limit, cpu_limits, parse_cfs, parse_cpu_max, parse_cpu_model, parse_self_cgroup,
    quota_cpus,
)

FIXTURES = Path(__file__).parent / "fixtures"
V2_ONLY = "0::/\n"
V1_ONLY = "4:memory:/\n3:cpu,cpuacct:/\n"


@pytest.mark.parametrize("text, cpus", [
    ("max 100000", None), ("400000 100000", 4), ("150000 100000", 2), ("50000 100000", 1),
    ("100000", 1), ("max", None),
])
def test_parse_cpu_max(text, cpus):
    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize("quota, period, cpus", [("-1", "100000", None), ("200000", "100000", 2),
                                                 ("250000", "100000", 3), ("1000", "100000", 1)])
def test_parse_cfs(quota, period, cpus):
    assert parse_cfs(quota, period) == cpus


@pytest.mark.parametrize("text", ["", "lots", "0 100000", "100000 0"])
def test_parse_cpu_max_rejects_nonsense(text):
    with pytest.raises(ValueError):
        parse_cpu_max(text)


def test_quota_rounds_up_and_is_at_least_one():
    assert [quota_cpus(q, 100_000) for q in (1, 100_000, 100_001, 720_000)] == [1, 1, 2, 8]


def test_parse_self_cgroup():
    assert parse_self_cgroup("0::/user.slice/job\n") == ("/user.slice/job", None)
    assert parse_self_cgroup("5:cpuacct,cpu:/docker/abc\n2:memory:/x\n") == (None, "/docker/abc")
    assert parse_self_cgroup("12:cpuset:/a\n1:name=systemd:/b\n0::/\n") == ("/", None)


@pytest.mark.parametrize("tree, self_cgroup, cpus", [
    ("v2_quota4", V2_ONLY, 4),
    ("v2_unlimited", V2_ONLY, None),
    ("v2_fraction", V2_ONLY, 2),
    ("v1_quota2", V1_ONLY, 2),  # mounted as "cpu,cpuacct"
    ("v1_unlimited", V1_ONLY, None),
    ("v2_nested", "0::/kubepods/pod7\n", 3),  # the pod is unlimited, its parent allows 3
    ("v2_nested", "0::/\n", None),  # a process in the root cgroup is not under kubepods
    ("v2_nested", "0::/elsewhere/job\n", None),  # path absent under the mount: only the mount root counts
    ("v1_nested", "3:cpu,cpuacct:/docker/abc\n", 1),
    ("v1_nested", "3:cpu,cpuacct:/docker/other\n", None),
])
def test_cgroup_cpu_limit_from_fixture_trees(tree, self_cgroup, cpus):
    assert cgroup_cpu_limit(FIXTURES / tree, self_cgroup) == cpus


def test_missing_cgroup_folder_means_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path / "absent", V2_ONLY) is None


def test_corrupt_cpu_max_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="ignoring the CPU quota"):
        assert cgroup_cpu_limit(FIXTURES / "v2_corrupt", V2_ONLY) is None


@pytest.mark.parametrize("affinity, quota, ceiling", [(64, 4, 4), (2, 8, 2), (72, None, 72), (1, None, 1)])
def test_ceiling_is_the_tighter_of_affinity_and_quota(affinity, quota, ceiling):
    assert CpuLimits(affinity, quota).ceiling == ceiling


def test_cpu_limits_here_uses_the_affinity_mask():
    import os

    limits = cpu_limits(FIXTURES / "v2_quota4", V2_ONLY)
    assert limits.affinity == len(os.sched_getaffinity(0))
    assert limits.ceiling == min(limits.affinity, 4)


def test_cpu_model_names():
    assert parse_cpu_model((FIXTURES / "cpuinfo_x86.txt").read_text()) == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    assert parse_cpu_model((FIXTURES / "cpuinfo_arm.txt").read_text()) == "Qualcomm Technologies, Inc SM8650"
    assert parse_cpu_model("processor : 0\n") is None
