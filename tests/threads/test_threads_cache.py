"""The tuning cache (hit, miss, retune, corrupt, unwritable) and plan_threads on fake workloads."""

import json

import pytest

from npuq.errors import NpuqError
from npuq.threads import ThreadPlan, TuneSettings, Workload, plan_threads, tune_cached
from npuq.threads import cache, contention

FAST = TuneSettings(warmup=1, repeats=1, min_sample_seconds=0.0)


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path / "cache"))
    # No contention verdict: on a busy machine these tunings would rightly go uncached
    # (test_threads_contention.py tests that).
    monkeypatch.setattr(contention, "snapshot", lambda: None)
    return tmp_path / "cache"


def _tune(run, signature="sig-a", ceiling=4, **kw):
    return tune_cached("decode", Workload(run, signature), ceiling=ceiling, settings=FAST, **kw)


def test_second_run_reads_the_cache_instead_of_tuning(cache_dir):
    run = Counting()
    first = _tune(run)
    assert not first.cached and run.calls > 0
    files = list((cache_dir / "threads").glob("*.json"))
    assert len(files) == 1
    calls = run.calls
    second = _tune(run)
    assert second.cached and run.calls == calls
    assert (second.best, second.seconds, second.candidates) == (first.best, first.seconds, first.candidates)


def test_retune_ignores_and_replaces_the_cache():
    run = Counting()
    _tune(run)
    calls = run.calls
    again = _tune(run, retune=True)
    assert not again.cached and run.calls > calls


@pytest.mark.parametrize("change", [dict(signature="sig-b"), dict(ceiling=2)])
def test_a_different_workload_or_ceiling_misses(change):
    run = Counting()
    _tune(run)
    calls = run.calls
    assert not _tune(run, **change).cached and run.calls > calls


def test_key_includes_host_and_torch(monkeypatch):
    key = cache.CacheKey.here("sig", 4)
    import torch

    assert key.torch_version == torch.__version__ and key.ceiling == 4 and key.cpu_model
    other = cache.CacheKey("Another CPU", 4, key.torch_version, "sig")
    assert key.filename() != other.filename()


@pytest.mark.parametrize("content", ["{not json", "", "[]", '{"schema": SCHEMA, "key": KEY}',
                                     '{"schema": SCHEMA, "key": KEY, "result": {"best": 2}}'])
def test_a_corrupt_file_warns_and_is_retuned(cache_dir, content):
    run = Counting()
    _tune(run)
    (path,) = (cache_dir / "threads").glob("*.json")
    key = json.dumps(json.loads(path.read_text())["key"])
    path.write_text(content.replace("KEY", key).replace("SCHEMA", str(cache.SCHEMA)))
    with pytest.warns(UserWarning, match="corrupt thread-tuning cache"):
        result = _tune(run)
    assert not result.cached
    assert json.loads(path.read_text())["result"]["best"] == result.best  # replaced by the new tuning
    assert _tune(run).cached


def test_a_result_whose_best_is_no_candidate_is_corrupt(cache_dir):
    _tune(Counting())
    (path,) = (cache_dir / "threads").glob("*.json")
    stored = json.loads(path.read_text())
    stored["result"]["best"] = 99
    path.write_text(json.dumps(stored))
    with pytest.warns(UserWarning, match="corrupt"):
        assert not _tune(Counting()).cached


@pytest.mark.parametrize("field, value", [("schema", 0), ("key", {"signature": "other"})])
def test_an_older_schema_or_foreign_key_is_a_silent_miss(cache_dir, field, value, recwarn):
    _tune(Counting())
    (path,) = (cache_dir / "threads").glob("*.json")
    stored = json.loads(path.read_text())
    stored[field] = value
    path.write_text(json.dumps(stored))
    assert not _tune(Counting()).cached
    assert not [w for w in recwarn if "cache" in str(w.message)]


def test_an_unwritable_cache_only_warns(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(blocker))  # a file where the folder should be
    with pytest.warns(UserWarning, match="could not save"):
        result = _tune(Counting())
    assert result.best in result.candidates


def test_cache_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("NPUQ_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_folder() == tmp_path / "xdg" / "npuq" / "threads"


def test_plan_from_user_counts_runs_nothing():
    runs = {p: Counting() for p in ("decode", "prefill")}
    plan, results = plan_threads({p: Workload(r, p) for p, r in runs.items()}, 1, settings=FAST)
    assert plan == ThreadPlan.fixed(["decode", "prefill"], 1)
    assert results == {} and all(r.calls == 0 for r in runs.values())


def test_plan_tunes_then_reads_the_cache_and_mixes_user_counts():
    runs = {p: Counting() for p in ("decode", "prefill")}
    workloads = {p: Workload(r, p) for p, r in runs.items()}
    plan, results = plan_threads(workloads, {"prefill": 1}, settings=FAST)
    assert plan.sources == {"decode": "auto", "prefill": "user"} and set(results) == {"decode"}
    assert plan.threads["decode"] == results["decode"].best
    plan2, _ = plan_threads(workloads, 0, settings=FAST)
    assert plan2.sources == {"decode": "cache", "prefill": "auto"}
    plan3, _ = plan_threads(workloads, 0, retune=True, settings=FAST)
    assert set(plan3.sources.values()) == {"auto"}


def test_plan_rejects_negative_and_unknown_phases_and_warns_above_the_ceiling():
    workloads = {"decode": Workload(Counting(), "d")}
    with pytest.raises(NpuqError, match="negative"):
        plan_threads(workloads, -1)
    with pytest.raises(ValueError, match="without a workload"):
        plan_threads(workloads, {"calibrate": 2})
    with pytest.warns(UserWarning, match="exceeds"):
        plan, _ = plan_threads(workloads, 10_000)
    assert plan.threads["decode"] == 10_000
