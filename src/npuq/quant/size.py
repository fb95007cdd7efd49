"""How big a recipe makes a model's weights: code bits per weight and bytes (docs/design.md §15).

The quantized weights are the linear layers' weights (projections and the lm head, a separate
tensor even when the checkpoint ties it to the embedding) and the embedding table. Norm gammas
(tiny, encoded as activations), int32 biases and RoPE tables are not weights here.

Per weight tensor of O rows and I columns (the embedding table: V rows):

    format                code bits   scales (bytes)
    16aNw (per channel)   N           O × 4             one float32 scale per output channel
    16a4w_block (LPBQ)    4           O × 4 + ⌈O × I/32 × 4 / 8⌉   per-channel float32 base, 4-bit block multipliers
    embedding shared      act bits    8                 per-tensor scale and offset (the activation format)
    embedding pcq8 / pcq4 8 / 4       V × 4             one float32 scale per row

``bits_per_weight`` is the mean code bits per weight parameter over all quantized weights,
scales excluded; ``weight_bytes`` is what they take packed: ⌈code bits / 8⌉ per tensor plus
its scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from npuq.quant.recipe import Recipe
from npuq.quant.schemes import PerBlock, PerChannel, get_scheme

SCALE_BYTES = 4  # a float32 scale
LINEAR = "linear"
EMBEDDING = "embedding"
EMBEDDING_PATH = "embed_tokens"


@dataclass(frozen=True)
class WeightTensor:
    """One quantized weight of a model: its module path, op kind and shape."""

    path: str
    kind: str  # LINEAR or EMBEDDING
    rows: int  # output channels (embedding: vocabulary)
    cols: int  # input channels (embedding: hidden size)

    @property
    def params(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class LayerSize:
    """One weight under one format."""

    path: str
    kind: str
    format: str  # a scheme name (linear) or "embedding:MODE"
    params: int
    code_bits: int  # per weight
    scale_bytes: int

    @property
    def bits(self) -> int:
        """Code bits of the whole tensor."""
        return self.params * self.code_bits

    @property
    def bytes(self) -> int:
        return math.ceil(self.bits / 8) + self.scale_bytes


@dataclass(frozen=True)
class WeightSize:
    """The size of a model's quantized weights under one recipe."""

    bits_per_weight: float  # mean code bits per weight parameter, scales excluded
    weight_bytes: int  # packed codes plus scales
    params: int  # weight parameters counted

    def describe(self) -> str:
        return f"{self.bits_per_weight:.4f} bits per weight, {self.weight_bytes / 1e6:.2f} MB of weights ({self.params:,} parameters)"


def model_weights(model: Any) -> tuple[WeightTensor, ...]:
    """The quantized weights of a StaticDecoder (or any module): every nn.Linear and nn.Embedding, in module order."""
    from torch import nn  # deferred: the size arithmetic (npuq info, recipes) needs no torch

    found = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            found.append(WeightTensor(path, LINEAR, module.out_features, module.in_features))
        elif isinstance(module, nn.Embedding):
            found.append(WeightTensor(path, EMBEDDING, module.num_embeddings, module.embedding_dim))
    return tuple(found)


def embedding_bits(recipe: Recipe, mode: str | None = None) -> int:
    """Code bits of the embedding table in ``mode`` (None: the recipe's): shared takes the activation format."""
    mode = recipe.embedding if mode is None else mode
    return {"pcq8": 8, "pcq4": 4}.get(mode, recipe.scheme.activation.bits)


def layer_size(w: WeightTensor, fmt: str, recipe: Recipe | None = None) -> LayerSize:
    """``w`` under ``fmt``: a scheme name for a linear weight, an embedding mode (shared, pcq8,
    pcq4) for the table (``recipe``: whose activation format a shared table takes)."""
    if w.kind == EMBEDDING:
        bits = {"pcq8": 8, "pcq4": 4}.get(fmt)
        if bits is None:
            if fmt != "shared":
                raise ValueError(f"unknown embedding mode {fmt!r}")
            bits = recipe.scheme.activation.bits if recipe is not None else 16
            scales = 2 * SCALE_BYTES
        else:
            scales = w.rows * SCALE_BYTES
        return LayerSize(w.path, w.kind, f"embedding:{fmt}", w.params, bits, scales)
    weight = get_scheme(fmt).weight
    g = weight.granularity
    if isinstance(g, PerBlock):
        scales = w.rows * SCALE_BYTES + math.ceil(w.rows * (w.cols // g.size) * g.scale_bits / 8)
    elif isinstance(g, PerChannel):
        scales = w.rows * SCALE_BYTES
    else:
        scales = SCALE_BYTES
    return LayerSize(w.path, w.kind, fmt, w.params, weight.bits, scales)


def recipe_layer_sizes(recipe: Recipe, weights: Iterable[WeightTensor]) -> tuple[LayerSize, ...]:
    """Each weight under the format ``recipe`` gives it."""
    return tuple(layer_size(w, recipe.embedding if w.kind == EMBEDDING else recipe.resolve(w.path, LINEAR)[0].name, recipe)
                 for w in weights)


def total_size(layers: Iterable[LayerSize]) -> WeightSize:
    layers = list(layers)
    params = sum(x.params for x in layers)
    bits = sum(x.bits for x in layers)
    return WeightSize(bits / params if params else 0.0, sum(x.bytes for x in layers), params)


def recipe_size(recipe: Recipe, weights: Iterable[WeightTensor]) -> WeightSize:
    """bits_per_weight and weight_bytes of ``weights`` under ``recipe``."""
    return total_size(recipe_layer_sizes(recipe, weights))
