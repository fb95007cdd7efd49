"""A picture of the tuning: time per step against thread count, one line per phase."""

from __future__ import annotations

import os
from typing import Any, Sequence

from npuq.fsio import atomic_path
from npuq.threads.tuner import TuneResult


def sweep_figure(results: Sequence[TuneResult], title: str = "") -> Any:
    """A matplotlib figure of each result's milliseconds per call against thread count; the
    chosen count is ringed."""
    # matplotlib (0.2-0.6 s) loads only to draw a figure
    import matplotlib

    matplotlib.use("Agg")
    # pyplot once the backend is chosen (Agg: no display needed)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in results:
        timed = [(n, s * 1e3) for n, s in zip(r.candidates, r.seconds) if s is not None]
        if not timed:
            continue
        (line,) = ax.plot(*zip(*timed), marker="o", label=f"{r.phase} (best {r.best})")
        if r.best_seconds is not None:
            ax.plot([r.best], [r.best_seconds * 1e3], marker="o", markersize=14, fillstyle="none",
                    color=line.get_color())
    ax.set_xticks(sorted({n for r in results for n in r.candidates}))
    ax.set_xlabel("threads")
    ax.set_ylabel("ms per step")
    ax.set_yscale("log")
    ax.set_title(title or "time per step against thread count")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def plot_results(results: Sequence[TuneResult], path: str | os.PathLike, title: str = "") -> None:
    """Write :func:`sweep_figure` to a PNG file, atomically."""
    # matplotlib (0.2-0.6 s) loads only to draw a figure
    import matplotlib.pyplot as plt

    fig = sweep_figure(results, title)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
