"""A float model whose weights stay on disk, run one block at a time (docs/design.md §13).

:class:`StreamedDecoder` runs the :class:`~npuq.models.decoder.StaticDecoder`'s whole-window
forward (empty cache, the calibrate graph's shape) in its own steps: embedding, block 0 … N-1,
final norm and head. Before a step it reads that step's tensors from the lazy checkpoint
(:class:`~npuq.models.weights.Checkpoint`) into a skeleton built on the meta device, checks
them as any checkpoint is checked, runs the step for every row of the batch, and returns the
tensors to the meta device. Peak memory is the largest step's weights (the embedding table or
the head, or one block) plus the activations of one batch, never the model: a Qwen2.5-7B-shaped
model (30 GB as float32) scores text in a few GB.

The steps are the StaticDecoder's own methods on the same weights, so the logits equal the
resident model's bit for bit (tests/models/test_stream.py, every family). Each call reads every
weight once: score many windows per call (``--batch-size``) where the activations allow.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

from npuq.errors import ModelLoadError, NpuqError
from npuq.models.config import ModelConfig
from npuq.models.decoder import StaticDecoder, all_finite
from npuq.models.weights import Checkpoint

_HEAD = ("norm.weight", "lm_head.weight")


class StreamedDecoder(nn.Module):
    """Calibrate-mode forward of a model read block by block (module docstring). CPU only.

    Called like the StaticDecoder without caches: ``(tokens, mask, positions) → (logits,)``.
    ``norm_offset``: add the config's norm offset to norm weights as they are read (Gemma
    checkpoints store weight - 1; a GGUF conversion already added it)."""

    def __init__(self, cfg: ModelConfig, checkpoint: Checkpoint, max_context: int, norm_offset: bool = False,
                 progress: bool = False) -> None:
        super().__init__()
        self.progress = progress  # a bar over the steps of each forward, on stderr
        self.config = cfg
        self.max_context = max_context
        self.checkpoint = checkpoint
        self.norm_offset = norm_offset and bool(cfg.norm_weight_offset)
        with torch.device("meta"):  # nothing allocated: each step's weights arrive when it runs
            skeleton = StaticDecoder(cfg, max_context)
        skeleton.check_shapes({n: checkpoint.shape(n) for n in checkpoint.names()}, checkpoint.source)
        # not a submodule: its meta parameters are no weights of this module (device_of → the CPU)
        self.__dict__["skeleton"] = skeleton
        self.reads = 0  # tensors read from the checkpoint, for tests and progress
        self.tied = cfg.tie_word_embeddings  # the checkpoint's lm head is its embedding table (config may change)
        # Applied to the skeleton once a part's weights are in (resident_part): (skeleton, first,
        # end) → None, in place; npuq.optimize.rotate.rotate_streamed sets one.
        self.transform: Callable[[nn.Module, int, int], None] | None = None

    def to(self, device: str | torch.device | None = None) -> StreamedDecoder:  # type: ignore[override]
        if device is not None and torch.device(device).type != "cpu":
            raise NpuqError("a streamed model runs on the CPU only: drop --device or load the whole model")
        return self

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *caches: torch.Tensor):
        if caches:
            raise NpuqError("a streamed model runs whole windows from an empty cache (no KV-cache inputs)")

        model = self.skeleton
        n = self.config.num_layers
        with torch.no_grad(), tqdm(total=n + 2, desc=f"streaming {tokens.shape[0]} window(s)", unit="step",
                                   file=sys.stderr, disable=not self.progress, leave=False) as bar:
            with self._resident(("embed_tokens.weight",)):
                h = model.embed(tokens)  # (B, T, hidden)
            bar.update()
            rope_and_masks = model.rope_and_masks(mask, positions)
            for i in range(n):
                prefix = f"layers.{i}."
                with self._resident(tuple(name for name in model.state_dict() if name.startswith(prefix))):
                    h, _, _ = model.block(i, h, rope_and_masks)
                bar.update()
            with self._resident(_HEAD):
                logits = model.head(h)  # (B, T, V)
            bar.update()
            return (logits,)

    def state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every weight in name order, read one at a time: the resident model's
        sorted ``state_dict().items()`` (for :func:`npuq.quantize.artifact.weights_sha256`)."""
        for name in sorted(self.skeleton.state_dict()):
            yield name, self.read(name)

    def part_names(self, first: int, end: int) -> tuple[str, ...]:
        """The tensors of layers first … end - 1, with the embedding if ``first`` is 0 and the final
        norm and head if ``end`` is the last layer's: what a part of the model graph binds
        (:func:`npuq.calibrate.graphs.part_graph`)."""
        prefixes = tuple(f"layers.{i}." for i in range(first, end))
        names = [name for name in self.skeleton.state_dict() if name.startswith(prefixes)]
        return (*(("embed_tokens.weight",) if first == 0 else ()), *names,
                *(_HEAD if end == self.config.num_layers else ()))

    @contextlib.contextmanager
    def resident_part(self, first: int, end: int) -> Iterator[None]:
        """Inside, the skeleton holds the weights of :meth:`part_names` (read and checked, then
        :attr:`transform`-ed); they are freed on leaving."""
        with self._resident(self.part_names(first, end), own=self.transform is not None):
            if self.transform is not None:
                self.transform(self.skeleton, first, end)
            yield

    @contextlib.contextmanager
    def _resident(self, names: tuple[str, ...], own: bool = False) -> Iterator[None]:
        """Inside, the skeleton's tensors ``names`` hold the checkpoint's weights (checked for
        finite values); afterwards they are back on the meta device and their memory is freed."""
        model = self.skeleton
        for name in names:
            _set(model, name, self.read(name, own))
        try:
            yield
        finally:
            for name in names:
                _set(model, name, torch.empty(_get(model, name).shape, device="meta"))


    def read(self, name: str, own: bool = False) -> torch.Tensor:
        """Tensor ``name`` as the resident model holds it: float32, the norm offset added, a tied
        head read from the embedding; checked for finite values. ``own``: memory of its own, to
        write in place (a float32 file's tensor is mapped from the file and is copied; a widened
        bf16/fp16 one is a fresh tensor already: a copy would double a 7B head's 2.2 GB)."""
        stored = name
        if name == "lm_head.weight" and name not in self.checkpoint and self.tied:
            stored = "embed_tokens.weight"
        t = self.checkpoint.get(stored)
        self.reads += 1
        if self.norm_offset and name.endswith("norm.weight"):
            t = t + self.config.norm_weight_offset
        elif own and self.checkpoint.entries[stored].dtype == "F32":
            t = t.clone()
        if not all_finite(t):
            raise ModelLoadError(f"{self.checkpoint.source}: tensor {name} contains NaN or Inf values")
        return t.contiguous()


def _get(model: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def _set(model: nn.Module, name: str, t: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(t, requires_grad=False)
    else:
        module._buffers[attr] = t
