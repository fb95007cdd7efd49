"""Numeric formats of the HTP target as data: granularities, tensor formats, scheme presets.

One table (:data:`SCHEMES`) holds every preset of docs/design.md §1. A scheme is an activation
format plus a weight format; everything else (observers, PT2E specs, encodings.json) is
derived from these frozen, validated dataclasses.

Storage conventions (as the ExecuTorch Qualcomm backend carries them in PT2E):

    format             PT2E dtype   quant range          meaning on HTP
    uint16 affine      int32        [0, 65535]           unsigned 16-bit fixed point
    uint8 affine       uint8        [0, 255]
    uint8 symmetric    uint8        [0, 255]             zero point 128 (optional 8-bit KV cache)
    int16 symmetric    int16        [-32767, 32767]      zero point 0
    int8 symmetric     int8         [-127, 127]          zero point 0
    int4 symmetric     int8         [-7, 7]              zero point 0, stored in int8
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from npuq.errors import NpuqError

if TYPE_CHECKING:  # torch is imported where a dtype is asked for: the CLI's --help lists schemes without it
    import torch


# --------------------------------------------------------------------------- granularity
@dataclass(frozen=True)
class PerTensor:
    """One scale and offset for the whole tensor."""


@dataclass(frozen=True)
class PerChannel:
    """One scale per index of ``axis`` (axis 0 of a linear weight (O, I) = output channels)."""

    axis: int = 0

    def __post_init__(self) -> None:
        if self.axis < 0:
            raise ValueError(f"PerChannel axis must be >= 0, got {self.axis}")


@dataclass(frozen=True)
class PerBlock:
    """LPBQ: one scale per output channel and block of ``size`` input channels.

    Block scales are re-quantized to ``scale_bits`` bits against a per-channel base scale
    (scale = base_c · k, k an integer in 1 .. 2**scale_bits), docs/design.md §1.
    """

    size: int = 32
    scale_bits: int = 4

    def __post_init__(self) -> None:
        if self.size not in (16, 32, 64):
            raise ValueError(f"PerBlock size must be 16, 32 or 64 input channels, got {self.size}")
        if not 1 <= self.scale_bits <= 8:
            raise ValueError(f"PerBlock scale_bits must be 1..8, got {self.scale_bits}")


Granularity = Union[PerTensor, PerChannel, PerBlock]


# --------------------------------------------------------------------------- formats
@dataclass(frozen=True)
class TensorFormat:
    """Integer format of one tensor: bits, sign, symmetry, granularity.

    Signed formats are symmetric on the narrow range [-(2^(b-1) - 1), 2^(b-1) - 1] with zero
    point 0. Unsigned formats are affine (free zero point), except unsigned 8-bit symmetric
    (zero point 128), the optional 8-bit KV-cache format of docs/design.md §1.
    """

    bits: int
    signed: bool
    granularity: Granularity = PerTensor()
    symmetric: bool | None = None  # None: symmetric exactly when signed

    def __post_init__(self) -> None:
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.signed)
        if self.bits not in (4, 8, 16):
            raise ValueError(f"bits must be 4, 8 or 16, got {self.bits}")
        if self.signed and not self.symmetric:
            raise ValueError("signed formats are symmetric (zero point 0) on HTP")
        if not self.signed and self.symmetric and self.bits != 8:
            raise ValueError("unsigned symmetric is the 8-bit KV-cache format only")
        if not self.signed and self.bits == 4:
            raise ValueError("4-bit formats are signed symmetric (weights); unsigned 4-bit is not an HTP format")
        if not self.signed and not isinstance(self.granularity, PerTensor):
            raise ValueError("unsigned (affine) formats are per-tensor activation formats")
        if not isinstance(self.granularity, (PerTensor, PerChannel, PerBlock)):
            raise TypeError(f"granularity must be PerTensor, PerChannel or PerBlock, got {self.granularity!r}")
        if isinstance(self.granularity, PerBlock) and self.bits != 4:
            raise ValueError("PerBlock (LPBQ) applies to 4-bit weights only")

    @property
    def quant_min(self) -> int:
        return -(2 ** (self.bits - 1) - 1) if self.signed else 0

    @property
    def quant_max(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1

    @property
    def torch_dtype(self) -> torch.dtype:
        """The PT2E storage dtype (see the module docstring)."""
        # torch loads on use: the CLI's --help lists the schemes without it
        import torch

        if self.bits == 16:
            return torch.int16 if self.signed else torch.int32
        return torch.int8 if self.signed else torch.uint8

    @property
    def qscheme(self) -> torch.qscheme:
        # torch loads on use: the CLI's --help lists the schemes without it
        import torch

        if isinstance(self.granularity, PerTensor):
            return torch.per_tensor_symmetric if self.symmetric else torch.per_tensor_affine
        return torch.per_channel_symmetric

    @property
    def eps(self) -> float:
        """Smallest scale an observer may produce: 1e-4 over the number of steps (as ExecuTorch)."""
        return 1e-4 / (self.quant_max - self.quant_min)

    def describe(self) -> str:
        kind = f"{'int' if self.signed else 'uint'}{self.bits} {'symmetric' if self.symmetric else 'affine'}"
        g = self.granularity
        where = {PerTensor: "per tensor", PerChannel: f"per channel (axis {getattr(g, 'axis', 0)})",
                 PerBlock: f"per block of {getattr(g, 'size', 0)} inputs (LPBQ)"}[type(g)]
        return f"{kind} {where}"


UINT16 = TensorFormat(16, signed=False)
UINT8 = TensorFormat(8, signed=False)
INT16_SYM = TensorFormat(16, signed=True)  # second input of an activation × activation matmul
UINT8_SYM = TensorFormat(8, signed=False, symmetric=True)  # optional 8-bit KV cache, zero point 128


# --------------------------------------------------------------------------- schemes
@dataclass(frozen=True)
class Scheme:
    name: str
    activation: TensorFormat
    weight: TensorFormat

    def __post_init__(self) -> None:
        if not isinstance(self.activation.granularity, PerTensor) or self.activation.symmetric:
            raise ValueError(f"scheme {self.name}: activations must be unsigned per-tensor affine")
        if not self.weight.signed or isinstance(self.weight.granularity, PerTensor):
            raise ValueError(f"scheme {self.name}: weights must be signed symmetric per channel or per block")

    def describe(self) -> str:
        return f"{self.name}: activations {self.activation.describe()}, weights {self.weight.describe()}"


def _scheme(name: str, act_bits: int, w_bits: int, granularity: Granularity = PerChannel(0)) -> Scheme:
    return Scheme(name, TensorFormat(act_bits, signed=False), TensorFormat(w_bits, signed=True, granularity=granularity))


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        _scheme("16a16w", 16, 16),
        _scheme("16a8w", 16, 8),
        _scheme("16a4w", 16, 4),
        _scheme("16a4w_block", 16, 4, PerBlock(32)),
        _scheme("8a8w", 8, 8),
    )
}


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):  # TypeError: a list or object from a JSON file is no name
        raise NpuqError(f"unknown scheme {name!r:.60}; choose one of {', '.join(SCHEMES)}") from None
