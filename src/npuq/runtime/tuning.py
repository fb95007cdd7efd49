"""The threads stage: the fastest thread count of each phase on this machine, measured on the
float model's own workloads (npuq.runtime.workloads) and cached per host (npuq.threads).

``npuq tune-threads`` and the threads stage of ``npuq run`` are both :func:`run_threads`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from npuq.errors import NpuqError
from npuq.models.stream import StreamedDecoder
from npuq.runtime.context import ExecutionContext
from npuq.runtime.workloads import PHASES, phase_workload
from npuq.threads import TuneResult, cpu_limits, is_contended, tune_cached


@dataclass(frozen=True)
class ThreadsOptions:
    """What is tuned: each field is the ``npuq tune-threads`` flag of the same name."""

    model: str = "smollm2-135m"
    phases: tuple[str, ...] = PHASES
    context: int = 512
    prefill_len: int = 32  # ar_len of the prefill workload
    retune: bool = False  # measure again even if the cache has a result

    def __post_init__(self) -> None:
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown or not self.phases:
            raise NpuqError(f"unknown phase(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PHASES)}")
        if self.context < 2:
            raise NpuqError(f"--context {self.context} is too small: a window needs at least 2 tokens")
        if self.prefill_len < 1:
            raise NpuqError(f"--prefill-len {self.prefill_len} must be at least 1")
        if self.prefill_len > self.context:
            raise NpuqError(f"--prefill-len {self.prefill_len} exceeds --context {self.context}: "
                            f"use at most {self.context}")


@dataclass(frozen=True)
class ThreadsResult:
    model: str
    context: int
    prefill_len: int
    affinity_cpus: int
    cgroup_quota_cpus: float | None
    ceiling: int
    plan: dict[str, int]  # phase → threads
    sweeps: tuple[dict[str, Any], ...]  # npuq.threads.TuneResult.to_dict() per phase

    def tune_results(self) -> list[TuneResult]:
        return [TuneResult.from_dict(s) for s in self.sweeps]

    @classmethod
    def stale(cls, data: dict[str, Any]) -> bool:
        """Whether a stored result (``npuq run``'s threads stage) must be measured again: one of
        its sweeps was timed beside other work (npuq.threads.is_contended, the per-host cache's
        rule), so a rerun tunes anew. A sweep stored before npuq read contention has none."""
        return any(is_contended(s.get("contention")) for s in data.get("sweeps", ()))

    def describe(self) -> str:
        """One row per phase: the chosen count, its time per step and its speedup over torch's default."""
        rows = [f"{'phase':<10}{'best':>5}{'ms/step':>10}{'default':>9}{'speedup':>9}{'tuning s':>10}  cached"]
        for r in self.tune_results():
            ms = "-" if r.best_seconds is None else f"{r.best_seconds * 1e3:.1f}"
            speedup = "-" if r.speedup_vs_default is None else f"{r.speedup_vs_default:.2f}x"
            rows.append(f"{r.phase:<10}{r.best:>5}{ms:>10}{r.default_threads:>9}{speedup:>9}"
                        f"{r.tuning_seconds:>10.1f}  {r.cached}")
        return "\n".join(rows)


def run_threads(options: ThreadsOptions, model: torch.nn.Module, ctx: ExecutionContext) -> ThreadsResult:
    """Tune ``options.phases`` on the float ``model`` (a StaticDecoder) up to the CPUs this
    process may use now (affinity mask and cgroup quota); the candidates' times go to stderr
    when ``ctx.progress``. A streamed model is not timed: every phase gets the user's count, else
    the ceiling, and no sweeps."""
    limits = cpu_limits()
    if isinstance(model, StreamedDecoder):  # a model too large for memory: each timed step would read every weight
        count = ctx.requested or limits.ceiling  # whole-window work is fastest on every core (docs/design.md §4)
        return ThreadsResult(options.model, options.context, options.prefill_len, limits.affinity, limits.quota,
                             limits.ceiling, dict.fromkeys(options.phases, count), ())
    if ctx.progress:
        print(f"ceiling {limits.ceiling} threads (affinity {limits.affinity} CPUs, cgroup quota "
              f"{limits.quota or 'none'})", file=sys.stderr)
    results = []
    for phase in options.phases:
        workload = phase_workload(model, phase, options.context, options.prefill_len if phase == "prefill" else None)

        def progress(n: int, seconds: float | None, phase: str = phase) -> None:
            shown = "failed" if seconds is None else f"{seconds * 1e3:.1f} ms"
            print(f"  {phase:<9} {n:>3} threads  {shown}", file=sys.stderr)

        results.append(tune_cached(phase, workload, ceiling=limits.ceiling, retune=options.retune,
                                   on_candidate=progress if ctx.progress else None))
    return ThreadsResult(options.model, options.context, options.prefill_len, limits.affinity, limits.quota,
                         limits.ceiling, {r.phase: r.best for r in results}, tuple(r.to_dict() for r in results))
