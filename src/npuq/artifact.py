"""Atomic file output: a reader never sees a half-written file, an interrupted run leaves none.

Everything npuq writes goes to a temporary name in the destination folder and is renamed over
the final name only once complete (rename is atomic on POSIX within one filesystem).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` if the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically; ``-`` writes to standard output."""
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"
    if str(path) == "-":
        print(text, end="")
    else:
        write_text(path, text)


def user_cache_dir() -> Path:
    """npuq's cache folder: $NPUQ_CACHE_DIR, else $XDG_CACHE_HOME/npuq, else ~/.cache/npuq."""
    explicit = os.environ.get("NPUQ_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "npuq"


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder next to ``path``; move it onto ``path`` if the block succeeds.

    An existing ``path`` (callers decide whether replacing it is allowed) stays whole until the
    new folder is in place, and comes back if the final rename fails.
    """
    import shutil

    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        if not final.exists():
            os.replace(tmp, final)
            return
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
        os.rmdir(old)
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
