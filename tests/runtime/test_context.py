"""ExecutionContext: one device and one thread plan per run, applied per phase."""

import pytest
import torch

from npuq.errors import NpuqError
from npuq.testing.tiny import tiny_decoder
from npuq.runtime.context import ExecutionContext
from npuq.threads import TuneSettings


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NPUQ_CACHE_DIR", str(tmp_path / "cache"))


def test_a_user_count_applies_to_every_phase_and_nothing_is_timed():
    ctx = ExecutionContext.create("cpu", num_threads=1)
    plan = ctx.plan({"decode": None, "prefill": None})  # no workload: it would fail if timed
    assert dict(plan.threads) == {"decode": 1, "prefill": 1} and set(plan.sources.values()) == {"user"}
    ctx.adopt({"calibrate": 2})  # a measured plan does not override the user's count
    assert ctx.threads("calibrate") == 1


def test_automatic_counts_are_measured_once_then_kept(monkeypatch):
    calls = []
    import npuq.runtime.context as context_mod

    real = context_mod.plan_threads

    def counting(workloads, requested, **kw):
        calls.append(sorted(workloads))
        return real(workloads, requested, settings=TuneSettings(warmup=0, repeats=1), **kw)

    monkeypatch.setattr(context_mod, "plan_threads", counting)
    ctx = ExecutionContext.create("cpu")
    model = tiny_decoder("llama", seed=0, max_context=32)[1]
    first = ctx.plan_model(model, ("decode", "prefill"), 32, 8)
    again = ctx.plan_model(model, ("prefill", "calibrate"), 32, 8)
    assert calls == [["decode", "prefill"], ["calibrate"]]  # prefill was planned once
    assert again.threads["prefill"] == first.threads["prefill"]
    assert set(first.sources.values()) <= {"auto", "cache"}


def test_scope_applies_the_phase_count_and_restores_it():
    before = torch.get_num_threads()
    ctx = ExecutionContext.create("cpu")
    ctx.adopt({"decode": 1})
    with ctx.scope("decode") as n:
        assert n == 1 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with ctx.scope("prefill") as n:  # not planned, no user count: torch's count is kept
        assert n == before == torch.get_num_threads()


def test_off_the_cpu_nothing_is_tuned():
    ctx = ExecutionContext(torch.device("meta"))
    plan = ctx.plan({"decode": None})
    assert plan.sources["decode"] == "kept" and plan.threads["decode"] == torch.get_num_threads()
    assert ctx.on("cpu").threads("decode") == 0  # counts kept for another device do not carry over


def test_bad_requests_fail_at_once():
    with pytest.raises(NpuqError, match="negative"):
        ExecutionContext.create("cpu", num_threads=-1)
