"""Run-queue waiting read from the kernel: the parser, the arithmetic, a real competitor on one
CPU, and the cache refusing a result timed beside one."""

import os
import subprocess
import sys
import textwrap

import pytest

from npuq.threads import TuneSettings, Workload, contention, tune_cached
from npuq.threads import cache


def test_parse_schedstat():
    assert contention.parse_schedstat("123 456 7\n") == (123, 456)
    with pytest.raises(ValueError):
        contention.parse_schedstat("123")


def test_waited_counts_new_threads_from_zero_and_drops_ended_ones():
    before = {1: (100, 10), 2: (50, 5)}  # thread 2 ends before the second reading
    after = {1: (300, 60), 3: (40, 20)}  # thread 3 starts after the first
    assert contention.waited(before, after) == (200 + 40, 50 + 20)
    assert contention.waited(None, after) == (0, 0)


def test_share_needs_enough_cpu_time():
    assert contention.waited_share(60_000_000, 20_000_000) == pytest.approx(0.25)
    assert contention.waited_share(1_000_000, 1_000_000) is None  # 2 ms: no verdict


def test_snapshot_reads_a_fixture_tree(tmp_path):
    for tid, text in ((11, "5 6 1\n"), (12, "7 8 2\n")):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "schedstat").write_text(text)
    assert contention.snapshot(tmp_path) == {11: (5, 6), 12: (7, 8)}
    assert contention.snapshot(tmp_path / "missing") is None
    (tmp_path / "12" / "schedstat").write_text("garbage")
    assert contention.snapshot(tmp_path) is None


# A child pins itself to one CPU, spins 0.6 s, and prints the share it waited; with COMPETITORS
# spinning processes pinned to the same CPU the scheduler shares it among 1 + COMPETITORS.
_PROBE = textwrap.dedent("""
    import os, subprocess, sys, time
    from npuq.threads import contention
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    rivals = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(sys.argv[1]))]
    time.sleep(0.2)
    before = contention.snapshot()
    end = time.perf_counter() + 0.6
    while time.perf_counter() < end:
        pass
    share = contention.waited_share(*contention.waited(before, contention.snapshot()))
    for r in rivals:
        r.kill()
    print(share)
""")


@pytest.mark.skipif(contention.snapshot() is None or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux schedstat and affinity")
def test_a_competitor_on_the_same_cpu_is_seen():
    def share(competitors: int) -> float:
        out = subprocess.run([sys.executable, "-c", _PROBE, str(competitors)], capture_output=True, text=True,
                             check=True, timeout=60)
        return float(out.stdout)

    # Three rivals leave this thread a quarter of the CPU: it waits ~3/4 of its runnable time.
    # With L other tasks of equal weight on that CPU too, alone it waits L/(1+L) and beside the
    # rivals (3+L)/(4+L), a difference of 3/((4+L)(1+L)): at least 0.3 while L <= 1, which a
    # share alone of at most 1/2 guarantees. A CPU busier than that cannot tell.
    alone = share(0)
    if alone > 0.5:
        pytest.skip(f"this CPU is too busy to measure a competitor: alone the probe waited {alone:.0%}")
    contended = share(3)
    assert contended > 0.6, contended
    assert contended > alone + 0.2, (alone, contended)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_contended_tuning_serves_the_run_but_is_not_cached(cache_dir, monkeypatch):
    class Sched:  # each reading: 60 ms more run, and ``wait_step`` more waiting
        run = wait = 0
        wait_step = 60_000_000  # as long waiting as running: a share of 0.5

        def __call__(self):
            self.run, self.wait = self.run + 60_000_000, self.wait + self.wait_step
            return {1: (self.run, self.wait)}

    sched = Sched()
    monkeypatch.setattr(contention, "snapshot", sched)
    workload = Workload(lambda: None, "sig-contended")
    fast = TuneSettings(warmup=1, repeats=1, min_sample_seconds=0.0)
    with pytest.warns(UserWarning, match=r"waited for a CPU 50% .* not cached"):
        r = tune_cached("prefill", workload, ceiling=2, settings=fast)
    assert r.contention == pytest.approx(0.5) and not (cache_dir / "threads").exists()
    sched.wait_step = 0  # a quiet machine: stored, and read back by the next run
    assert tune_cached("prefill", workload, ceiling=2, settings=fast).contention == 0.0
    again = tune_cached("prefill", workload, ceiling=2, settings=fast)
    assert again.cached and again.contention == 0.0
    assert len(list((cache_dir / "threads").glob("*.json"))) == 1 and cache.SCHEMA == 2
