"""The tuner on a fake clock: candidates, selection, ties, early stop, skipped and failing counts."""

import dataclasses
import math

import pytest
import torch

from npuq.threads.tuner import (
    CONTENDED, EXHAUSTIVE, TuneResult, TuneSettings, candidate_counts, choose, measure_order, tune,
)

# One call per sample and no early stop unless a test asks for it, so call counts are exact:
# a count that runs fully takes 1 warm-up + 1 sample (round 1) + 1 warm-up + 2 samples (round 2).
FULL = 5
PLAIN = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.0, stop_ratio=math.inf,
                     warmup_stop_ratio=math.inf, tie_tolerance=0.03)


class FakeHost:
    """A clock and a workload whose cost (seconds) depends on torch's current thread count."""

    def __init__(self, cost, fail=()):
        self.now = 0.0
        self.cost, self.fail = cost, set(fail)
        self.calls: list[int] = []  # thread count of every call, in order

    def clock(self) -> float:
        return self.now

    def run(self) -> None:
        n = torch.get_num_threads()
        self.calls.append(n)
        if n in self.fail:
            raise RuntimeError(f"cannot run with {n} threads")
        self.now += self.cost[n] if isinstance(self.cost, dict) else self.cost(n)

    def calls_at(self, n: int) -> int:
        return self.calls.count(n)


def test_candidates_match_the_published_lists():
    assert candidate_counts(72) == [1, 9, 18, 27, 36, 48, 54, 72]
    assert candidate_counts(8) == [1, 2, 3, 4, 5, 6, 8]
    assert candidate_counts(1) == [1]
    assert candidate_counts(2) == [1, 2]
    with pytest.raises(ValueError):
        candidate_counts(0)


def test_default_first_then_from_the_top_down():
    assert measure_order([1, 2, 3, 4, 5, 6, 8], 8) == [8, 6, 5, 4, 3, 2, 1]
    assert measure_order([1, 2, 3, 4, 5, 6, 8], 4) == [4, 8, 6, 5, 3, 2, 1]
    assert measure_order([1, 2], 7) == [2, 1]


def test_picks_the_fastest_and_reports_every_candidate():
    cost = {1: 8.0, 2: 4.5, 3: 3.0, 4: 2.0, 5: 2.5, 6: 2.8, 8: 4.0}
    host = FakeHost(cost)
    r = tune(host.run, 8, phase="decode", default_threads=8, settings=PLAIN, clock=host.clock)
    assert r.best == 4
    assert r.candidates == (1, 2, 3, 4, 5, 6, 8)
    assert r.seconds == pytest.approx(tuple(cost[n] for n in r.candidates))
    assert r.default_seconds == 4.0 and r.speedup_vs_default == pytest.approx(2.0)
    assert r.tuning_seconds == pytest.approx(FULL * sum(cost.values()))
    assert all(host.calls_at(n) == FULL for n in cost)
    assert r.stopped == () and r.errors == {}


def test_ties_within_three_percent_go_to_fewer_threads():
    cost = {1: 9.0, 2: 5.0, 3: 4.1, 4: 4.0, 5: 4.5, 6: 4.6, 8: 5.0}  # 3 is 2.5 % slower than 4
    host = FakeHost(cost)
    assert tune(host.run, 8, default_threads=8, settings=PLAIN, clock=host.clock).best == 3
    cost[3] = 4.2  # now 5 % slower: no longer a tie
    host = FakeHost(cost)
    assert tune(host.run, 8, default_threads=8, settings=PLAIN, clock=host.clock).best == 4


def test_choose_directly():
    assert choose([1, 2, 4], [1.0, 1.02, 0.99], [], 4, 0.03) == 1
    assert choose([1, 2, 4], [1.0, 0.5, 0.49], [], 4, 0.03) == 2
    assert choose([1, 2, 4], [0.1, 0.6, 0.49], [1], 4, 0.03) == 4  # stopped counts never win
    assert choose([1, 2, 4], [None, None, None], [], 4, 0.03) == 4


def test_a_slow_first_sample_stops_the_candidate():
    cost = {1: 10.0, 2: 6.0, 3: 4.0, 4: 2.9, 5: 2.2, 6: 2.1, 8: 2.0}
    host = FakeHost(cost)
    s = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.0, stop_ratio=1.5, warmup_stop_ratio=math.inf)
    r = tune(host.run, 8, default_threads=8, settings=s, clock=host.clock)
    # 3, 2 and 1 are more than 1.5x the best median (2.0): one warm-up and one sample each.
    assert r.stopped == (1, 2, 3)
    assert [host.calls_at(n) for n in (1, 2, 3)] == [2, 2, 2]
    assert [host.calls_at(n) for n in (4, 5, 6, 8)] == [FULL] * 4
    assert r.best == 8  # 6 is 5 % slower than 8: not a tie
    assert r.seconds[:3] == (10.0, 6.0, 4.0)  # what screening saw is kept for the record


def test_a_slow_warmup_stops_the_candidate_before_any_timed_call():
    cost = {1: 40.0, 2: 20.0, 3: 7.0, 4: 5.0, 5: 4.0, 6: 3.0, 8: 2.0}
    host = FakeHost(cost)
    s = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.0, stop_ratio=1.5, warmup_stop_ratio=3.0)
    r = tune(host.run, 8, default_threads=8, settings=s, clock=host.clock)
    assert host.calls_at(1) == host.calls_at(2) == host.calls_at(3) == 1  # warm-up > 3x best
    assert host.calls_at(4) == 2  # warm-up passes (2.5x), first sample fails (> 1.5x)
    assert set(r.stopped) == {1, 2, 3, 4, 5} and r.best == 8


def test_a_slow_first_count_pays_for_one_sample_only():
    # The default is timed first with nothing to compare against; round 2 drops it when it is slow.
    cost = {1: 3.0, 2: 2.0, 3: 1.9, 4: 1.0, 5: 1.0, 6: 1.0, 8: 10.0}
    host = FakeHost(cost)
    s = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.0, stop_ratio=1.5, warmup_stop_ratio=3.0)
    r = tune(host.run, 8, default_threads=8, settings=s, clock=host.clock)
    assert host.calls_at(8) == 2 and 8 in r.stopped
    assert r.best == 4 and r.default_seconds == 10.0 and r.speedup_vs_default == pytest.approx(10.0)


def test_one_lucky_sample_does_not_condemn_the_others():
    # 2 threads (the default) is fast for its first two calls, then slow (another process wakes up):
    # 1 thread, 2x the lucky sample, must be compared with 2's median, not with that sample.
    host = FakeHost(lambda n: 2.0 if n == 1 else (1.0 if host.calls_at(2) <= 2 else 5.0))
    s = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.0, stop_ratio=1.5, warmup_stop_ratio=3.0)
    r = tune(host.run, 2, default_threads=2, settings=s, clock=host.clock)
    assert r.seconds == (2.0, 5.0) and r.stopped == () and r.best == 1


def test_a_candidate_skipped_by_screening_is_measured_when_others_turn_out_slower():
    # 1's warm-up (4) is over 3x 2's lucky first sample (1), but 2's median is 5: 1 is measured after all.
    host = FakeHost(lambda n: 4.0 if n == 1 else (1.0 if host.calls_at(2) <= 2 else 5.0))
    s = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.0, stop_ratio=1.5, warmup_stop_ratio=3.0)
    r = tune(host.run, 2, default_threads=2, settings=s, clock=host.clock)
    assert host.calls_at(1) == 1 + 1 + 3 and r.seconds == (4.0, 5.0) and r.best == 1


def test_short_steps_are_looped_to_the_minimum_sample_length():
    host = FakeHost({1: 0.004, 2: 0.010})
    s = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.02, stop_ratio=math.inf, warmup_stop_ratio=math.inf)
    r = tune(host.run, 2, default_threads=2, settings=s, clock=host.clock)
    assert host.calls_at(1) == 2 + 3 * 5 and host.calls_at(2) == 2 + 3 * 2  # 5 and 2 calls per sample
    assert r.seconds == pytest.approx((0.004, 0.010)) and r.best == 1


def test_a_candidate_that_raises_is_skipped_and_recorded():
    cost = {1: 8.0, 2: 4.0, 3: 3.0, 4: 1.0, 5: 2.0, 6: 2.0, 8: 3.0}
    host = FakeHost(cost, fail={4})
    r = tune(host.run, 8, default_threads=8, settings=PLAIN, clock=host.clock)
    assert r.best == 5  # 5 and 6 tie: fewer threads win
    assert r.seconds[r.candidates.index(4)] is None
    assert r.errors == {4: "RuntimeError: cannot run with 4 threads"}


def test_when_every_candidate_fails_the_ceiling_is_kept():
    host = FakeHost({}, fail={1, 2, 3, 4, 5, 6, 8})
    r = tune(host.run, 8, default_threads=8, settings=PLAIN, clock=host.clock)
    assert r.best == 8 and set(r.errors) == {1, 2, 3, 4, 5, 6, 8}
    assert r.best_seconds is None and r.speedup_vs_default is None


def test_threads_are_restored_after_tuning_even_when_candidates_raise():
    before = torch.get_num_threads()
    host = FakeHost({1: 1.0, 2: 1.0}, fail={2})
    tune(host.run, 2, default_threads=2, settings=PLAIN, clock=host.clock)
    assert torch.get_num_threads() == before


def test_keyboard_interrupt_is_not_swallowed_and_threads_come_back():
    before = torch.get_num_threads()

    def run():
        if torch.get_num_threads() == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune(run, 4, default_threads=4, settings=PLAIN)
    assert torch.get_num_threads() == before


def test_a_single_candidate_is_timed_once_for_the_record():
    host = FakeHost({1: 2.0})
    r = tune(host.run, 1, default_threads=1, settings=PLAIN, clock=host.clock)
    assert r.best == 1 and r.seconds == (2.0,) and host.calls_at(1) == 2  # warm-up + one sample


def test_a_default_outside_the_candidates_is_a_reference_only():
    # An oversubscribed default (16 threads on a ceiling of 4) is timed but never chosen.
    cost = {16: 0.5, 1: 4.0, 2: 2.0, 3: 1.5, 4: 1.0}
    host = FakeHost(cost)
    r = tune(host.run, 4, default_threads=16, settings=PLAIN, clock=host.clock)
    assert host.calls[0] == 16 and r.default_seconds == 0.5
    assert r.candidates == (1, 2, 3, 4) and r.best == 4
    assert r.speedup_vs_default == pytest.approx(0.5)


def test_exhaustive_settings_never_stop_early():
    cost = {1: 100.0, 2: 1.0}
    host = FakeHost(cost)
    r = tune(host.run, 2, default_threads=2, settings=EXHAUSTIVE, clock=host.clock)
    assert r.stopped == () and host.calls_at(1) == 2 + 5


def test_result_round_trips_through_a_dict():
    host = FakeHost({1: 1.0, 2: 0.6}, fail={1})
    r = tune(host.run, 2, phase="prefill", default_threads=2, settings=PLAIN, clock=host.clock, signature="sig")
    d = r.to_dict()
    assert d["seconds"] == [None, pytest.approx(0.6)] and d["best"] == 2 and d["errors"] == {"1": "RuntimeError: cannot run with 1 threads"}
    assert TuneResult.from_dict(d) == r


@pytest.mark.parametrize("bad", [dict(repeats=0), dict(warmup=-1), dict(stop_ratio=0.5), dict(tie_tolerance=-0.1)])
def test_settings_are_checked(bad):
    with pytest.raises(ValueError):
        TuneSettings(**bad)


def test_the_budget_bounds_round_two_but_every_count_is_measured_once():
    # 10 s calls: round 1 (warm-up + one sample per count) costs 40 s, past a 30 s budget, so
    # round 2 adds nothing; the choice rests on one sample per count and is still right.
    cost = {1: 10.0, 2: 6.0}
    s = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.0, stop_ratio=math.inf, warmup_stop_ratio=math.inf,
                     budget_seconds=30.0)
    host = FakeHost(cost)
    r = tune(host.run, 2, default_threads=2, settings=s, clock=host.clock)
    assert host.calls_at(1) == 2 and host.calls_at(2) == 2
    assert r.seconds == (10.0, 6.0) and r.best == 2 and r.tuning_seconds == pytest.approx(32.0)


def test_round_two_spends_what_the_budget_leaves():
    # Round 1: 4 calls of 1 s. A 9 s budget leaves 5 s: the faster count (visited first) gets
    # its warm-up and two more samples (3 s), the slower one its warm-up and one sample (2 s).
    cost = {1: 1.0, 2: 1.0 - 1e-9}
    s = TuneSettings(warmup=1, repeats=3, min_sample_seconds=0.0, stop_ratio=math.inf, warmup_stop_ratio=math.inf,
                     budget_seconds=9.0)
    host = FakeHost(cost)
    tune(host.run, 2, default_threads=2, settings=s, clock=host.clock)
    assert host.calls_at(2) == 2 + 3 and host.calls_at(1) == 2 + 2


class ContendedHost(FakeHost):
    """A FakeHost whose one thread also waits for a CPU ``wait[n]`` seconds per second it runs
    at n threads, as /proc/self/task/*/schedstat would report it."""

    def __init__(self, cost, wait):
        super().__init__(cost)
        self.wait, self.run_ns, self.wait_ns = wait, 0, 0

    def run(self) -> None:
        super().run()
        n = self.calls[-1]
        self.run_ns += int(self.cost[n] * 1e9)
        self.wait_ns += int(self.cost[n] * self.wait.get(n, 0.0) * 1e9)

    def sched(self):
        return {7: (self.run_ns, self.wait_ns)}


def test_contention_is_the_largest_share_of_waiting_of_any_count():
    # 2 threads waited 3 s per second run (a share of 0.75), 1 thread 0.1 (0.09): the result
    # says 0.75 whichever count won.
    host = ContendedHost({1: 1.0, 2: 4.0}, wait={1: 0.1, 2: 3.0})
    r = tune(host.run, 2, default_threads=2, settings=PLAIN, clock=host.clock, sched=host.sched)
    assert r.best == 1 and r.contention == pytest.approx(0.75)
    assert TuneResult.from_dict(r.to_dict()).contention == pytest.approx(0.75) and r.contended
    quiet = ContendedHost({1: 1.0, 2: 0.6}, wait={})
    q = tune(quiet.run, 2, settings=PLAIN, clock=quiet.clock, sched=quiet.sched)
    assert q.contention == 0.0 and not q.contended
    # the line is CONTENDED itself (not above it: quiet); no reading is no verdict
    assert [dataclasses.replace(q, contention=c).contended for c in (CONTENDED, CONTENDED + 1e-9, None)] == \
        [False, True, False]


def test_without_schedstat_or_enough_cpu_time_there_is_no_verdict():
    host = FakeHost({1: 1.0, 2: 0.6})
    assert tune(host.run, 2, settings=PLAIN, clock=host.clock, sched=lambda: None).contention is None
    short = ContendedHost({1: 1e-3, 2: 1e-3}, wait={1: 1.0, 2: 1.0})  # 5 ms per count: below MIN_NS
    assert tune(short.run, 2, settings=PLAIN, clock=short.clock, sched=short.sched).contention is None
