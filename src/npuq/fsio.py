"""Atomic file output: a reader never sees a half-written file, an interrupted run leaves none.

Everything npuq writes goes to a temporary name in the destination folder and is renamed over
the final name only once complete (rename is atomic on POSIX within one filesystem); Ctrl-C
is held back during the renames that swap a finished folder into place.

Reading a folder back (artifact, export) goes through :func:`read_json` (every way a JSON
file can be broken is one NpuqError) and :func:`resolve_inside` (a file named in a manifest
must lie inside the folder).
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
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; the result is an ordinary file
    try:
        yield Path(tmp)
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        with interrupts_deferred():  # Ctrl-C between the renames would leave the old folder aside
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


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then raise KeyboardInterrupt if one came.

    For the few renames that swap a finished folder into place: each is atomic, the sequence
    is not. Signal handlers can only be changed on the main thread; elsewhere this does nothing.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise KeyboardInterrupt


# --------------------------------------------------------------------------- reading folders back
def read_json(path: str | os.PathLike, what: str, fix: str) -> Any:
    """The JSON value in ``path``; :class:`NpuqError` naming ``what`` and ``fix`` when the file is
    missing, unreadable, not UTF-8 or not JSON (including numbers too long for Python to convert
    and nesting deeper than its recursion limit)."""
    from npuq.errors import NpuqError

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NpuqError(f"{what}: {path} is missing; {fix}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise NpuqError(f"{what}: {path} cannot be read as UTF-8 text ({exc}); {fix}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise NpuqError(f"{what}: {path} is not valid JSON ({exc}); {fix}") from None
    except (ValueError, RecursionError) as exc:
        raise NpuqError(f"{what}: {path} is unreadable JSON ({type(exc).__name__}: {exc}); {fix}") from None


def resolve_inside(folder: str | os.PathLike, name: Any, what: str) -> Path:
    """``folder / name`` for a file name read from a manifest, refused unless it stays inside
    ``folder``: not absolute, no ``..``, and no symbolic link leading out of the folder.

    A manifest is data someone may hand over with a model; it must not make npuq read (or
    load as a program) a file elsewhere on the machine.
    """
    from npuq.errors import NpuqError

    if not isinstance(name, str) or not name or "\x00" in name:
        raise NpuqError(f"{what}: file entry {name!r} is not a file name; write the folder again")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise NpuqError(f"{what}: file entry {name!r} points outside {folder} (an absolute path or '..'); refusing "
                        "to read it: a manifest may only name files inside its own folder")
    root = Path(folder).resolve()
    target = (root / relative).resolve()
    if not target.is_relative_to(root):
        raise NpuqError(f"{what}: file entry {name!r} is a link to {target}, outside {folder}; refusing to read it "
                        "(copy the file into the folder instead)")
    return target
