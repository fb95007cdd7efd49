"""Stages of a run folder, each cached under a key derived from its inputs.

A stage's folder is ``DIR/stages/NAME-KEY`` where KEY hashes everything the stage depends on
(options, versions, and the keys of the stages it reads). A stage is written into a
temporary folder and renamed into place only when complete, so an interrupted run never
leaves a half-written stage; the next run reuses every finished stage and redoes the rest.
While a run is in progress ``DIR/RUNNING`` names it; a run that finds the marker reports
that the previous one was interrupted, then resumes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from npuq.fsio import atomic_dir, write_json

RESULT = "result.json"
MARKER = "RUNNING"


def stage_key(inputs: dict[str, Any]) -> str:
    """Stable 16-hex-digit key of a JSON-able dict of inputs."""
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class RunDir:
    root: Path
    log: list[dict[str, Any]] = field(default_factory=list)
    interrupted: dict[str, Any] | None = None  # the marker a previous run left, if any

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        marker = self.root / MARKER
        if marker.is_file():
            try:
                self.interrupted = json.loads(marker.read_text())
            except (OSError, json.JSONDecodeError):
                self.interrupted = {"stage": "unknown"}
        self._mark(None)

    def _mark(self, stage: str | None) -> None:
        write_json(self.root / MARKER, {"pid": os.getpid(), "stage": stage, "since": time.time()})

    def stage(self, name: str, inputs: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> tuple[Path, dict[str, Any]]:
        """Return (folder, result) of stage ``name``: reused when its key matches, else built.

        ``build(folder)`` writes its files into ``folder`` and returns a JSON-able result.
        """
        key = stage_key({"stage": name, **inputs})
        folder = self.root / "stages" / f"{name}-{key}"
        if (folder / RESULT).is_file():
            result = json.loads((folder / RESULT).read_text())
            self.log.append({"stage": name, "key": key, "cached": True, "seconds": 0.0})
            return folder, result
        self._mark(name)
        start = time.perf_counter()
        with atomic_dir(folder) as tmp:
            result = build(tmp)
            write_json(tmp / RESULT, result)
        seconds = time.perf_counter() - start
        self.log.append({"stage": name, "key": key, "cached": False, "seconds": seconds})
        self._mark(None)
        return folder, result

    def finish(self) -> None:
        """The run completed: remove the in-progress marker."""
        (self.root / MARKER).unlink(missing_ok=True)
