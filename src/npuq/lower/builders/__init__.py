"""Builders, one module per op family; importing this package registers them all, and its
lookups see every builder."""

from __future__ import annotations

from npuq.errors import NpuqError
from npuq.lower import registry
from npuq.lower.builders import elementwise, embedding, linear, matmul, norm, qdq, shape  # each registers its own
from npuq.lower.ir import Unsupported
from npuq.lower.registry import BuilderSpec
from npuq.lower.target import Target

__all__ = ["builders_for", "known_ops", "select", "elementwise", "embedding", "linear", "matmul", "norm", "qdq", "shape"]


def builders_for(op: str) -> list[BuilderSpec]:
    return list(registry._REGISTRY.get(op, ()))


def known_ops() -> list[str]:
    return sorted(registry._REGISTRY)


def select(op: str, target: Target, variant: str | None = None) -> BuilderSpec:
    """The builder for ``op`` on ``target``: the newest (highest SDK, then arch) it supports,
    or the named ``variant`` (an error if the target is known to be too old for it)."""
    specs = builders_for(op)
    if not specs:
        raise Unsupported(f"no builder for {op}; add one under npuq/lower/builders/ (known ops: "
                          "npuq.lower.builders.known_ops())")
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
