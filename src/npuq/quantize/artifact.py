"""The quantized artifact: a folder written atomically, and read back as a LogitsFn.

    DIR/decode.json          converted decode program (AR-1): its graph, as JSON
    DIR/prefill.json         converted prefill program (AR-N), same encodings
    DIR/weights.safetensors  the tensors of both programs, once (they share every weight)
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

Reading an artifact back trusts nothing in it: config.json and encodings.json are checked
field by field, file names must stay inside DIR, and the programs are rebuilt from checked JSON
and safetensors data: nothing is unpickled and no code from the files runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.fx import GraphModule

from npuq.fsio import atomic_dir, read_json, resolve_inside
from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.calibrate.encodings import encodings_json
from npuq.quantize.graphfile import WEIGHTS_FILE, read_program, read_weights, tensor_bytes, write_programs
from npuq.quantize.pt2e import QuantizedModel, fold_constant_dequant, simplify_qdq
from npuq.quant.recipe import Recipe

ARTIFACT_FORMAT = "npuq-quantized/2"
PROGRAMS = {"decode": "decode.json", "prefill": "prefill.json"}


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every state-dict tensor (name, dtype, shape, bytes) in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return h.hexdigest()


def versions() -> dict[str, str]:
    import torchao

    import npuq

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
    total += tensor_bytes([qm.decode, qm.prefill])
    return total + sum(NODE_BYTES * len(gm.graph.nodes) for gm in (qm.decode, qm.prefill))


def save_artifact(qm: QuantizedModel, out: str | os.PathLike, *, force: bool = False,
                  extra_config: dict[str, Any] | None = None) -> Path:
    """Write ``qm`` to the folder ``out`` atomically (see the module docstring)."""
    from npuq.resources import check_free_disk

    final = check_destination(out, force)
    encodings_text = encodings_json(qm.encodings)  # what json.dumps(indent=1) writes, made faster
    check_free_disk(final, estimate_artifact_bytes(qm, encodings_text), f"the artifact {final}")
    with atomic_dir(final) as tmp:
        cfg = qm.config
        write_programs({"decode": qm.decode, "prefill": qm.prefill}, tmp, PROGRAMS, WEIGHTS_FILE)
        (tmp / "encodings.json").write_text(encodings_text + "\n", encoding="utf-8")
        config = {
            "format": ARTIFACT_FORMAT,
            **(extra_config or {}),
            "model_config": cfg.to_dict(),
            "context": qm.context,
            "programs": {k: {"file": f, "ar_len": 1 if k == "decode" else qm.prefill_len} for k, f in PROGRAMS.items()},
            "weights": WEIGHTS_FILE,
            "recipe": qm.recipe.to_dict(),
            "recipe_plan": qm.plan.to_list() if qm.plan is not None else None,
            "stats": qm.stats,
            "versions": versions(),
        }
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n", encoding="utf-8")
    return final


def read_artifact(folder: str | os.PathLike) -> dict[str, Any]:
    """The artifact's config.json, after checking it is a complete artifact of this format
    whose fields have the types this npuq reads (:class:`NpuqError` otherwise)."""
    from npuq.quant.recipe import Recipe

    path = Path(folder)
    where = f"--artifact {path}"
    again = "quantize the model again"
    if not path.is_dir():
        raise NpuqError(f"{where}: no such folder; give the --out folder of 'npuq quantize'")
    if not (path / "config.json").is_file():
        raise NpuqError(f"{where}: no config.json, so not an npuq artifact; give the --out folder of 'npuq quantize'")
    config = read_json(path / "config.json", where, again)
    if not isinstance(config, dict):
        raise NpuqError(f"{where}: config.json holds {type(config).__name__}, not an object; {again}")
    fmt = config.get("format")
    if fmt != ARTIFACT_FORMAT:
        versions = config.get("versions")
        made_by = versions.get("npuq", "an unknown version") if isinstance(versions, dict) else "an unknown version"
        raise NpuqError(
            f"{where}: format {fmt!r:.60} written by npuq {made_by!s:.20} is not {ARTIFACT_FORMAT!r}, "
            f"which this npuq reads; {again} with this npuq"
        )
    for key in ("model_config", "context", "programs", "recipe"):
        if key not in config:
            raise NpuqError(f"{where}: config.json lacks {key!r}; the artifact is incomplete, {again}")
    context = config["context"]
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise NpuqError(f"{where}: context {context!r:.40} is not a whole number of at least 2; {again}")
    programs = config["programs"]
    if not isinstance(programs, dict):
        raise NpuqError(f"{where}: 'programs' is not an object; {again}")
    for kind in PROGRAMS:
        entry = programs.get(kind)
        if not isinstance(entry, dict) or "file" not in entry:
            raise NpuqError(f"{where}: the {kind} program is missing from config.json; the artifact is incomplete, {again}")
        file = resolve_inside(path, entry["file"], f"{where}, {kind} program")
        if not file.is_file():
            raise NpuqError(f"{where}: {entry['file']} is missing; the artifact is incomplete, {again}")
        ar_len = entry.get("ar_len")
        limit = 1 if kind == "decode" else context - 1
        if isinstance(ar_len, bool) or not isinstance(ar_len, int) or not 1 <= ar_len <= limit:
            raise NpuqError(f"{where}: the {kind} program's ar_len {ar_len!r:.40} is not a whole number from 1 to "
                            f"{limit}; {again}")
    weights = resolve_inside(path, config.get("weights"), f"{where}, weights")
    if not weights.is_file():
        raise NpuqError(f"{where}: {config['weights']} is missing; the artifact is incomplete, {again}")
    for key in ("model", "versions", "stats", "calibration"):
        if key in config and not isinstance(config[key], dict):
            raise NpuqError(f"{where}: {key!r} is not an object; {again}")
    try:
        ModelConfig.from_dict(config["model_config"])
        Recipe.from_dict(config["recipe"], name="artifact")
    except NpuqError as exc:
        raise NpuqError(f"{where}: config.json is invalid ({exc}); {again}") from None
    return config


def program_path(folder: str | os.PathLike, config: dict[str, Any], kind: str) -> Path:
    """The file of program ``kind`` in an artifact read by :func:`read_artifact` (inside ``folder``)."""
    return resolve_inside(folder, config["programs"][kind]["file"], f"--artifact {folder}, {kind} program")


def weights_path(folder: str | os.PathLike, config: dict[str, Any]) -> Path:
    """The weights file the programs of an artifact read by :func:`read_artifact` share."""
    return resolve_inside(folder, config["weights"], f"--artifact {folder}, weights")


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


def load_artifact(folder: str | os.PathLike, fold_constants: bool = True) -> QuantizedModel:
    """Read an artifact back; ``.logits(tokens (B, T)) -> (B, T, V)`` runs its prefill and
    decode programs from an empty cache (a LogitsFn for npuq.eval).

    ``fold_constants`` dequantizes the integer weights once at load time instead of at every
    call (:func:`npuq.quantize.pt2e.fold_constant_dequant`), once for both programs, and turns
    the activations' quantize/dequantize pairs into cheaper ops that compute the same bits
    (:func:`npuq.quantize.pt2e.simplify_qdq`): same numbers, a faster CPU simulation,
    float-sized weights in memory. Pass False to keep the programs as saved (q/dq nodes and all,
    what the lowering reads).
    """
    from npuq.calibrate.encodings import read_encodings

    path = Path(folder)
    config = read_artifact(path)
    encodings = read_encodings(path / "encodings.json")  # checked before the slow program loads
    tensors = read_weights(weights_path(path, config))
    folded: dict[Any, Any] = {}  # shared by both programs
    programs = {}
    for kind in ("decode", "prefill"):
        module = load_program(program_path(path, config, kind), tensors)
        programs[kind] = simplify_qdq(fold_constant_dequant(module, folded)) if fold_constants else module
    return QuantizedModel(
        config=ModelConfig.from_dict(config["model_config"]),
        context=int(config["context"]),
        prefill_len=int(config["programs"]["prefill"]["ar_len"]),
        decode=programs["decode"],
        prefill=programs["prefill"],
        encodings=encodings,
        recipe=Recipe.from_dict(config["recipe"]),
        stats=config.get("stats", {}),
    )
