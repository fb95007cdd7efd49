"""The quantized artifact: a folder written atomically, and read back as a LogitsFn.

    DIR/decode.json          converted decode program (AR-1): its graph, as JSON
    DIR/prefill.json         converted prefill program (AR-N), same encodings
    DIR/scoring.json         the prefill program at batch 4, which ``npuq eval`` scores text with
                             (artifacts written before it existed lack it and score row by row)
    DIR/weights.safetensors  the tensors of the programs, once (they share every weight)
    DIR/encodings.json       per-tensor encodings (npuq.calibrate.encodings)
    DIR/config.json          every option, the recipe and what it matched, versions, the sha256 of
                             the float weights, timings, bits_per_weight and weight_bytes
    DIR/recipe.json          with --bits-per-weight: the recipe it chose, as --recipe reads it

The program files are npuq's own (:mod:`npuq.quantize.graphfile`): writing them takes no trace
(the converted graphs are written as they are) and decode and prefill share one copy of the
weights; format 1 held two ``torch.export`` archives, each with all the weights, made by tracing
each program once more. An artifact of another format is refused with the advice to quantize
again.

The folder is assembled in a temporary sibling and renamed into place, so a reader never
sees half an artifact; an existing DIR is refused unless ``force``, and then replaced only
once the new one is complete, and only if the disk has room for it.

config.json is one record, :class:`ArtifactConfig`, written with :func:`npuq.records.to_json`
and read back with :func:`npuq.records.from_json`, so its fields are defined once.

Reading an artifact back trusts nothing in it: config.json and encodings.json are checked
field by field, file names must stay inside DIR, and the programs are rebuilt from checked JSON
and safetensors data: nothing is unpickled and no code from the files runs.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torchao
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _LazyGraphModule

import npuq
from npuq.fsio import atomic_dir, read_json, resolve_inside
from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.models.stream import StreamedDecoder
from npuq.calibrate.encodings import encodings_json, read_encodings
from npuq.quantize.graphfile import WEIGHTS_FILE, read_program, read_weights, tensor_bytes, write_programs
from npuq.quantize.passes import fold_constant_dequant, simplify_qdq
from npuq.quantize.pt2e import QuantizedModel, QuantizedPart, check_parts
from npuq.runtime.runner import PartChain, Residency, tokens_shape
from npuq.optimize.budget import RECIPE_FILE, BudgetReport
from npuq.optimize.recovery import RecoverySummary
from npuq.quant.recipe import Recipe
from npuq.quant.size import WeightSize
from npuq.records import from_json, optional_key, to_json
from npuq.resources import USABLE_FRACTION, available_memory, check_free_disk

ARTIFACT_FORMAT = "npuq-quantized/2"
PARTS_FORMAT = "npuq-quantized/3"  # a model quantized in parts: one folder of programs per part
PROGRAMS = {"decode": "decode.json", "prefill": "prefill.json"}  # what a device runs (batch 1)
SCORING = "scoring"  # the optional program that scores text, at batch ProgramEntry.batch
SCORING_FILE = "scoring.json"


@dataclass(frozen=True)
class ModelInfo:
    """The float model the artifact was quantized from."""

    name: str  # --model as given
    source: str  # the file or folder read (its tokenizer goes with the artifact)
    weights_sha256: str  # :func:`weights_sha256` of the float weights


@dataclass(frozen=True)
class ProgramEntry:
    file: str  # inside the artifact folder
    ar_len: int  # tokens per call
    batch: int | None = optional_key()  # rows per call; None (no key): 1


@dataclass(frozen=True)
class PartEntry:
    """One part of a model quantized in parts: its layers and the folder of its programs and
    weights (the files ``programs`` and ``weights`` name, inside that folder)."""

    layers: tuple[int, int]  # first, end: layers first … end - 1
    folder: str


def part_folder(k: int, count: int) -> str:
    return f"part-{k + 1}-of-{count}"


@dataclass(frozen=True, kw_only=True)
class ArtifactConfig:
    """config.json: the format, what the model and its quantization were, and where the
    programs are. Checked on construction (the files themselves: :func:`read_artifact`)."""

    format: str = ARTIFACT_FORMAT
    model: ModelInfo | None = optional_key()  # None (no key): save_artifact was not given it
    calibration: dict[str, Any] | None = optional_key()  # corpus, tokens, mode, batch, threads, device
    optimize: RecoverySummary | None = None  # what SeqMSE / GPTQ did; None: neither ran (nearest rounding)
    rotation: dict[str, Any] | None = optional_key()  # RotationReport folded into the weights; None (no key): none
    model_config: dict[str, Any]  # ModelConfig.to_dict(); read with :attr:`cfg`
    context: int
    programs: dict[str, ProgramEntry]  # decode (AR-1), prefill (AR-N), optionally scoring (AR-N, batch > 1)
    weights: str  # the safetensors file the programs share, inside the folder
    recipe: dict[str, Any]  # Recipe.to_dict(); read with :meth:`read_recipe`
    recipe_plan: tuple[dict[str, Any], ...] | None  # RecipePlan.to_list(): path, kind, rule, scheme per layer
    stats: dict[str, Any]  # QuantizedModel.stats: scheme, calibration tokens and times
    versions: dict[str, str]  # npuq, torch, torchao
    # Format 3: the parts in order, each a folder holding ``programs`` and ``weights``; None (no
    # key, format 2): one part, whose files lie in the artifact folder itself.
    parts: tuple[PartEntry, ...] | None = optional_key()
    bits_per_weight: float | None = optional_key()  # mean code bits per weight parameter (npuq.quant.size)
    weight_bytes: int | None = optional_key()  # packed weight codes plus their scales
    budget: BudgetReport | None = optional_key()  # what --bits-per-weight chose (its recipe: DIR/recipe.json)

    def __post_init__(self) -> None:
        expected = ARTIFACT_FORMAT if self.parts is None else PARTS_FORMAT
        if self.format != expected:
            raise NpuqError(f"format {self.format!r:.60} is not {expected!r}")
        if self.parts is not None:
            check_parts([p.layers for p in self.parts], ModelConfig.from_dict(self.model_config).num_layers)
            if len({p.folder for p in self.parts}) != len(self.parts):
                raise NpuqError("two parts name the same folder")
        if self.context < 2:
            raise NpuqError(f"context {self.context} is not a whole number of at least 2")
        for kind in PROGRAMS:
            entry = self.programs.get(kind)
            if entry is None:
                raise NpuqError(f"the {kind} program is missing from 'programs', so the artifact is incomplete")
            limit = 1 if kind == "decode" else self.context - 1
            if not 1 <= entry.ar_len <= limit:
                raise NpuqError(f"the {kind} program's ar_len {entry.ar_len} is not a whole number from 1 to {limit}")
            if entry.batch not in (None, 1):
                raise NpuqError(f"the {kind} program's batch is {entry.batch}, not 1")
        unknown = set(self.programs) - set(PROGRAMS) - {SCORING}
        if unknown:
            raise NpuqError(f"unknown programs {sorted(unknown)}")
        scoring = self.programs.get(SCORING)
        if scoring is not None and (scoring.ar_len != self.programs["prefill"].ar_len or (scoring.batch or 1) < 2):
            raise NpuqError(f"the scoring program (ar_len {scoring.ar_len}, batch {scoring.batch}) is not the prefill "
                            f"program's ar_len {self.programs['prefill'].ar_len} at a batch of 2 or more")
        ModelConfig.from_dict(self.model_config)  # a wrong key, type or value is an NpuqError
        Recipe.from_dict(self.recipe, name="artifact")

    @property
    def cfg(self) -> ModelConfig:
        """``model_config`` as the model's config."""
        return ModelConfig.from_dict(self.model_config)

    def read_recipe(self) -> Recipe:
        """``recipe`` as the recipe it holds."""
        return Recipe.from_dict(self.recipe)


@dataclass(frozen=True)
class ArtifactExtra:
    """What :func:`save_artifact` adds to config.json beside the programs, and the recipe file it writes."""

    size: WeightSize  # bits_per_weight and weight_bytes of the weights
    budget: BudgetReport | None = None
    recipe: Recipe | None = None  # written to DIR/``budget.recipe_file`` (a file --recipe reads)

    def config_fields(self) -> dict[str, Any]:
        return {"bits_per_weight": self.size.bits_per_weight, "weight_bytes": self.size.weight_bytes,
                "budget": self.budget}

    def write(self, folder: Path) -> None:
        if self.recipe is not None:
            name = self.budget.recipe_file if self.budget is not None else RECIPE_FILE
            (folder / name).write_text(json.dumps(self.recipe.to_dict(), indent=2) + "\n", encoding="utf-8")


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every state-dict tensor (name, dtype, shape, bytes) in name order."""
    return _state_sha256(sorted(model.state_dict().items()))


def start_weights_sha256(model: torch.nn.Module) -> Callable[[], str]:
    """:func:`weights_sha256` of ``model`` computed in a thread, returned by the function this
    returns (which waits for it). hashlib releases the GIL, so the hash (0.5 s for SmolLM2-135M)
    overlaps tracing and calibration. The state dict is taken now (a trace swaps parameters for
    fake tensors while it runs); nothing may write the weights in place until the result is in."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="npuq-weights-sha256")
    streamed = isinstance(model, StreamedDecoder)  # its tensors are read one at a time, in the thread
    future = pool.submit(_state_sha256, model.state_items() if streamed else sorted(model.state_dict().items()))
    pool.shutdown(wait=False)
    return future.result


def _state_sha256(items: Iterable[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in items:
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return h.hexdigest()


def versions() -> dict[str, str]:
    return {"npuq": npuq.__version__, "torch": torch.__version__, "torchao": torchao.__version__}


def check_destination(out: str | os.PathLike, force: bool) -> Path:
    """Refuse an existing ``out`` without ``force`` (cheap: call before any work)."""
    path = Path(out)
    if path.exists() and not force:
        raise NpuqError(f"{path} already exists: pass --force to replace it, or choose another --out")
    if path.exists() and not path.is_dir():
        raise NpuqError(f"{path} exists and is not a folder: remove it or choose another --out")
    return path


NODE_BYTES = 600  # a node of a program file (SmolLM2-135M 16a8w: 13,000 nodes, 7.1 MB per program)
FILES = {**PROGRAMS, SCORING: SCORING_FILE}


def _programs_bytes(programs: list[GraphModule]) -> int:
    """Bytes the programs' files take at most: their tensors once (the weights file; uint16
    narrowing only makes it smaller) and each program's graph."""
    return tensor_bytes(programs) + sum(NODE_BYTES * len(gm.graph.nodes) for gm in programs)


def estimate_artifact_bytes(qm: QuantizedModel, encodings_text: str | None = None) -> int:
    """Bytes the artifact folder of ``qm`` (with its programs) will take at most: the programs'
    files and the encodings (``encodings_text``: their JSON, when already made)."""
    if encodings_text is None:
        encodings_text = encodings_json(qm.encodings)
    programs = [gm for gm in (qm.decode, qm.prefill, qm.scoring) if gm is not None]
    chains = [gm.programs if isinstance(gm, PartChain) else [gm] for gm in programs]
    parts = [list(p) for p in zip(*chains)]  # the programs of each part (they share its weights)
    return len(encodings_text) + 64 * 1024 + sum(_programs_bytes(p) for p in parts)  # + config.json


class ArtifactWriter:
    """An artifact folder being assembled (:func:`writing_artifact`): each part's programs as
    soon as they are made (:meth:`store`), then the encodings and config.json (:meth:`finish`).
    A model of one part has its files in the folder itself (format 2), byte for byte what one
    write of the whole model gave; a model of several parts one folder per part (format 3)."""

    def __init__(self, tmp: Path, final: Path, count: int):
        self.tmp, self.final, self.count = tmp, final, count
        self.parts: list[PartEntry] = []
        self.entries: dict[str, ProgramEntry] | None = None
        self.finished = False

    def store(self, k: int, part: QuantizedPart) -> None:
        """Write part ``k`` (of ``count``) of the model: its programs and their weights."""
        if k != len(self.parts):
            raise ValueError(f"part {k} stored after {len(self.parts)} parts")
        programs = part.programs()
        folder = self.tmp if self.count == 1 else self.tmp / part_folder(k, self.count)
        check_free_disk(self.final, _programs_bytes(list(programs.values())), f"the artifact {self.final}")
        folder.mkdir(exist_ok=True)
        entries = {kind: ProgramEntry(FILES[kind], tokens_shape(gm)[1], None if kind != SCORING else tokens_shape(gm)[0])
                   for kind, gm in programs.items()}
        if self.entries is not None and entries != self.entries:
            raise ValueError(f"part {k} has programs {entries}, the parts before it {self.entries}")
        self.entries = entries
        write_programs(programs, folder, {kind: entry.file for kind, entry in entries.items()}, WEIGHTS_FILE)
        self.parts.append(PartEntry(part.layers, folder.name))

    def finish(self, qm: QuantizedModel, *, model: ModelInfo | None = None, calibration: dict[str, Any] | None = None,
               optimize: RecoverySummary | None = None, rotation: dict[str, Any] | None = None,
               extra: ArtifactExtra | None = None) -> None:
        """Write encodings.json and config.json once every part is stored; ``model``,
        ``calibration``, ``optimize`` and ``rotation`` go into config.json as they are, and so do
        ``extra``'s fields (it also writes its recipe file)."""
        if len(self.parts) != self.count:
            raise ValueError(f"{len(self.parts)} of {self.count} parts stored")
        encodings_text = encodings_json(qm.encodings)  # what json.dumps(indent=1) writes, made faster
        check_free_disk(self.final, len(encodings_text) + 64 * 1024, f"the artifact {self.final}")
        (self.tmp / "encodings.json").write_text(encodings_text + "\n", encoding="utf-8")
        config = ArtifactConfig(
            format=ARTIFACT_FORMAT if self.count == 1 else PARTS_FORMAT,
            model=model,
            calibration=calibration,
            optimize=optimize,
            rotation=rotation,
            model_config=qm.config.to_dict(),
            context=qm.context,
            programs=self.entries,
            weights=WEIGHTS_FILE,
            recipe=qm.recipe.to_dict(),
            recipe_plan=tuple(qm.plan.to_list()) if qm.plan is not None else None,
            stats=qm.stats,
            versions=versions(),
            parts=None if self.count == 1 else tuple(self.parts),
            **(extra.config_fields() if extra is not None else {}),
        )
        text = json.dumps(to_json(config), indent=2, default=str)
        (self.tmp / "config.json").write_text(text + "\n", encoding="utf-8")
        if extra is not None:
            extra.write(self.tmp)
        self.finished = True


@contextlib.contextmanager
def writing_artifact(out: str | os.PathLike, parts: int = 1, *, force: bool = False) -> Iterator[ArtifactWriter]:
    """An :class:`ArtifactWriter` of a model of ``parts`` parts, in a temporary sibling of
    ``out`` that replaces ``out`` only when the block ends with the writer finished; an error or
    an interrupt leaves ``out`` as it was (see the module docstring)."""
    final = check_destination(out, force)
    with atomic_dir(final) as tmp:
        writer = ArtifactWriter(tmp, final, parts)
        yield writer
        if not writer.finished:
            raise RuntimeError(f"the artifact {final} was not finished: {len(writer.parts)} of {parts} parts stored")


def save_artifact(qm: QuantizedModel, out: str | os.PathLike, *, force: bool = False, model: ModelInfo | None = None,
                  calibration: dict[str, Any] | None = None, optimize: RecoverySummary | None = None,
                  rotation: dict[str, Any] | None = None, extra: ArtifactExtra | None = None) -> Path:
    """Write ``qm`` (with its programs) to the folder ``out`` atomically (see the module
    docstring and :class:`ArtifactWriter`)."""
    layers = qm.parts or ((0, qm.config.num_layers),)
    final = check_destination(out, force)
    check_free_disk(final, estimate_artifact_bytes(qm), f"the artifact {final}")  # before writing anything
    with writing_artifact(out, len(layers), force=force) as writer:
        for k, part_layers in enumerate(layers):
            pick = (lambda gm: gm.programs[k]) if qm.parts else (lambda gm: gm)
            writer.store(k, QuantizedPart(part_layers, {}, pick(qm.decode), pick(qm.prefill),
                                          None if qm.scoring is None else pick(qm.scoring)))
        writer.finish(qm, model=model, calibration=calibration, optimize=optimize, rotation=rotation, extra=extra)
    return final


def read_artifact(folder: str | os.PathLike) -> ArtifactConfig:
    """The artifact's config.json, after checking it is a complete artifact of this format:
    its fields as :class:`ArtifactConfig` checks them, then the files it names, which must lie
    inside the folder and be there (:class:`NpuqError` otherwise)."""
    path = Path(folder)
    where = f"--artifact {path}"
    again = "quantize the model again"
    if not path.is_dir():
        raise NpuqError(f"{where}: no such folder; give the --out folder of 'npuq quantize'")
    if not (path / "config.json").is_file():
        raise NpuqError(f"{where}: no config.json, so not an npuq artifact; give the --out folder of 'npuq quantize'")
    data = read_json(path / "config.json", where, again)
    if not isinstance(data, dict):
        raise NpuqError(f"{where}: config.json holds {type(data).__name__}, not an object; {again}")
    fmt = data.get("format")
    if fmt not in (ARTIFACT_FORMAT, PARTS_FORMAT):  # before the keys: another format's differ
        versions = data.get("versions")
        made_by = versions.get("npuq", "an unknown version") if isinstance(versions, dict) else "an unknown version"
        raise NpuqError(
            f"{where}: format {fmt!r:.60} written by npuq {made_by!s:.20} is not {ARTIFACT_FORMAT!r} or "
            f"{PARTS_FORMAT!r}, which this npuq reads; {again} with this npuq"
        )
    try:
        config = from_json(ArtifactConfig, data, f"{where}: config.json")
    except NpuqError as exc:
        raise NpuqError(f"{exc}; {again}") from None
    for part in range(len(config.parts or [None])):
        for kind in config.programs:
            if not program_path(path, config, kind, part).is_file():
                raise NpuqError(f"{where}: {_inside(config, config.programs[kind].file, part)} is missing; the artifact "
                                f"is incomplete, {again}")
        if not weights_path(path, config, part).is_file():
            raise NpuqError(f"{where}: {_inside(config, config.weights, part)} is missing; the artifact is incomplete, "
                            f"{again}")
    return config


def _inside(config: ArtifactConfig, file: str, part: int) -> str:
    return file if config.parts is None else f"{config.parts[part].folder}/{file}"


def program_path(folder: str | os.PathLike, config: ArtifactConfig, kind: str, part: int = 0) -> Path:
    """The file of program ``kind`` (of part ``part``) in an artifact read by :func:`read_artifact`
    (inside ``folder``)."""
    return resolve_inside(folder, _inside(config, config.programs[kind].file, part),
                          f"--artifact {folder}, {kind} program")


def weights_path(folder: str | os.PathLike, config: ArtifactConfig, part: int = 0) -> Path:
    """The weights file the programs (of part ``part``) of an artifact read by :func:`read_artifact` share."""
    return resolve_inside(folder, _inside(config, config.weights, part), f"--artifact {folder}, weights")


def load_program(path: str | os.PathLike, tensors: dict[str, torch.Tensor] | None = None, *,
                 narrow: bool = False) -> GraphModule:
    """A program saved by :func:`save_artifact`: a static GraphModule taking (tokens, mask,
    positions, K caches, V caches) and returning (logits, K news, V news), with every node's
    ``meta["val"]`` (shape and dtype). Built from checked data only (see
    :mod:`npuq.quantize.graphfile`); ``tensors``: the artifact's weights, already read
    (:func:`npuq.quantize.graphfile.read_weights`), to share them between programs; ``narrow``:
    16-bit codes stay the uint16 they are stored as, for the lowering only
    (:func:`npuq.quantize.graphfile.read_program`)."""
    try:
        return read_program(Path(path), tensors, narrow=narrow)
    except NpuqError:
        raise
    except Exception as exc:  # a damaged file must not surface as a traceback
        raise NpuqError(f"{path}: cannot load the program ({type(exc).__name__}: {exc}); quantize again") from None


def _load_part(path: Path, config: ArtifactConfig, part: int, kinds: list[str], fold_constants: bool
               ) -> dict[str, GraphModule]:
    """The programs ``kinds`` of part ``part`` (of the whole artifact, if it is one part), sharing
    its weights (see :func:`load_artifact`)."""
    tensors = read_weights(weights_path(path, config, part))
    folded: dict[Any, Any] = {}  # shared by the programs of the part
    programs = {}
    for kind in kinds:
        module = load_program(program_path(path, config, kind, part), tensors)
        entry = config.programs[kind]
        shape = (entry.batch or 1, entry.ar_len)
        if tokens_shape(module) != shape:
            raise NpuqError(f"--artifact {path}: the {kind} program does not take tokens of shape {shape} as "
                            "config.json says; quantize again")
        if fold_constants:  # lazy: fold and simplify rewrite the graph, its code is made once, on the first call
            module = simplify_qdq(fold_constant_dequant(_LazyGraphModule.from_graphmodule(module), folded))
        programs[kind] = module
    return programs


class _PartOnDemand:
    """The programs of one part of an artifact, read on first use and dropped by :meth:`release`."""

    def __init__(self, path: Path, config: ArtifactConfig, part: int, kinds: list[str], fold_constants: bool):
        self._args = (path, config, part, kinds, fold_constants)
        self._programs: dict[str, GraphModule] | None = None

    def program(self, kind: str) -> GraphModule:
        if self._programs is None:
            self._programs = _load_part(*self._args)
        return self._programs[kind]

    def release(self) -> None:
        self._programs = None
        gc.collect()  # graphs hold reference cycles: their weights go only with a collection


class _ProgramOnDemand:
    """Program ``kind`` of a :class:`_PartOnDemand`, called as the program itself."""

    def __init__(self, part: _PartOnDemand, kind: str, entry: ProgramEntry):
        self.part, self.kind = part, kind
        self.tokens_shape = (entry.batch or 1, entry.ar_len)  # what npuq.runtime.runner.tokens_shape reads

    def graph_module(self) -> GraphModule:
        """The program, read now if its part is not loaded."""
        return self.part.program(self.kind)

    def __call__(self, *args: torch.Tensor) -> Any:
        return self.graph_module()(*args)

    def release(self) -> None:
        self.part.release()


def load_artifact(folder: str | os.PathLike, fold_constants: bool = True, scoring: bool = True,
                  in_turn: bool | None = None) -> QuantizedModel:
    """Read an artifact back; ``.logits(tokens (B, T)) -> (B, T, V)`` runs its prefill and
    decode programs from an empty cache (a LogitsFn for npuq.eval).

    ``fold_constants`` dequantizes the integer weights once at load time instead of at every
    call (:func:`npuq.quantize.passes.fold_constant_dequant`), once for all programs, and turns
    the activations' quantize/dequantize pairs into cheaper ops that compute the same bits
    (:func:`npuq.quantize.passes.simplify_qdq`): same numbers, a faster CPU simulation,
    float-sized weights in memory. Pass False to keep the programs as saved (q/dq nodes and all,
    what the lowering reads). ``scoring``: also load the scoring program, if the artifact has one.

    ``in_turn`` (an artifact in parts): each part's programs are read when the part first runs
    and dropped when a scoring run is done with it (:func:`npuq.runtime.runner.run_in_turn`), so
    memory holds one part; without the scoring program, whose batch would need every part at
    once. None: in turn where the parts' float32 weights (4 bytes per stored code) do not fit the
    memory this process may use.
    """
    path = Path(folder)
    config = read_artifact(path)
    encodings = read_encodings(path / "encodings.json")  # checked before the slow program loads
    if in_turn is None:
        stored = sum(weights_path(path, config, k).stat().st_size for k in range(len(config.parts or [None])))
        in_turn = config.parts is not None and 4 * stored > USABLE_FRACTION * available_memory()
    in_turn = in_turn and config.parts is not None
    kinds = [*PROGRAMS, *([SCORING] if scoring and not in_turn and SCORING in config.programs else [])]
    if config.parts is None:
        programs = _load_part(path, config, 0, kinds, fold_constants)
    elif in_turn:
        parts = [_PartOnDemand(path, config, k, kinds, fold_constants) for k in range(len(config.parts))]
        layers = [p.layers for p in config.parts]
        residency = Residency()  # the kinds read the same parts
        programs = {kind: PartChain(layers, [_ProgramOnDemand(p, kind, config.programs[kind]) for p in parts],
                                    in_turn=True, residency=residency)
                    for kind in kinds}
    else:
        per_part = [_load_part(path, config, k, kinds, fold_constants) for k in range(len(config.parts))]
        layers = [p.layers for p in config.parts]
        programs = {kind: PartChain(layers, [p[kind] for p in per_part]) for kind in kinds}
    return QuantizedModel(
        config=config.cfg,
        context=config.context,
        prefill_len=config.programs["prefill"].ar_len,
        decode=programs["decode"],
        prefill=programs["prefill"],
        encodings=encodings,
        recipe=config.read_recipe(),
        stats=config.stats,
        scoring=programs.get(SCORING),
        parts=None if config.parts is None else tuple(p.layers for p in config.parts),
    )
