"""ThreadPlan: the thread count of every phase, where it came from, and the scope that applies it.

A plan is built once (:func:`plan_threads`: user counts, cached results, or fresh tuning) and
handed to the code that runs each phase, which wraps its work in ``plan.scope(phase)``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, ContextManager, Mapping

import torch

from npuq.errors import NpuqError
from npuq.threads import cache
from npuq.threads.limits import cpu_ceiling
from npuq.threads.scope import thread_scope
from npuq.threads.tuner import BUDGETED, TuneResult, TuneSettings, Workload, tune

# measured now, read from the cache, given by the user, torch's count kept (work off the CPU: no tuning)
SOURCES = ("auto", "cache", "user", "kept")


@dataclass(frozen=True)
class ThreadPlan:
    threads: Mapping[str, int]  # phase → thread count
    sources: Mapping[str, str]  # phase → one of SOURCES

    def __post_init__(self) -> None:
        if set(self.threads) != set(self.sources):
            raise ValueError(f"phases with counts {sorted(self.threads)} differ from phases with sources {sorted(self.sources)}")
        for phase, n in self.threads.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"phase {phase!r}: thread count must be a whole number >= 1, got {n!r}")
            if self.sources[phase] not in SOURCES:
                raise ValueError(f"phase {phase!r}: source {self.sources[phase]!r} is not one of {SOURCES}")
        object.__setattr__(self, "threads", MappingProxyType(dict(self.threads)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    @classmethod
    def fixed(cls, phases: Any, n: int) -> "ThreadPlan":
        """Every phase in ``phases`` at ``n`` threads, as the user asked."""
        return cls({p: n for p in phases}, {p: "user" for p in phases})

    @classmethod
    def untuned(cls, phases: Any, n: int = 0) -> ThreadPlan:
        """For phases that run on a GPU: ``n`` threads as the user asked, or (0) torch's current
        count, kept; CPU thread tuning would time the wrong device."""
        if n > 0:
            return cls.fixed(phases, n)
        return cls({p: torch.get_num_threads() for p in phases}, {p: "kept" for p in phases})

    def scope(self, phase: str) -> ContextManager[int]:
        """``thread_scope`` with this phase's count; restores the previous counts afterwards."""
        if phase not in self.threads:
            raise KeyError(f"the thread plan has no phase {phase!r}; it has {', '.join(self.threads) or 'none'}")
        return thread_scope(self.threads[phase])

    def summary(self) -> str:
        return ", ".join(f"{p}: {n} ({self.sources[p]})" for p, n in self.threads.items())

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {p: {"threads": n, "source": self.sources[p]} for p, n in self.threads.items()}


@dataclass(frozen=True)
class PhaseThreads:
    threads: int
    source: str  # one of SOURCES


@dataclass(frozen=True)
class ExecutionSummary:
    """Where a run's work ran and at how many threads each planned phase ran (report.json's
    "execution": npuq.runtime.context.ExecutionContext.describe)."""

    device: str
    num_threads: int  # --num-threads; 0: each phase planned
    thread_plan: dict[str, PhaseThreads]  # phase → its count and where that came from, in planning order


def check_requested(n: int, ceiling: int, flag: str = "--num-threads") -> None:
    """A user count must be >= 0 (0 = tune); above the ceiling it runs, oversubscribed, with a warning."""
    if n < 0:
        raise NpuqError(f"{flag} {n} is negative: give 0 for automatic or a count from 1 to {ceiling}")
    if n > ceiling:
        warnings.warn(
            f"{flag} {n} exceeds the {ceiling} CPUs this process may use (affinity mask and cgroup "
            "quota): threads will share CPUs and usually run slower", stacklevel=3,
        )


def tune_cached(
    phase: str,
    workload: Workload,
    *,
    ceiling: int | None = None,
    retune: bool = False,
    cache_root: str | os.PathLike | None = None,
    settings: TuneSettings = BUDGETED,
    on_candidate: Callable[[int, float | None], None] | None = None,
) -> TuneResult:
    """The cached result for ``workload`` on this host, or a fresh tuning stored for next time.

    ``retune`` ignores the cache (and replaces its entry). A cache that cannot be written only
    costs a warning: the result is still returned. Nor is a result stored whose counts waited
    for a CPU more than ``tuner.CONTENDED`` of their time (another process was running): it serves
    this run, with a warning, and the next run tunes again.
    """
    ceiling = cpu_ceiling() if ceiling is None else ceiling
    key = cache.CacheKey.here(workload.signature, ceiling)
    if not retune:
        hit = cache.load(key, cache_root)
        if hit is not None:
            return hit
    result = tune(workload.run, ceiling, phase=phase, settings=settings, signature=workload.signature,
                  on_candidate=on_candidate)
    if result.contended:
        warnings.warn(
            f"while timing the {phase} phase npuq's threads waited for a CPU {result.contention:.0%} of "
            f"the time (other work was running on these CPUs): {result.best} threads serve this run, and "
            "the result is not cached, so the next run measures again (npuq tune-threads --retune on "
            "a quiet machine)", stacklevel=2)
        return result
    try:
        cache.store(key, result, cache_root)
    except OSError as exc:
        warnings.warn(f"could not save the thread-tuning result to the cache: {exc}", stacklevel=2)
    return result


def plan_threads(
    workloads: Mapping[str, Workload],
    requested: int | Mapping[str, int] = 0,
    *,
    retune: bool = False,
    cache_root: str | os.PathLike | None = None,
    settings: TuneSettings = BUDGETED,
) -> tuple[ThreadPlan, dict[str, TuneResult]]:
    """A plan for every phase of ``workloads`` and the tuning results behind its "auto"/"cache" entries.

    ``requested`` is one count for all phases or a count per phase; a positive count is used as
    given ("user"), 0 (or a phase left out of the mapping) is tuned, or read from the cache.
    """
    ceiling = cpu_ceiling()
    per_phase = {p: requested for p in workloads} if isinstance(requested, int) else dict(requested)
    unknown = set(per_phase) - set(workloads)
    if unknown:
        raise ValueError(f"thread counts given for phases without a workload: {sorted(unknown)}")
    threads, sources, results = {}, {}, {}
    for phase, workload in workloads.items():
        n = per_phase.get(phase, 0)
        check_requested(n, ceiling)
        if n > 0:
            threads[phase], sources[phase] = n, "user"
            continue
        result = tune_cached(phase, workload, ceiling=ceiling, retune=retune, cache_root=cache_root,
                             settings=settings)
        threads[phase], sources[phase] = result.best, "cache" if result.cached else "auto"
        results[phase] = result
    return ThreadPlan(threads, sources), results
