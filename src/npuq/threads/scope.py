"""The one place in npuq that changes CPU thread counts.

Every other module receives a :class:`npuq.threads.ThreadPlan` (or a count) and runs its work
inside ``thread_scope(n)`` / ``plan.scope(phase)``; nothing else calls ``torch.set_num_threads``
(a test enforces it). Thread counts are process-wide, so scopes belong on the main thread;
nested scopes restore in reverse order.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # optional at run time: without it, only torch's threads are scoped
    threadpool_limits = None


def _blas_limits(n: int) -> contextlib.AbstractContextManager:
    """Limit BLAS libraries other than torch's own (numpy's OpenBLAS, a system MKL) to ``n`` threads.

    torch.set_num_threads already covers torch's OpenMP pool and its bundled MKL; threadpoolctl
    reaches the BLAS that numpy and scipy load, and restores it on exit.
    """
    if threadpool_limits is None:
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


@contextlib.contextmanager
def thread_scope(n: int) -> Iterator[int]:
    """Run the block with ``n`` torch intra-op threads and ``n`` BLAS threads; restore both after.

    The previous counts come back when the block ends, also when it raises. Inter-op threads are
    left alone: torch fixes them once any parallel work has run.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"thread count must be a whole number of at least 1, got {n!r}")
    previous = torch.get_num_threads()
    with _blas_limits(n):
        torch.set_num_threads(n)
        try:
            yield n
        finally:
            torch.set_num_threads(previous)


@contextlib.contextmanager
def scope_or_keep(n: int) -> Iterator[int]:
    """:func:`thread_scope` for ``n`` ≥ 1; ``n`` = 0 leaves the count as it is. Yields the count in effect."""
    if n == 0:
        yield torch.get_num_threads()
        return
    with thread_scope(n) as count:
        yield count
