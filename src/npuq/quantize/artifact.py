"""The quantized artifact: a folder written atomically, and read back as a LogitsFn.

    DIR/decode.json          converted decode program (AR-1): its graph, as JSON
    DIR/prefill.json         converted prefill program (AR-N), same encodings
    DIR/scoring.json         the prefill program at batch 4, which ``npuq eval`` scores text with
                             (artifacts written before it existed lack it and score row by row)
    DIR/weights.safetensors  the tensors of the programs, once (they share every weight)
    DIR/encodings.json       per-tensor encodings (npuq.calibrate.encodings)
    DIR/config.json          every option, the recipe and what it matched, versions, the sha256 of
                             the float weights, timings

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

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torchao
from torch.fx import GraphModule
from torch.fx._lazy_graph_module import _LazyGraphModule

import npuq
from npuq.fsio import atomic_dir, read_json, resolve_inside
from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.calibrate.encodings import encodings_json, read_encodings
from npuq.quantize.graphfile import WEIGHTS_FILE, read_program, read_weights, tensor_bytes, write_programs
from npuq.quantize.passes import fold_constant_dequant, simplify_qdq
from npuq.quantize.pt2e import QuantizedModel
from npuq.resources import check_free_disk
from npuq.runtime.runner import tokens_shape
from npuq.quant.recipe import Recipe
from npuq.records import from_json, optional_key, to_json

ARTIFACT_FORMAT = "npuq-quantized/2"
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


@dataclass(frozen=True, kw_only=True)
class ArtifactConfig:
    """config.json: the format, what the model and its quantization were, and where the
    programs are. Checked on construction (the files themselves: :func:`read_artifact`)."""

    format: str = ARTIFACT_FORMAT
    model: ModelInfo | None = optional_key()  # None (no key): save_artifact was not given it
    calibration: dict[str, Any] | None = optional_key()  # corpus, tokens, mode, batch, threads, device
    optimize: dict[str, Any] | None = None  # SeqMSE / GPTQ summaries; None: nearest rounding
    rotation: dict[str, Any] | None = optional_key()  # RotationReport folded into the weights; None (no key): none
    model_config: dict[str, Any]  # ModelConfig.to_dict(); read with :attr:`cfg`
    context: int
    programs: dict[str, ProgramEntry]  # decode (AR-1), prefill (AR-N), optionally scoring (AR-N, batch > 1)
    weights: str  # the safetensors file the programs share, inside the folder
    recipe: dict[str, Any]  # Recipe.to_dict(); read with :meth:`read_recipe`
    recipe_plan: tuple[dict[str, Any], ...] | None  # RecipePlan.to_list(): path, kind, rule, scheme per layer
    stats: dict[str, Any]  # QuantizedModel.stats: scheme, calibration tokens and times
    versions: dict[str, str]  # npuq, torch, torchao

    def __post_init__(self) -> None:
        if self.format != ARTIFACT_FORMAT:
            raise NpuqError(f"format {self.format!r:.60} is not {ARTIFACT_FORMAT!r}")
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


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every state-dict tensor (name, dtype, shape, bytes) in name order."""
    return _state_sha256(sorted(model.state_dict().items()))


def start_weights_sha256(model: torch.nn.Module) -> Callable[[], str]:
    """:func:`weights_sha256` of ``model`` computed in a thread, returned by the function this
    returns (which waits for it). hashlib releases the GIL, so the hash (0.5 s for SmolLM2-135M)
    overlaps tracing and calibration. The state dict is taken now (a trace swaps parameters for
    fake tensors while it runs); nothing may write the weights in place until the result is in."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="npuq-weights-sha256")
    future = pool.submit(_state_sha256, sorted(model.state_dict().items()))
    pool.shutdown(wait=False)
    return future.result


def _state_sha256(items: list[tuple[str, torch.Tensor]]) -> str:
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


def estimate_artifact_bytes(qm: QuantizedModel, encodings_text: str | None = None) -> int:
    """Bytes the artifact folder will take at most: the programs' tensors once (the weights file;
    uint16 narrowing only makes it smaller), each program's graph, and the encodings
    (``encodings_text``: their JSON, when already made)."""
    if encodings_text is None:
        encodings_text = encodings_json(qm.encodings)
    total = len(encodings_text) + 64 * 1024  # + config.json
    programs = [gm for gm in (qm.decode, qm.prefill, qm.scoring) if gm is not None]
    total += tensor_bytes(programs)
    return total + sum(NODE_BYTES * len(gm.graph.nodes) for gm in programs)


def save_artifact(qm: QuantizedModel, out: str | os.PathLike, *, force: bool = False, model: ModelInfo | None = None,
                  calibration: dict[str, Any] | None = None, optimize: dict[str, Any] | None = None,
                  rotation: dict[str, Any] | None = None) -> Path:
    """Write ``qm`` to the folder ``out`` atomically (see the module docstring); ``model``,
    ``calibration``, ``optimize`` and ``rotation`` go into config.json as they are."""
    final = check_destination(out, force)
    encodings_text = encodings_json(qm.encodings)  # what json.dumps(indent=1) writes, made faster
    check_free_disk(final, estimate_artifact_bytes(qm, encodings_text), f"the artifact {final}")
    with atomic_dir(final) as tmp:
        cfg = qm.config
        graphs = {"decode": qm.decode, "prefill": qm.prefill}
        entries = {"decode": ProgramEntry(PROGRAMS["decode"], 1),
                   "prefill": ProgramEntry(PROGRAMS["prefill"], qm.prefill_len)}
        if qm.scoring is not None:
            graphs[SCORING] = qm.scoring
            entries[SCORING] = ProgramEntry(SCORING_FILE, qm.prefill_len, tokens_shape(qm.scoring)[0])
        write_programs(graphs, tmp, {kind: entry.file for kind, entry in entries.items()}, WEIGHTS_FILE)
        (tmp / "encodings.json").write_text(encodings_text + "\n", encoding="utf-8")
        config = ArtifactConfig(
            model=model,
            calibration=calibration,
            optimize=optimize,
            rotation=rotation,
            model_config=cfg.to_dict(),
            context=qm.context,
            programs=entries,
            weights=WEIGHTS_FILE,
            recipe=qm.recipe.to_dict(),
            recipe_plan=tuple(qm.plan.to_list()) if qm.plan is not None else None,
            stats=qm.stats,
            versions=versions(),
        )
        text = json.dumps(to_json(config), indent=2, default=str)
        (tmp / "config.json").write_text(text + "\n", encoding="utf-8")
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
    if fmt != ARTIFACT_FORMAT:  # before the keys: another format's differ
        versions = data.get("versions")
        made_by = versions.get("npuq", "an unknown version") if isinstance(versions, dict) else "an unknown version"
        raise NpuqError(
            f"{where}: format {fmt!r:.60} written by npuq {made_by!s:.20} is not {ARTIFACT_FORMAT!r}, "
            f"which this npuq reads; {again} with this npuq"
        )
    try:
        config = from_json(ArtifactConfig, data, f"{where}: config.json")
    except NpuqError as exc:
        raise NpuqError(f"{exc}; {again}") from None
    for kind in config.programs:
        if not program_path(path, config, kind).is_file():
            raise NpuqError(f"{where}: {config.programs[kind].file} is missing; the artifact is incomplete, {again}")
    if not weights_path(path, config).is_file():
        raise NpuqError(f"{where}: {config.weights} is missing; the artifact is incomplete, {again}")
    return config


def program_path(folder: str | os.PathLike, config: ArtifactConfig, kind: str) -> Path:
    """The file of program ``kind`` in an artifact read by :func:`read_artifact` (inside ``folder``)."""
    return resolve_inside(folder, config.programs[kind].file, f"--artifact {folder}, {kind} program")


def weights_path(folder: str | os.PathLike, config: ArtifactConfig) -> Path:
    """The weights file the programs of an artifact read by :func:`read_artifact` share."""
    return resolve_inside(folder, config.weights, f"--artifact {folder}, weights")


def load_program(path: str | os.PathLike, tensors: dict[str, torch.Tensor] | None = None) -> GraphModule:
    """A program saved by :func:`save_artifact`: a static GraphModule taking (tokens, mask,
    positions, K caches, V caches) and returning (logits, K news, V news), with every node's
    ``meta["val"]`` (shape and dtype). Built from checked data only (see
    :mod:`npuq.quantize.graphfile`); ``tensors``: the artifact's weights, already read
    (:func:`npuq.quantize.graphfile.read_weights`), to share them between programs."""
    try:
        return read_program(Path(path), tensors)
    except NpuqError:
        raise
    except Exception as exc:  # a damaged file must not surface as a traceback
        raise NpuqError(f"{path}: cannot load the program ({type(exc).__name__}: {exc}); quantize again") from None


def load_artifact(folder: str | os.PathLike, fold_constants: bool = True, scoring: bool = True) -> QuantizedModel:
    """Read an artifact back; ``.logits(tokens (B, T)) -> (B, T, V)`` runs its prefill and
    decode programs from an empty cache (a LogitsFn for npuq.eval).

    ``fold_constants`` dequantizes the integer weights once at load time instead of at every
    call (:func:`npuq.quantize.passes.fold_constant_dequant`), once for all programs, and turns
    the activations' quantize/dequantize pairs into cheaper ops that compute the same bits
    (:func:`npuq.quantize.passes.simplify_qdq`): same numbers, a faster CPU simulation,
    float-sized weights in memory. Pass False to keep the programs as saved (q/dq nodes and all,
    what the lowering reads). ``scoring``: also load the scoring program, if the artifact has one.
    """
    path = Path(folder)
    config = read_artifact(path)
    encodings = read_encodings(path / "encodings.json")  # checked before the slow program loads
    tensors = read_weights(weights_path(path, config))
    folded: dict[Any, Any] = {}  # shared by the programs
    kinds = [*PROGRAMS, *([SCORING] if scoring and SCORING in config.programs else [])]
    programs = {}
    for kind in kinds:
        module = load_program(program_path(path, config, kind), tensors)
        entry = config.programs[kind]
        shape = (entry.batch or 1, entry.ar_len)
        if tokens_shape(module) != shape:
            raise NpuqError(f"--artifact {path}: the {kind} program does not take tokens of shape {shape} as config.json "
                            "says; quantize again")
        if fold_constants:  # lazy: fold and simplify rewrite the graph, its code is made once, on the first call
            module = simplify_qdq(fold_constant_dequant(_LazyGraphModule.from_graphmodule(module), folded))
        programs[kind] = module
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
    )
