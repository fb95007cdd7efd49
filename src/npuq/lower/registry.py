"""Builder registry: one builder per (op, pattern), each with the oldest SDK and HTP arch it
needs; the registry picks the newest one the target supports.

    @register("aten.embedding.default", min_sdk=(2, 48, 0), variant="optimized")
    def embedding_optimized(view: NodeView, ctx: BuildContext) -> Lowered: ...

Builders live in :mod:`npuq.lower.builders`, one module per op family. A builder never
reads the environment and never mutates shared state; when it cannot lower its node it raises
:class:`Unsupported` with the reason (never returns None).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from npuq.errors import NpuqError
from npuq.lower.ir import Lowered, NodeView
from npuq.lower.target import Target

EMBEDDING_PATTERNS = ("auto", "legacy", "optimized")
EMBEDDING_STORAGE = ("u16", "int8-rowscale")


class Unsupported(NpuqError):
    """A builder cannot lower this node; the message is the reason."""


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


def _ensure_loaded() -> None:
    import npuq.lower.builders  # noqa: F401  (registers every builder module)


def builders_for(op: str) -> list[BuilderSpec]:
    _ensure_loaded()
    return list(_REGISTRY.get(op, ()))


def known_ops() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def select(op: str, target: Target, variant: str | None = None) -> BuilderSpec:
    """The builder for ``op`` on ``target``: the newest (highest SDK, then arch) it supports,
    or the named ``variant`` (an error if the target is known to be too old for it)."""
    specs = builders_for(op)
    if not specs:
        raise Unsupported(f"no builder for {op}; add one under npuq/lower/builders/ (known ops: "
                          "npuq.lower.registry.known_ops())")
    if variant is not None:
        chosen = [s for s in specs if s.variant == variant]
        if not chosen:
            raise Unsupported(f"{op} has no {variant!r} pattern; known: {', '.join(sorted({s.variant for s in specs}))}")
        spec = max(chosen, key=lambda s: (s.min_sdk, s.min_arch or 0))
        too_old = (target.qnn_version is not None and spec.min_sdk != (0, 0, 0) and not target.sdk_at_least(spec.min_sdk))
        if too_old:
            raise NpuqError(
                f"the {variant} pattern of {op} needs {spec.requirement()}, but the target is QNN "
                f"{target.qnn_version}: choose another pattern or target a newer SDK"
            )
        return spec
    usable = [s for s in specs if s.supported_on(target)]
    if not usable:
        raise Unsupported(f"{op} needs {' or '.join(s.requirement() for s in specs)}; the target is {target.describe()}")
    return max(usable, key=lambda s: (s.min_sdk, s.min_arch or 0))
