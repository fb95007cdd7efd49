"""Resource guards: the calibration memory estimate and batch fit, what the machine has left
(meminfo, cgroup), and the free-disk check."""

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from npuq.errors import NpuqError
from npuq.testing.tiny import tiny_decoder
from npuq.resources import (
    USABLE_FRACTION,
    available_memory,
    cgroup_memory_headroom,
    check_free_disk,
    fit_calibration_batch,
    guard_calibration_batch,
    meminfo_available,
    onepass_window_bytes,
)
from npuq.runtime.runner import step_inputs


@pytest.fixture(scope="module")
def tiny():
    return tiny_decoder("gemma3", max_context=64)[1]  # sliding layers: a 2-channel mask


def test_estimate_covers_what_the_forward_holds_at_once(tiny):
    """At the end of a forward the mask, the logits and every layer's K/V outputs are alive
    together; inside a layer two (H, L, L) score tensors. Measured on real tensors."""
    cfg, L = tiny.config, 48
    inputs = step_inputs(cfg, torch.randint(3, cfg.vocab_size, (1, L)), 0, L)
    with torch.no_grad():
        outputs = tiny(*inputs)
    held_at_end = sum(t.numel() * t.element_size() for t in outputs) + inputs[1].numel() * inputs[1].element_size()
    scores = cfg.num_heads * L * L * 4
    estimate = onepass_window_bytes(cfg, L)
    assert estimate >= held_at_end and estimate >= held_at_end - outputs[0].numel() * 4 + 2 * scores
    assert estimate < 4 * (held_at_end + 2 * scores)  # not wildly pessimistic either


def test_batch_shrinks_to_what_fits(tiny):
    per = onepass_window_bytes(tiny.config, 32)
    three = int(3 * per / USABLE_FRACTION) + 1  # room for exactly three windows
    fit = fit_calibration_batch(tiny.config, 32, requested=8, available=three)
    assert (fit.batch, fit.reduced, fit.window_bytes) == (3, True, per)
    assert fit_calibration_batch(tiny.config, 32, requested=2, available=three).batch == 2
    with pytest.warns(UserWarning, match=r"--batch-size 8 .* calibrating 3 window\(s\)"):
        assert guard_calibration_batch(tiny.config, 32, 8, available=three).batch == 3


def test_refused_when_one_window_does_not_fit(tiny):
    per = onepass_window_bytes(tiny.config, 64)
    with pytest.raises(NpuqError, match=r"needs about .* GiB for a single window but only .* GiB .* sequential"):
        fit_calibration_batch(tiny.config, 64, requested=1, available=int(per / USABLE_FRACTION) - 1)


def test_meminfo_and_cgroup_files(tmp_path):
    assert meminfo_available("MemTotal:  100 kB\nMemAvailable:   2048 kB\n") == 2048 * 1024
    assert meminfo_available("MemTotal: 100 kB\n") is None
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("1000\n")
    assert cgroup_memory_headroom(v2) is None  # no limit
    (v2 / "memory.max").write_text("5000\n")
    assert cgroup_memory_headroom(v2) == 4000
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    (v1 / "memory.usage_in_bytes").write_text("7\n")
    assert cgroup_memory_headroom(tmp_path / "v1") is None
    (v1 / "memory.limit_in_bytes").write_text("107\n")
    assert cgroup_memory_headroom(tmp_path / "v1") == 100


def test_available_memory_is_within_the_machine():
    total = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal:"))) * 1024
    assert 0 < available_memory() <= total


Usage = namedtuple("Usage", "total used free")


def test_disk_check(tmp_path, monkeypatch):
    seen = []

    def fake(path):
        seen.append(Path(path))
        return Usage(10 << 30, 0, 100 << 20)  # 100 MiB free

    monkeypatch.setattr(shutil, "disk_usage", fake)
    deep = tmp_path / "not" / "yet" / "out"
    assert check_free_disk(deep, 50 << 20, "the artifact") == 100 << 20
    assert seen[-1] == tmp_path  # the nearest folder that exists
    with pytest.raises(NpuqError, match=r"the artifact needs about 95\.0 MiB but only 100\.0 MiB is free .* another disk"):
        check_free_disk(deep, 95 << 20, "the artifact")  # fits only without the margin
