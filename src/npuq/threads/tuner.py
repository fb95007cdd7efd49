"""Pick the fastest thread count for one workload by timing it at a few candidate counts.

Why measure: decode steps are matrix-vector products bound by memory bandwidth, where OpenMP
barriers across many threads cost more than they save, while prefill and calibration are
matrix-matrix products that scale with cores (docs/design.md §4, executorch PR #18184). The best
count depends on the phase, the model and the host, so it is measured, not guessed.

The core, :func:`tune`, is pure apart from the workload it runs: the clock and the scope that
sets the thread count are parameters, so tests drive it with a fake clock.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

import torch

from npuq.threads import contention
from npuq.threads.scope import thread_scope

# Fractions of the ceiling tried, as published (executorch PR #18184).
FRACTIONS = (1 / 8, 1 / 4, 3 / 8, 1 / 2, 2 / 3, 3 / 4, 1)

Clock = Callable[[], float]  # seconds, monotonic
# A tuning whose threads waited for a CPU more than this share of their runnable time measured
# another process as much as the workload (on a quiet machine the share is a few percent).
CONTENDED = 0.2


def is_contended(share: float | None) -> bool:
    """Whether a tuning that waited for a CPU ``share`` of its time (None: no reading) measured
    other work as much as its workload, so that it is not kept for later runs."""
    return share is not None and share > CONTENDED


Sched = Callable[[], "contention.Snapshot | None"]  # per-thread run and run-queue wait times
Scope = Callable[[int], ContextManager[Any]]


def candidate_counts(ceiling: int) -> list[int]:
    """{1, ceiling} ∪ {max(1, round(ceiling·f)) for f in FRACTIONS}, sorted: 8 → [1, 2, 3, 4, 5, 6, 8]."""
    if ceiling < 1:
        raise ValueError(f"ceiling must be at least 1, got {ceiling}")
    return sorted({1, ceiling} | {max(1, round(ceiling * f)) for f in FRACTIONS})


@dataclass(frozen=True)
class Workload:
    """A zero-argument callable running one step of a phase, and a string naming what it runs.

    ``signature`` keys the cache: two workloads with the same signature must cost the same on
    the same host (same model shapes, mode, lengths, batch, dtype).
    """

    run: Callable[[], object]
    signature: str
    tokens_per_step: int = 1  # tokens one call processes, to convert step times into per-token costs


@dataclass(frozen=True)
class TuneSettings:
    """How candidates are timed and compared.

    Timing runs in two rounds. Round 1 (screening) gives every count ``warmup`` untimed calls
    and one timed sample, skipping the sample when the warm-up already exceeds
    ``warmup_stop_ratio`` × the best first sample so far (a loose bound, because the first call
    after a thread-count change pays one-off costs such as starting OpenMP threads). Round 2
    visits the counts from the fastest first value up: each gets a fresh warm-up and samples up
    to ``repeats`` in all, and its median is its time per call, unless its first value exceeds
    ``stop_ratio`` × the best median so far, which stops it and every slower one (early stop).
    Comparing with medians rather than single samples keeps one lucky sample from condemning
    the rest; screening first keeps a slow first count, which has nothing to be compared with
    yet, from paying for all its samples. A sample loops the workload until it lasts
    ``min_sample_seconds``, so short decode steps are not timed one by one. Counts within
    ``tie_tolerance`` of the fastest median are ties, won by the fewest threads.

    ``budget_seconds`` bounds what tuning may cost beyond round 1 (which always runs, so every
    count is measured once): round 2 makes no call that, by the trial's round-1 time, would end
    later than that many seconds after tuning began. A calibration forward of a whole batch of
    windows takes seconds per call, and five calls per count cost more than the calibration
    they tune (145 s of tuning for 4 s of calibrating SmolLM2-135M on 1024 tokens); a one-off
    cost of a few milliseconds at a thread-count change is invisible in such a call, so one
    sample says what it costs.
    """

    warmup: int = 1
    repeats: int = 3
    min_sample_seconds: float = 0.05
    max_calls_per_sample: int = 1000
    stop_ratio: float = 1.5
    warmup_stop_ratio: float = 3.0
    tie_tolerance: float = 0.03
    budget_seconds: float = math.inf

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1 or self.max_calls_per_sample < 1:
            raise ValueError(f"need warmup >= 0, repeats >= 1, max_calls_per_sample >= 1: {self}")
        if self.stop_ratio < 1 or self.warmup_stop_ratio < 1 or self.tie_tolerance < 0 or self.budget_seconds < 0:
            raise ValueError(f"need stop ratios >= 1, tie_tolerance >= 0 and budget_seconds >= 0: {self}")


EXHAUSTIVE = TuneSettings(warmup=1, repeats=5, stop_ratio=math.inf, warmup_stop_ratio=math.inf)
# What npuq plans with: round 2 within 20 s (a decode or prefill step is done in well under a
# second, so only whole-window calibration forwards ever reach the budget).
BUDGETED = TuneSettings(budget_seconds=20.0)


@dataclass(frozen=True)
class TuneResult:
    """The timing of every candidate of one phase and the count chosen.

    ``seconds[i]`` is the median time per call at ``candidates[i]``, None when that candidate
    raised (its error is in ``errors``). Early-stopped candidates keep what screening measured
    (one sample, or the warm-up when the sample was skipped) and are listed in ``stopped``. ``default_threads`` is the torch count in
    force when tuning began; ``default_seconds`` its time (from ``seconds`` when it is a
    candidate, else timed separately as a reference that is never chosen).
    """

    phase: str
    ceiling: int
    candidates: tuple[int, ...]
    seconds: tuple[float | None, ...]
    best: int
    default_threads: int
    default_seconds: float | None
    tuning_seconds: float
    stopped: tuple[int, ...] = ()
    errors: dict[int, str] = field(default_factory=dict)
    signature: str = ""
    cached: bool = False
    # The largest share of its runnable time that any count's calls spent waiting for a CPU held
    # by another process (npuq.threads.contention); None where the kernel does not say.
    contention: float | None = None

    @property
    def contended(self) -> bool:
        """:func:`is_contended` of this result's ``contention``."""
        return is_contended(self.contention)

    @property
    def best_seconds(self) -> float | None:
        return self.seconds[self.candidates.index(self.best)]

    @property
    def speedup_vs_default(self) -> float | None:
        if self.default_seconds is None or not self.best_seconds:
            return None
        return self.default_seconds / self.best_seconds

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "ceiling": self.ceiling,
            "candidates": list(self.candidates),
            "seconds": list(self.seconds),
            "best": self.best,
            "best_seconds": self.best_seconds,
            "default_threads": self.default_threads,
            "default_seconds": self.default_seconds,
            "speedup_vs_default": self.speedup_vs_default,
            "tuning_seconds": self.tuning_seconds,
            "cached": self.cached,
            "stopped_early": list(self.stopped),
            "errors": {str(n): msg for n, msg in self.errors.items()},
            "signature": self.signature,
            "contention": self.contention,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TuneResult":
        """Inverse of :meth:`to_dict`; raises KeyError/TypeError/ValueError on malformed input."""
        candidates = tuple(int(n) for n in d["candidates"])
        seconds = tuple(None if s is None else float(s) for s in d["seconds"])
        best = int(d["best"])
        if len(seconds) != len(candidates) or best not in candidates:
            raise ValueError("seconds do not match candidates, or best is not a candidate")
        return cls(
            phase=str(d["phase"]), ceiling=int(d["ceiling"]), candidates=candidates, seconds=seconds,
            best=best, default_threads=int(d["default_threads"]),
            default_seconds=None if d["default_seconds"] is None else float(d["default_seconds"]),
            tuning_seconds=float(d["tuning_seconds"]), stopped=tuple(int(n) for n in d["stopped_early"]),
            errors={int(n): str(m) for n, m in d["errors"].items()}, signature=str(d["signature"]),
            cached=bool(d["cached"]),
            contention=None if d.get("contention") is None else float(d["contention"]),  # absent: older npuq
        )


def choose(candidates: Sequence[int], seconds: Sequence[float | None], stopped: Sequence[int],
           ceiling: int, tie_tolerance: float) -> int:
    """The fewest threads whose time is within ``tie_tolerance`` of the fastest; the ceiling if none ran."""
    timed = {n: s for n, s in zip(candidates, seconds) if s is not None and n not in stopped}
    if not timed:
        return ceiling
    fastest = min(timed.values())
    return min(n for n, s in timed.items() if s <= fastest * (1 + tie_tolerance))


def measure_order(candidates: Sequence[int], default: int) -> list[int]:
    """The default count first (it is what would run anyway), then the rest from most threads down.

    Measuring a good count early lets early stop discard slow ones after one sample; from the
    top down, prefill-like work gets steadily slower and stops early, decode-like work speeds up.
    """
    rest = sorted((n for n in candidates if n != default), reverse=True)
    return ([default] if default in candidates else []) + rest


class _Timer:
    def __init__(self, run: Callable[[], object], clock: Clock, sched: Sched):
        self.run, self.clock, self.sched = run, clock, sched

    def calls(self, k: int, trial: "_Trial") -> float:
        """Seconds per call, averaged over ``k`` back-to-back calls; the threads' run and
        run-queue wait times go to ``trial``."""
        before = self.sched()
        start = self.clock()
        for _ in range(k):
            self.run()
        seconds = (self.clock() - start) / k
        run, wait = contention.waited(before, self.sched())
        trial.run_ns, trial.wait_ns = trial.run_ns + run, trial.wait_ns + wait
        return seconds


@dataclass
class _Trial:
    """The measurements of one thread count so far."""

    n: int
    calls_per_sample: int = 1
    warmup_seconds: float | None = None  # the fastest warm-up call of round 1
    samples: list[float] = field(default_factory=list)
    stopped: bool = False
    error: str | None = None
    run_ns: int = 0  # the process's threads on a CPU during this count's calls
    wait_ns: int = 0  # ... and runnable but waiting for one

    @property
    def first(self) -> float:
        """What round 1 saw: the first sample, else the warm-up (round 1 skipped the sample)."""
        return self.samples[0] if self.samples else (self.warmup_seconds or 0.0)

    @property
    def seconds(self) -> float | None:
        if self.error is not None:
            return None
        return statistics.median(self.samples) if self.samples else self.warmup_seconds


def _first_round(timer: _Timer, trial: _Trial, s: TuneSettings, best_first: float | None) -> None:
    warm = [timer.calls(1, trial) for _ in range(s.warmup)]
    if warm:
        trial.warmup_seconds = min(warm)
        if trial.warmup_seconds > 0:
            want = math.ceil(s.min_sample_seconds / trial.warmup_seconds)
            trial.calls_per_sample = min(s.max_calls_per_sample, max(1, want))
        if best_first is not None and trial.warmup_seconds > s.warmup_stop_ratio * best_first:
            return
    trial.samples.append(timer.calls(trial.calls_per_sample, trial))


def _second_round(timer: _Timer, trial: _Trial, s: TuneSettings, fits: Callable[[float], bool]) -> None:
    """Warm-up and samples up to ``s.repeats``, each only if ``fits`` its expected seconds."""
    for _ in range(s.warmup):
        if not fits(trial.first):
            return
        timer.calls(1, trial)
    while len(trial.samples) < s.repeats and fits(trial.first * trial.calls_per_sample):
        trial.samples.append(timer.calls(trial.calls_per_sample, trial))


def _guarded(scope: Scope, trial: _Trial, step: Callable[[], None]) -> None:
    """Run ``step`` at the trial's count; an exception marks the count as failed, as published."""
    try:
        with scope(trial.n):
            step()
    except Exception as exc:
        trial.error = f"{type(exc).__name__}: {exc}"
        trial.samples.clear()


def tune(
    run: Callable[[], object],
    ceiling: int,
    *,
    phase: str = "",
    default_threads: int | None = None,
    settings: TuneSettings = TuneSettings(),
    clock: Clock = time.perf_counter,
    scope: Scope = thread_scope,
    signature: str = "",
    sched: Sched | None = None,
    on_candidate: Callable[[int, float | None], None] | None = None,
) -> TuneResult:
    """Time ``run`` at every candidate count for ``ceiling`` and choose one (see TuneSettings).

    ``run`` must be the real work of the phase on representative inputs and must not change
    any state that matters (no observers attached yet), since it runs many times. A candidate
    whose run raises is skipped; if all do, the ceiling is chosen. ``default_threads`` (the
    count that would run without tuning, torch's current one when None) is timed first; when
    it is not a candidate it is timed as a reference for ``speedup_vs_default`` only.
    ``on_candidate(n, seconds)`` is called for each count once timing is done. ``sched`` reads
    the threads' run-queue times, from which the result's ``contention`` comes (by default
    :func:`npuq.threads.contention.snapshot`).
    """
    default = torch.get_num_threads() if default_threads is None else default_threads
    candidates = candidate_counts(ceiling)
    order = measure_order(candidates, default)
    if default not in candidates:
        order = [default] + order
    timer = _Timer(run, clock, contention.snapshot if sched is None else sched)
    trials = {n: _Trial(n) for n in order}
    start = clock()

    best_first: float | None = None  # round 1: best first sample among candidates
    for trial in trials.values():
        _guarded(scope, trial, lambda: _first_round(timer, trial, settings, best_first))
        if trial.n in candidates and trial.error is None and trial.samples:
            best_first = trial.samples[0] if best_first is None else min(best_first, trial.samples[0])

    def fits(seconds: float) -> bool:  # within the budget of TuneSettings
        return clock() + seconds <= start + settings.budget_seconds

    best_median: float | None = None  # round 2: best median among candidates
    for trial in sorted((t for t in trials.values() if t.error is None), key=lambda t: t.first):
        if best_median is not None and trial.first > settings.stop_ratio * best_median:
            trial.stopped = True
        elif len(candidates) > 1:  # a single candidate leaves nothing to choose: one sample will do
            _guarded(scope, trial, lambda: _second_round(timer, trial, settings, fits))
            if trial.n in candidates and trial.error is None:
                best_median = trial.seconds if best_median is None else min(best_median, trial.seconds)
    if on_candidate is not None:
        for trial in trials.values():
            on_candidate(trial.n, trial.seconds)

    seconds = tuple(trials[n].seconds for n in candidates)
    stopped = tuple(n for n in candidates if trials[n].stopped)
    ref = trials[default]
    shares = [contention.waited_share(t.run_ns, t.wait_ns) for t in trials.values()]
    return TuneResult(
        phase=phase, ceiling=ceiling, candidates=tuple(candidates), seconds=seconds,
        best=choose(candidates, seconds, stopped, ceiling, settings.tie_tolerance),
        default_threads=default, default_seconds=ref.seconds,
        tuning_seconds=clock() - start, stopped=stopped,
        errors={n: trials[n].error for n in candidates if trials[n].error}, signature=signature,
        contention=max((x for x in shares if x is not None), default=None),
    )
