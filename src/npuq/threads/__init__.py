"""CPU thread counts: measured per phase, applied in a scope, cached per host.

The rest of npuq uses exactly two things from here:

- ``thread_scope(n)`` / ``plan.scope(phase)``: the only way npuq changes thread counts;
- ``plan_threads(workloads, requested)``: a :class:`ThreadPlan` from user counts, the cache or
  fresh tuning, built once and passed down to the code that runs each phase.
"""

from npuq.threads.limits import CpuLimits, cgroup_cpu_limit, cpu_ceiling, cpu_limits, cpu_model
from npuq.threads.plan import (SOURCES, ExecutionSummary, PhaseThreads, ThreadPlan, check_requested, plan_threads,
                               tune_cached)
from npuq.threads.scope import scope_or_keep, thread_scope
from npuq.threads.tuner import (BUDGETED, CONTENDED, EXHAUSTIVE, TuneResult, TuneSettings, Workload, candidate_counts,
                                choose, is_contended, tune)

__all__ = [
    "BUDGETED", "CONTENDED", "EXHAUSTIVE", "SOURCES", "CpuLimits", "ExecutionSummary", "PhaseThreads", "ThreadPlan",
    "TuneResult", "TuneSettings", "Workload",
    "candidate_counts", "cgroup_cpu_limit", "check_requested", "choose", "cpu_ceiling", "cpu_limits",
    "cpu_model", "is_contended", "plan_threads", "scope_or_keep",
    "thread_scope", "tune", "tune_cached",
]
