"""Split a calibration token stream into whole windows and one short tail, never padded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from npuq.errors import NpuqError


@dataclass(frozen=True)
class CalibrationWindows:
    full: torch.Tensor  # (N, L) int64: N whole windows of L tokens
    tail: torch.Tensor | None  # (1, r) int64 with 0 < r < L, or None

    @property
    def tokens(self) -> int:
        return self.full.numel() + (0 if self.tail is None else self.tail.numel())

    def to(self, device: str | torch.device) -> CalibrationWindows:
        """The same windows on ``device`` (the engines run where their tokens are)."""
        return CalibrationWindows(self.full.to(device), None if self.tail is None else self.tail.to(device))

    def rows(self) -> list[torch.Tensor]:
        """Every window as a 1-D tensor (full windows first, then the tail)."""
        rows = list(self.full)
        if self.tail is not None:
            rows.append(self.tail[0])
        return rows


def split_windows(tokens: Sequence[int] | torch.Tensor, context: int) -> CalibrationWindows:
    """Consecutive windows of ``context`` tokens, each a fresh sequence from position 0.

    The rest (fewer than ``context`` tokens) is the tail, calibrated as a sequence of its own
    length rather than padded to ``context``.
    """
    ids = torch.as_tensor(tokens, dtype=torch.long).flatten()
    if context < 2:
        raise NpuqError(f"--context {context} is too small for calibration: use 2 or more")
    if ids.numel() < context:
        raise NpuqError(
            f"the calibration text has {ids.numel()} tokens, shorter than one window of {context}: "
            f"give more text (--calib-tokens, a larger corpus) or a smaller --context"
        )
    n = ids.numel() // context
    full = ids[: n * context].view(n, context)
    rest = ids[n * context:]
    return CalibrationWindows(full, rest.view(1, -1) if rest.numel() else None)
