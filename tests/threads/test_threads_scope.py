"""thread_scope and ThreadPlan.scope set torch and BLAS threads and always restore them."""

import re
from pathlib import Path

import pytest
import torch

from npuq.threads import ThreadPlan, thread_scope


def _blas_threads() -> list[int]:
    from threadpoolctl import threadpool_info

    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def test_sets_and_restores_torch_threads():
    before = torch.get_num_threads()
    with thread_scope(3) as n:
        assert n == 3 and torch.get_num_threads() == 3
    assert torch.get_num_threads() == before


def test_restores_on_exception():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="boom"):
        with thread_scope(5):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def test_nested_scopes_restore_in_reverse_order():
    before = torch.get_num_threads()
    with thread_scope(4):
        with thread_scope(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 4
    assert torch.get_num_threads() == before


def test_limits_and_restores_blas_threads():
    import numpy  # noqa: F401  (loads numpy's OpenBLAS so threadpoolctl sees it)

    before = _blas_threads()
    if not before:
        pytest.skip("no BLAS library loaded in this process")
    with thread_scope(1):
        assert set(_blas_threads()) == {1}
    assert _blas_threads() == before


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_rejects_counts_that_are_not_positive_ints(bad):
    with pytest.raises(ValueError, match="thread count"):
        with thread_scope(bad):
            pass


def test_plan_scopes_each_phase():
    plan = ThreadPlan({"decode": 1, "prefill": 3}, {"decode": "auto", "prefill": "user"})
    before = torch.get_num_threads()
    with plan.scope("prefill"):
        assert torch.get_num_threads() == 3
    with pytest.raises(ValueError):
        with plan.scope("decode"):
            assert torch.get_num_threads() == 1
            raise ValueError("phase failed")
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError, match="no phase 'calibrate'"):
        plan.scope("calibrate")
    assert plan.summary() == "decode: 1 (auto), prefill: 3 (user)"
    assert plan.to_dict()["prefill"] == {"threads": 3, "source": "user"}


def test_plan_is_frozen_and_checked():
    plan = ThreadPlan.fixed(["decode"], 2)
    with pytest.raises(TypeError):
        plan.threads["decode"] = 4  # type: ignore[index]
    with pytest.raises(Exception):
        plan.threads = {}  # type: ignore[misc]
    with pytest.raises(ValueError, match="source"):
        ThreadPlan({"decode": 2}, {"decode": "guess"})
    with pytest.raises(ValueError, match=">= 1"):
        ThreadPlan({"decode": 0}, {"decode": "user"})
    with pytest.raises(ValueError, match="differ"):
        ThreadPlan({"decode": 2}, {})


def test_no_other_npuq_module_changes_thread_counts():
    """STYLE.md: threads are a plan, not a global; only npuq/threads/scope.py sets them."""
    src = Path(__file__).resolve().parents[2] / "src" / "npuq"
    setter = re.compile(r"(set_num_threads|set_num_interop_threads|threadpool_limits)\s*\(|environ.*(OMP|MKL)_NUM_THREADS")
    offenders = [
        str(path.relative_to(src)) for path in src.rglob("*.py")
        if path != src / "threads" / "scope.py" and setter.search(path.read_text(encoding="utf-8"))
    ]
    assert offenders == [], f"only npuq.threads.thread_scope may change thread counts; found in {offenders}"
