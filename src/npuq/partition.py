"""Runs of consecutive items (layers, parts) whose largest sum is as small as possible."""

from __future__ import annotations

from typing import Sequence


def min_max_split(sizes: Sequence[int], count: int) -> tuple[tuple[int, int], ...]:
    """``count`` runs of consecutive items whose largest sum is as small as possible, as
    (start, end) index pairs."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)

    def runs(cap: int) -> list[tuple[int, int]] | None:  # greedy: the fewest runs of sum <= cap
        out, start = [], 0
        for i in range(n):
            if sizes[i] > cap:
                return None
            if prefix[i + 1] - prefix[start] > cap:
                out.append((start, i))
                start = i
        out.append((start, n))
        return out

    lo, hi = max(sizes), prefix[-1]
    while lo < hi:  # the smallest cap that `count` runs can keep
        mid = (lo + hi) // 2
        r = runs(mid)
        if r is not None and len(r) <= count:
            hi = mid
        else:
            lo = mid + 1
    found = runs(lo)
    assert found is not None
    # Fewer runs than asked (a cap some runs meet with room to spare): split the largest runs of
    # several items until there are ``count``; no run grows, so the cap still holds.
    while len(found) < count:
        i = max((j for j, (a, b) in enumerate(found) if b - a > 1), key=lambda j: prefix[found[j][1]] - prefix[found[j][0]])
        a, b = found[i]
        cut = min(range(a + 1, b), key=lambda c: max(prefix[c] - prefix[a], prefix[b] - prefix[c]))
        found[i : i + 1] = [(a, cut), (cut, b)]
    return tuple(found)


def fewest_runs(sizes: Sequence[int], limit: int) -> tuple[tuple[int, int], ...]:
    """The fewest runs of consecutive items whose sums each stay within ``limit``, as even as
    that count allows (:func:`min_max_split`); where one item alone is over ``limit``, the
    largest item is the limit."""
    limit = max(limit, max(sizes))
    count = next(c for c in range(1, len(sizes) + 1)
                 if max(sum(sizes[a:b]) for a, b in min_max_split(sizes, c)) <= limit)
    return min_max_split(sizes, count)
