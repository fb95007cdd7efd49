"""Builders, one module per op family; importing this package registers them all."""

from npuq.lower.builders import elementwise, embedding, linear, matmul, norm, qdq, shape  # noqa: F401
