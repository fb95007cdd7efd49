"""The execution context: where the work runs and how many CPU threads each phase gets.

Made once where input enters (the CLI, ``npuq run``, or a caller of the API) and passed down;
a stage asks it for ``ctx.scope(phase)`` around the work of that phase and never plans
threads itself. Phases (npuq.runtime.workloads.PHASES): decode (AR-1 steps), prefill (AR-N
chunks), calibrate (whole windows: one-pass calibration and float scoring).

    requested > 0    every phase runs at that count ("user")
    requested = 0    on the CPU each phase gets the count measured fastest for its workload on
                     this host (tuned once, then read from the cache: npuq.threads); off the CPU
                     torch's count is kept ("kept"): CPU tuning would time the wrong device
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ContextManager

import torch

from npuq.device import is_cpu, resolve_device
from npuq.runtime.workloads import phase_workload
from npuq.threads import (ExecutionSummary, PhaseThreads, ThreadPlan, check_requested, cpu_ceiling, plan_threads,
                          scope_or_keep)
from npuq.threads.tuner import Workload


@dataclass
class ExecutionContext:
    device: torch.device
    requested: int = 0  # --num-threads
    progress: bool = False  # show progress bars and stage lines on stderr
    _threads: dict[str, int] = field(default_factory=dict)  # phase → count, once planned
    _sources: dict[str, str] = field(default_factory=dict)  # phase → npuq.threads.SOURCES entry

    @classmethod
    def create(cls, device: str | torch.device = "auto", num_threads: int = 0, progress: bool = False) -> ExecutionContext:
        """Checked at once: a missing GPU or a negative thread count is a one-line error."""
        resolved = resolve_device(device)
        check_requested(num_threads, cpu_ceiling())
        return cls(resolved, num_threads, progress)

    @property
    def on_cpu(self) -> bool:
        return is_cpu(self.device)

    def plan(self, workloads: dict[str, Workload | None]) -> ThreadPlan:
        """Plan every phase of ``workloads`` not planned yet (user count, cache or fresh tuning
        on the CPU; kept elsewhere); returns the plan of those phases. A workload is timed only
        when its phase is tuned (None will do otherwise)."""
        missing = {p: w for p, w in workloads.items() if p not in self._threads}
        if missing:
            if self.on_cpu:
                made, _ = plan_threads(missing, self.requested)
            else:
                made = ThreadPlan.untuned(tuple(missing), self.requested)
            self._threads.update(made.threads)
            self._sources.update(made.sources)
        return self.thread_plan(tuple(workloads))

    def plan_model(self, model: torch.nn.Module | None, phases: tuple[str, ...], context: int,
                   prefill_len: int | None = None) -> ThreadPlan:
        """:meth:`plan` on the float ``model``'s workloads of ``phases`` (npuq.runtime.workloads);
        ``model`` None: nothing is timed, the counts are kept."""
        missing = [p for p in phases if p not in self._threads]
        if model is None and missing:  # nothing to time: the user's count, else torch's current one
            made = ThreadPlan.untuned(tuple(missing), self.requested)
            self._threads.update(made.threads)
            self._sources.update(made.sources)
        elif self.on_cpu and self.requested == 0:
            self.plan({p: phase_workload(model, p, context, prefill_len if p == "prefill" else None) for p in missing})
        else:  # nothing is timed, so no workload is built
            self.plan(dict.fromkeys(missing))
        return self.thread_plan(phases)

    def adopt(self, threads: dict[str, int], source: str = "cache") -> None:
        """Take counts measured elsewhere (the threads stage of ``npuq run``) unless the user gave one."""
        for phase, n in threads.items():
            if phase not in self._threads:
                self._threads[phase], self._sources[phase] = (self.requested, "user") if self.requested else (int(n), source)

    def on(self, device: str | torch.device) -> ExecutionContext:
        """The same request on ``device``; planned counts carry over when both run on the CPU."""
        moved = ExecutionContext(torch.device(device), self.requested, self.progress)
        if moved.on_cpu and self.on_cpu:
            moved._threads, moved._sources = dict(self._threads), dict(self._sources)
        return moved

    def threads(self, phase: str) -> int:
        """The count of ``phase`` (planned), else the user's count, else 0 (torch's count kept)."""
        return self._threads.get(phase, self.requested)

    def scope(self, phase: str) -> ContextManager[int]:
        """Run a block at the phase's thread count; restores the previous count afterwards."""
        return scope_or_keep(self.threads(phase))

    def thread_plan(self, phases: tuple[str, ...]) -> ThreadPlan:
        counts = {p: self._threads.get(p) or self.requested or torch.get_num_threads() for p in phases}
        sources = {p: self._sources.get(p, "user" if self.requested else "kept") for p in phases}
        return ThreadPlan(counts, sources)

    def describe(self) -> ExecutionSummary:
        return ExecutionSummary(str(self.device), self.requested,
                                {p: PhaseThreads(n, self._sources[p]) for p, n in self._threads.items()})

