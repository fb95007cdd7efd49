"""Builder registry: one builder per (op, pattern), each with the oldest SDK and HTP arch it
needs; the registry picks the newest one the target supports.

    @register("aten.embedding.default", min_sdk=(2, 48, 0), variant="optimized")
    def embedding_optimized(view: NodeView, ctx: BuildContext) -> Lowered: ...

Builders live in :mod:`npuq.lower.builders`, one module per op family, which also holds the
lookups (``select``, ``builders_for``, ``known_ops``): importing it registers every builder
first. A builder never reads the environment and never mutates shared state; when it cannot
lower its node it raises :class:`npuq.lower.ir.Unsupported` with the reason (never returns None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from npuq.errors import NpuqError
from npuq.lower.ir import Lowered, NodeView
from npuq.lower.target import Target

EMBEDDING_PATTERNS = ("auto", "legacy", "optimized")
EMBEDDING_STORAGE = ("u16", "int8-rowscale")


EMBEDDING_NOTE = "embedding"  # the kind of the note each embedding builder leaves: the pattern it chose


@dataclass(frozen=True)
class LowerOptions:
    """User choices that pick among patterns."""

    embedding: str = "auto"  # the embedding pattern: auto = optimized when the SDK is >= 2.48, else legacy
    embedding_storage: str = "u16"  # how the optimized pattern stores the table

    def __post_init__(self) -> None:
        if self.embedding not in EMBEDDING_PATTERNS:
            raise NpuqError(f"unknown embedding pattern {self.embedding!r}; choose {', '.join(EMBEDDING_PATTERNS)}")
        if self.embedding_storage not in EMBEDDING_STORAGE:
            raise NpuqError(f"unknown embedding storage {self.embedding_storage!r}; choose {', '.join(EMBEDDING_STORAGE)}")

    def variant_for(self, op: str) -> str | None:
        if op == "aten.embedding.default" and self.embedding != "auto":
            return self.embedding
        return None


@dataclass(frozen=True)
class BuildContext:
    target: Target = field(default_factory=Target)
    options: LowerOptions = field(default_factory=LowerOptions)


Builder = Callable[[NodeView, BuildContext], Lowered]


@dataclass(frozen=True)
class BuilderSpec:
    op: str
    fn: Builder
    min_sdk: tuple[int, int, int] = (0, 0, 0)
    min_arch: int | None = None
    variant: str = "default"

    def supported_on(self, target: Target) -> bool:
        sdk_ok = self.min_sdk == (0, 0, 0) or target.sdk_at_least(self.min_sdk)
        arch_ok = self.min_arch is None or target.arch_at_least(self.min_arch)
        return sdk_ok and arch_ok

    def requirement(self) -> str:
        parts = []
        if self.min_sdk != (0, 0, 0):
            parts.append(f"QNN >= {'.'.join(map(str, self.min_sdk))}")
        if self.min_arch is not None:
            parts.append(f"HTP >= v{self.min_arch}")
        return " and ".join(parts) or "any target"


_REGISTRY: dict[str, list[BuilderSpec]] = {}


def register(*ops: str, min_sdk: tuple[int, int, int] = (0, 0, 0), min_arch: int | None = None,
             variant: str = "default") -> Callable[[Builder], Builder]:
    """Register ``fn`` as the builder of ``ops`` for targets meeting ``min_sdk`` and ``min_arch``."""

    def decorate(fn: Builder) -> Builder:
        for op in ops:
            specs = _REGISTRY.setdefault(op, [])
            if any(s.min_sdk == min_sdk and s.min_arch == min_arch and s.variant == variant for s in specs):
                raise ValueError(f"two builders for {op} with the same requirements ({variant}, {min_sdk}, {min_arch})")
            specs.append(BuilderSpec(op, fn, tuple(min_sdk), min_arch, variant))
        return fn

    return decorate
