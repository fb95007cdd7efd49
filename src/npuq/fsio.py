"""Atomic file output: a reader never sees a half-written file, an interrupted run leaves none.

Everything npuq writes goes to a temporary name in the destination folder and is renamed over
the final name only once complete (rename is atomic on POSIX within one filesystem); Ctrl-C
is held back during the renames that swap a finished folder into place.

Reading a folder back (artifact, export) goes through :func:`read_json` (every way a JSON
file can be broken is one NpuqError) and :func:`resolve_inside` (a file named in a manifest
must lie inside the folder).

One process at a time writes an output folder: :func:`folder_lock` holds an OS-level lock on a
file next to it (released when the block ends, and by the OS when the process dies).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

from npuq.errors import NpuqError


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


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, read in 8 MiB blocks (a model file never sits in memory whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


def remove_stale(paths: Iterable[Path], older_than: float) -> None:
    """Remove the files and folders among ``paths`` last modified over ``older_than`` seconds
    ago: the temporaries of work killed before it could clean up (SIGKILL, power loss). A
    younger one may be another process's work in progress and is left. Never raises."""
    for path in paths:
        try:
            if time.time() - path.stat().st_mtime > older_than:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink()
        except OSError:
            pass


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
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary folder
    try:
        yield tmp
        # Some writers (safetensors, ONNX external data) create their files private (0600):
        # the folder's files get the modes of ordinary files.
        for f in tmp.rglob("*"):
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o666 & ~_umask())
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


# --------------------------------------------------------------------------- one writer per folder
def lock_path(path: str | os.PathLike) -> Path:
    """The lock file of output folder ``path``: ``CACHE/locks/NAME-HASH.lock``, keyed by the
    folder's resolved path. Outside the folder, so it exists before the folder does and stays put
    while :func:`atomic_dir` swaps the folder; outside its parent too, so an output folder gets
    no stray file beside it (lock files are never deleted: deleting one while another process
    waits on it would let two processes hold "the" lock)."""
    final = Path(path).resolve()
    digest = hashlib.sha256(str(final).encode()).hexdigest()[:20]
    return user_cache_dir() / "locks" / f"{final.name or 'root'}-{digest}.lock"


def _owner_path(lock: Path) -> Path:
    return lock.with_name(lock.name + ".owner")


def _owner_pid(lock: Path) -> int | None:
    """The pid the holder of ``lock`` recorded, when it names a live process."""
    try:
        pid = int(json.loads(_owner_path(lock).read_text(encoding="utf-8"))["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if os.name == "posix":  # elsewhere os.kill(pid, 0) is not a probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None  # left by a holder that was killed; the lock itself went with it
        except OSError:
            pass  # alive, another user's
    return pid


def _holder(lock: Path) -> str:
    pid = _owner_pid(lock)
    if pid is None:
        return "another npuq process"
    if pid == os.getpid():
        return f"this same process (pid {pid})"
    return f"another npuq process (pid {pid})"


@contextlib.contextmanager
def folder_lock(path: str | os.PathLike, what: str, wait: float = 0.0) -> Iterator[Path]:
    """Hold the exclusive lock on output folder ``path`` for the block; yield the lock file.

    The lock is the ``filelock`` package's OS-level one (``flock`` on POSIX) on
    :func:`lock_path`, so the OS drops it when the holder dies, even by SIGKILL; the holder's
    pid goes to a side file (the lock file's name + ``.owner``) for the message a second process gets. With
    ``wait`` 0 a folder another process holds is an :class:`NpuqError` at once; with ``wait`` > 0
    one line on stderr says so and the lock is awaited that many seconds. Released when the
    block ends, by an exception or Ctrl-C included. ``what`` starts the message ("npuq run").
    """
    # filelock (40-90 ms) loads on use: every command imports fsio, few take a lock
    import filelock

    folder = Path(path)
    lock_file = lock_path(folder)
    fix = "wait for it to finish, or choose another --out"
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NpuqError(f"{what}: cannot create {lock_file.parent} for the lock of {folder} ({exc}); "
                        "choose an --out in a folder you can write") from None
    lock = filelock.FileLock(str(lock_file), thread_local=False)  # acquired, released on any thread
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            if wait <= 0:
                raise NpuqError(f"{what}: {folder} is being written by {_holder(lock_file)}; {fix}") from None
            print(f"npuq: {folder} is being written by {_holder(lock_file)}; waiting up to {wait:g} s for it "
                  "to finish", file=sys.stderr, flush=True)
            try:
                lock.acquire(timeout=wait, poll_interval=0.1)
            except filelock.Timeout:
                raise NpuqError(f"{what}: {folder} is still being written by {_holder(lock_file)} after "
                                f"{wait:g} s of waiting; {fix}") from None
        except OSError as exc:
            raise NpuqError(f"{what}: cannot lock {folder} through {lock_file} ({exc}); "
                            "choose an --out in a folder you can write") from None
        with contextlib.suppress(OSError):  # the pid is for messages only
            write_text(_owner_path(lock_file), json.dumps({"pid": os.getpid()}) + "\n")
        yield lock_file
    finally:
        if lock.is_locked:  # held by this block (not when acquiring failed)
            with contextlib.suppress(OSError):
                _owner_path(lock_file).unlink()
            lock.release(force=True)


# --------------------------------------------------------------------------- reading folders back
def read_json(path: str | os.PathLike, what: str, fix: str) -> Any:
    """The JSON value in ``path``; :class:`NpuqError` naming ``what`` and ``fix`` when the file is
    missing, unreadable, not UTF-8 or not JSON (including numbers too long for Python to convert
    and nesting deeper than its recursion limit)."""
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
