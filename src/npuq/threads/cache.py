"""Tuning results kept across runs, so a host tunes each workload once.

A result is valid for the same CPU model, CPU ceiling, torch version and workload signature;
those four make the key. Each key has its own JSON file under ``<cache>/threads/`` (named by a
hash of the key, which the file repeats), written atomically, so concurrent runs never see a
half-written file and never lose each other's entries. A file that cannot be read back is
ignored with a warning and overwritten by the next tuning.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from npuq.fsio import user_cache_dir, write_json
from npuq.threads.limits import cpu_model
from npuq.threads.tuner import TuneResult

# bump when TuneResult's stored form changes; older files then miss (2: "contention", and the
# results of schema 1 may have been timed beside another job, docs/design.md §4)
SCHEMA = 2


@dataclass(frozen=True)
class CacheKey:
    cpu_model: str
    ceiling: int
    torch_version: str
    signature: str

    @classmethod
    def here(cls, signature: str, ceiling: int) -> "CacheKey":
        """The key of ``signature`` on this host with this torch."""
        return cls(cpu_model(), ceiling, torch.__version__, signature)

    def filename(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20] + ".json"


def cache_folder(root: str | os.PathLike | None = None) -> Path:
    """``root``/threads, by default in npuq's user cache ($NPUQ_CACHE_DIR, $XDG_CACHE_HOME/npuq, ~/.cache/npuq)."""
    return Path(root if root is not None else user_cache_dir()) / "threads"


def load(key: CacheKey, root: str | os.PathLike | None = None) -> TuneResult | None:
    """The stored result for ``key`` marked ``cached=True``, or None (missing, stale or corrupt)."""
    path = cache_folder(root) / key.filename()
    try:
        text = path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        warnings.warn(f"ignoring the thread-tuning cache file {path}: {exc}", stacklevel=2)
        return None
    try:
        stored = json.loads(text)
        if stored.get("schema") != SCHEMA or stored.get("key") != asdict(key):
            return None
        result = TuneResult.from_dict(stored["result"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        warnings.warn(
            f"ignoring the corrupt thread-tuning cache file {path} ({type(exc).__name__}: {exc}); "
            "it will be replaced after tuning again", stacklevel=2,
        )
        return None
    return replace(result, cached=True)


def store(key: CacheKey, result: TuneResult, root: str | os.PathLike | None = None) -> Path:
    """Write ``result`` under ``key`` atomically; returns the file written."""
    path = cache_folder(root) / key.filename()
    write_json(path, {"schema": SCHEMA, "key": asdict(key), "result": replace(result, cached=False).to_dict()})
    return path
