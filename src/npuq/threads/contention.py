"""How long this process's threads waited for a CPU that another process held.

A thread count timed while another job runs on the same CPUs measures that job as much as the
workload: OpenMP threads that meet at a barrier wait for the one the scheduler took away, so
more threads lose most (docs/design.md §4: on this project's 2-CPU machine, beside a running
quantize, a Qwen2.5-0.5B prefill took 3.7 s at 2 threads and 2.0 s at 1, its threads waiting
60 % of the time). Such a result must not be cached for later runs.

Linux keeps, per thread, the nanoseconds it ran and the nanoseconds it was runnable but waiting
on a run queue (``/proc/<pid>/task/<tid>/schedstat``: "run wait timeslices"). A thread that
sleeps or blocks is in neither, so the share of waiting is contention alone, whatever the
workload's spinning or sleeping habits. Elsewhere (or with schedstats off) there is no
reading, and nothing is judged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

TASKS = Path("/proc/self/task")
# Less CPU time than this in a measurement says nothing about contention (a few scheduler ticks).
MIN_NS = 50_000_000

Snapshot = Mapping[int, tuple[int, int]]  # thread id → (ns on a CPU, ns waiting for one)


def parse_schedstat(text: str) -> tuple[int, int]:
    """(ns run, ns waiting on a run queue) from one schedstat line "RUN WAIT SLICES"."""
    fields = text.split()
    if len(fields) < 2:
        raise ValueError(f"schedstat {text.strip()!r}: expected 'run wait timeslices'")
    return int(fields[0]), int(fields[1])


def snapshot(tasks: str | os.PathLike = TASKS) -> Snapshot | None:
    """Run and wait times of every thread of this process now, or None where the kernel has none."""
    times = {}
    try:
        names = os.listdir(tasks)
    except OSError:
        return None
    for name in names:
        try:
            times[int(name)] = parse_schedstat(Path(tasks, name, "schedstat").read_text())
        except FileNotFoundError:  # the thread ended between listing and reading
            continue
        except (OSError, ValueError):
            return None
    return times


def waited(before: Snapshot | None, after: Snapshot | None) -> tuple[int, int]:
    """(ns run, ns waited) by this process's threads between two snapshots; (0, 0) without them.

    A thread started in between counts from zero; one that ended is lost with its time."""
    if before is None or after is None:
        return 0, 0
    run = wait = 0
    for tid, (r, w) in after.items():
        r0, w0 = before.get(tid, (0, 0))
        run, wait = run + r - r0, wait + w - w0
    return run, wait


def waited_share(run_ns: int, wait_ns: int) -> float | None:
    """The share of runnable time spent waiting for a CPU; None below MIN_NS of it (no verdict)."""
    total = run_ns + wait_ns
    return wait_ns / total if total >= MIN_NS else None
