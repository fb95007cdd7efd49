"""Resource guards: memory for one-pass calibration, disk for large files.

Both guards compare an estimate with what the machine has left and act before the work
starts: calibration takes fewer windows per forward (or refuses, with the numbers) instead of
being killed by the kernel's OOM killer half-way; a write that cannot fit is refused before
anything is written instead of failing on a full disk.

The estimates are pure functions of their arguments, so tests feed them any "available" figure.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import psutil

from npuq.errors import NpuqError

BYTES_PER_ELEMENT = 4  # calibration runs the float32 graph
USABLE_FRACTION = 0.8  # of the available memory: the allocator, Python and other processes need room too
DISK_MARGIN = 16 << 20  # bytes kept free beyond the estimate (file-system metadata, logs)
UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded 2^63 - 1
CGROUP_ROOT = Path("/sys/fs/cgroup")


def gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


# --------------------------------------------------------------------------- memory
def onepass_window_bytes(cfg, context: int) -> int:
    """Peak bytes one window of ``context`` tokens adds to a one-pass calibration forward.

    With L = context, N layers, H query heads, KV heads of D dims, hidden size Dh,
    intermediate size I, vocabulary V and M mask channels (2 with sliding-window layers), in
    float32::

        4 · L · (M·L  +  2·N·KV·D  +  max(2·H·L + 3·I, V)  +  4·Dh)
                 mask   K/V outputs    attention scores and MLP of one     hidden
                        of all layers  layer, or the logits if larger     states

    The mask and every layer's new K/V entries stay alive for the whole forward (graph input
    and outputs); inside a layer at most two (H, L, L) score tensors and the three (L, I) MLP
    tensors coexist and are freed before the next layer; the (L, V) logits come last. A batch
    of B windows needs B times this; the weights and observers are already resident.

    Measured peak RSS increase of one forward of the observed calibrate graph (with
    ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the RSS) against this
    estimate: SmolLM2-135M L=128 28.3 MB (estimate 32.3, +14 %), L=512 119.9 MB (130.0,
    +8 %), batches 2 and 4 linear in B; tiny Llama (H=4, V=256) L=1024 38.5 MB (40.5, +5 %),
    L=256 B=4 10.1 MB (12.2, +20 %).
    """
    L = int(context)
    mask_channels = 2 if cfg.has_sliding_layers else 1
    per_token = (
        mask_channels * L
        + 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
        + max(2 * cfg.num_heads * L + 3 * cfg.intermediate_size, cfg.vocab_size)
        + 4 * cfg.hidden_size
    )
    return BYTES_PER_ELEMENT * L * per_token


@dataclass(frozen=True)
class BatchFit:
    batch: int  # windows per forward to use
    requested: int
    window_bytes: int  # estimated peak per window
    available: int  # bytes available when checked

    @property
    def reduced(self) -> bool:
        return self.batch < self.requested

    def to_dict(self) -> dict[str, int]:
        return {"batch_size": self.batch, "batch_size_requested": self.requested,
                "estimated_bytes_per_window": self.window_bytes, "available_bytes": self.available}


def fit_calibration_batch(cfg, context: int, requested: int, available: int,
                          usable_fraction: float = USABLE_FRACTION) -> BatchFit:
    """The largest batch ≤ ``requested`` whose estimated peak fits ``usable_fraction`` of
    ``available`` bytes; :class:`NpuqError` with the numbers when not even one window fits."""
    if requested < 1:
        raise NpuqError(f"--batch-size {requested} must be at least 1")
    per_window = onepass_window_bytes(cfg, context)
    budget = int(available * usable_fraction)
    fits = budget // per_window
    if fits < 1:
        raise NpuqError(
            f"one-pass calibration at --context {context} needs about {gib(per_window)} for a single window "
            f"but only {gib(available)} of memory is available ({int(usable_fraction * 100)} % of it usable): "
            "lower --context, free memory, or use --calibration-mode sequential (one token at a time)"
        )
    return BatchFit(int(min(requested, fits)), requested, per_window, int(available))


def guard_calibration_batch(cfg, context: int, requested: int, available: int | None = None) -> BatchFit:
    """:func:`fit_calibration_batch` against :func:`available_memory` (or ``available``),
    with a warning when the batch has to shrink."""
    fit = fit_calibration_batch(cfg, context, requested, available_memory() if available is None else available)
    if fit.reduced:
        warnings.warn(
            f"--batch-size {requested} would need about {gib(requested * fit.window_bytes)} for one-pass calibration "
            f"at context {context} but {gib(fit.available)} is available: calibrating {fit.batch} window(s) per "
            "forward instead (same encodings, more forwards)", stacklevel=2,
        )
    return fit


def meminfo_available(text: str) -> int | None:
    """``MemAvailable`` of /proc/meminfo text, in bytes (None when absent)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "MemAvailable":
            fields = value.split()
            if fields and fields[0].isdigit():
                return int(fields[0]) * (1024 if len(fields) < 2 or fields[1].lower() == "kb" else 1)
    return None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2, no limit) and garbage read as None


def cgroup_memory_headroom(root: str | os.PathLike = CGROUP_ROOT) -> int | None:
    """Bytes left under the memory limit of this process's cgroup (v2 ``memory.max`` −
    ``memory.current``, v1 ``memory.limit_in_bytes`` − ``memory.usage_in_bytes``), or None
    when no limit is set. Inside a container the cgroup namespace mounts its own cgroup at the
    root; the tightest of the folders found there counts."""
    root = Path(root)
    pairs = [(root / "memory.max", root / "memory.current"),
             (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes")]
    headrooms = []
    for limit_file, usage_file in pairs:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < UNLIMITED:
            headrooms.append(max(0, limit - usage))
    return min(headrooms) if headrooms else None


def available_memory(device=None) -> int:
    """Bytes this process can still allocate where ``device`` computes: a CUDA device's free
    memory, else the system's available memory (psutil, else /proc/meminfo ``MemAvailable``)
    capped by the cgroup's headroom. Unknown: no limit."""
    if device is not None and str(device).startswith("cuda"):
        # torch only for a CUDA device: this module loads no heavy library
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    candidates = []
    try:
        candidates.append(int(psutil.virtual_memory().available))
    except ImportError:
        try:
            value = meminfo_available(Path("/proc/meminfo").read_text())
        except OSError:
            value = None
        if value is not None:
            candidates.append(value)
    headroom = cgroup_memory_headroom()
    if headroom is not None:
        candidates.append(headroom)
    return min(candidates) if candidates else UNLIMITED


def release_freed_memory() -> None:
    """Collect garbage (graphs hold reference cycles: their tensors outlive them until a
    collection), then hand the C allocator's free pages back to the system (glibc's
    ``malloc_trim``; elsewhere nothing more). glibc keeps freed blocks below its mmap threshold
    (which rises to 32 MB after the first large free) in its heaps: quantizing
    Qwen2.5-Coder-0.5B in parts, the process still held 1.7 GB after its second part was freed,
    0.53 GB after a trim. Called between the parts of a model quantized or exported in parts."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; musl has none
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------- disk
def _existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_disk(destination: str | os.PathLike, needed: int, what: str) -> int:
    """Refuse (before writing) when the file system of ``destination`` has less than
    ``needed`` + a margin free; returns the free bytes. ``what`` names the output for the message."""
    where = _existing(Path(destination).parent)
    free = shutil.disk_usage(where).free
    if free < needed + DISK_MARGIN:
        raise NpuqError(
            f"{what} needs about {mib(needed)} but only {mib(free)} is free on the disk of {where} "
            f"(keeping {mib(DISK_MARGIN)} spare): free some space or choose an --out on another disk"
        )
    return free
