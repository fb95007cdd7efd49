"""Stages of a run folder, each cached under a key derived from its inputs.

A stage's folder is ``DIR/stages/NAME-KEY`` where KEY hashes everything the stage depends on
(its options record, versions, and the keys of the stages it reads: npuq.records.record_key). A stage is written into a
temporary folder and renamed into place only when complete, so an interrupted run never
leaves a half-written stage; the next run reuses every finished stage and redoes the rest.
While a run is in progress ``DIR/RUNNING`` names it; a run that finds the marker reports
that the previous one was interrupted, then resumes.

A :class:`RunDir` holds the folder's lock (:func:`npuq.fsio.folder_lock`) from its creation to
:meth:`RunDir.finish` or :meth:`RunDir.close`, so a second run on the same folder is refused
before it reads the marker: a marker it finds was left by a run that is no longer alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from npuq.fsio import atomic_dir, folder_lock, write_json
from npuq.runs import StageEntry

RESULT = "result.json"
MARKER = "RUNNING"


@dataclass
class RunDir:
    """The run folder ``root``, locked against other processes while this object holds it.

    Use it as a context manager, or call :meth:`finish` when the run completed and
    :meth:`close` on every other way out (both release the lock; a stage that fails releases
    it too, keeping the marker). ``wait``: seconds to wait for another process's run to end
    (0: refuse at once with :class:`~npuq.errors.NpuqError`).
    """

    root: Path
    log: list[StageEntry] = field(default_factory=list)
    interrupted: dict[str, Any] | None = None  # the marker a previous run left, if any
    wait: float = 0.0

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self._held = contextlib.ExitStack()
        self._held.enter_context(folder_lock(self.root, "npuq run", self.wait))  # before the marker is read
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            marker = self.root / MARKER
            if marker.is_file():  # under the lock: its writer is gone, so it was interrupted
                try:
                    self.interrupted = json.loads(marker.read_text())
                except (OSError, json.JSONDecodeError):
                    self.interrupted = {"stage": "unknown"}
            self._mark(None)
        except BaseException:
            self.close()
            raise

    @property
    def locked(self) -> bool:
        """Whether this object still holds the folder's lock."""
        return self._held is not None

    def close(self) -> None:
        """Release the folder's lock (idempotent); the marker stays, so a later run reports this
        one as interrupted unless :meth:`finish` removed it."""
        held, self._held = self._held, None
        if held is not None:
            held.close()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _mark(self, stage: str | None) -> None:
        write_json(self.root / MARKER, {"pid": os.getpid(), "stage": stage, "since": time.time()})

    def stage(self, name: str, key: str, build: Callable[[Path], dict[str, Any]],
              stale: Callable[[dict[str, Any]], bool] | None = None) -> tuple[Path, dict[str, Any]]:
        """Return (folder, result) of stage ``name`` under ``key`` (npuq.records.record_key of
        everything the stage reads): reused when that folder is complete and ``stale`` (if
        given) does not reject its result, else built (replacing a rejected folder).

        ``build(folder)`` writes its files into ``folder`` and returns a JSON-able result. A
        build that raises ends the run: the lock is released, the marker names the stage.
        """
        if not self.locked:
            raise RuntimeError(f"RunDir({self.root}) is closed: its lock was released")
        folder = self.root / "stages" / f"{name}-{key}"
        if (folder / RESULT).is_file():
            result = json.loads((folder / RESULT).read_text())
            if stale is None or not stale(result):
                self.log.append(StageEntry(name, key, True, 0.0))
                return folder, result
        self._mark(name)
        start = time.perf_counter()
        try:
            with atomic_dir(folder) as tmp:
                result = build(tmp)
                write_json(tmp / RESULT, result)
        except BaseException:
            self.close()
            raise
        seconds = time.perf_counter() - start
        self.log.append(StageEntry(name, key, False, seconds))
        self._mark(None)
        return folder, result

    def finish(self) -> None:
        """The run completed: remove the in-progress marker, then release the lock. (Once closed,
        the marker is left alone: another run may have taken the folder since.)"""
        try:
            if self.locked:
                (self.root / MARKER).unlink(missing_ok=True)
        finally:
            self.close()
