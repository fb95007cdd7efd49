"""The quantized artifact: a folder written atomically, and read back as a LogitsFn.

    DIR/decode.pt2       converted decode program (AR-1), torch.export.save
    DIR/prefill.pt2      converted prefill program (AR-N), same encodings
    DIR/encodings.json   per-tensor encodings (npuq.calibrate.encodings)
    DIR/config.json      every option, the recipe and what it matched, versions, the sha256 of
                         the float weights, timings

The folder is assembled in a temporary sibling and renamed into place, so a reader never
sees half an artifact; an existing DIR is refused unless ``force``, and then replaced only
once the new one is complete, and only if the disk has room for it.

Reading an artifact back trusts nothing in it: config.json and encodings.json are checked
field by field, program file names must stay inside DIR, and a ``.pt2`` is loaded only if
its archive holds no pickled payload (:func:`check_pt2_pickle_free`), with every tensor blob
that torch does unpickle restricted to ``weights_only`` loading.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from npuq.fsio import atomic_dir, read_json, resolve_inside
from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.quantize.pt2e import QuantizedModel, fold_constant_dequant
from npuq.quant.recipe import Recipe
from npuq.runtime.runner import example_inputs

ARTIFACT_FORMAT = "npuq-quantized/1"
PROGRAMS = {"decode": "decode.pt2", "prefill": "prefill.pt2"}


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over every state-dict tensor (name, dtype, shape, bytes) in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
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


NODE_BYTES = 2048  # serialized graph per FX node in a .pt2 (tiny Llama: 1.02 MB for 530 nodes)


def estimate_artifact_bytes(qm: QuantizedModel) -> int:
    """Bytes the artifact folder will take: per program its tensors (stored uncompressed in the
    .pt2 archive) plus the serialized graph, and the encodings.

    Tiny Llama 16a8w: estimate 1.25 MB per program, written 1.18 MB.
    """
    total = len(json.dumps(qm.encodings, indent=1)) + 64 * 1024  # + config.json
    for gm in (qm.decode, qm.prefill):
        storages = {}
        for t in list(gm.parameters()) + list(gm.buffers()):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        total += sum(storages.values()) + NODE_BYTES * len(gm.graph.nodes)
    return total


def save_artifact(qm: QuantizedModel, out: str | os.PathLike, *, force: bool = False,
                  extra_config: dict[str, Any] | None = None) -> Path:
    """Write ``qm`` to the folder ``out`` atomically (see the module docstring)."""
    from npuq.resources import check_free_disk

    final = check_destination(out, force)
    check_free_disk(final, estimate_artifact_bytes(qm), f"the artifact {final}")
    with atomic_dir(final) as tmp:
        cfg = qm.config
        for kind, filename in PROGRAMS.items():
            module = qm.decode if kind == "decode" else qm.prefill
            ar_len = 1 if kind == "decode" else qm.prefill_len
            program = torch.export.export(module, example_inputs(cfg, kind, qm.context, ar_len))
            torch.export.save(program, tmp / filename)
        (tmp / "encodings.json").write_text(json.dumps(qm.encodings, indent=1) + "\n", encoding="utf-8")
        config = {
            "format": ARTIFACT_FORMAT,
            **(extra_config or {}),
            "model_config": cfg.to_dict(),
            "context": qm.context,
            "programs": {k: {"file": f, "ar_len": 1 if k == "decode" else qm.prefill_len} for k, f in PROGRAMS.items()},
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


# torch.export.load unpickles some payloads with weights_only=False (pickled weights and
# constants, custom and opaque objects, and as a fallback when a weights_only load fails) and
# loads compiled AOTInductor libraries: any of them runs code from the file. torch.export.save
# writes none of them for npuq's programs, so an archive that has one is refused unread.
_PT2_CODE_DIRS = ("data/aotinductor/", "data/executorch/", "data/mtia", "xl_model_weights/")
_PT2_CONFIGS = (("data/weights/", "_weights_config.json", "weight_"),
                ("data/constants/", "_constants_config.json", "tensor_"))


def check_pt2_pickle_free(path: Path) -> None:
    """Refuse a ``.pt2`` archive that would make torch.export.load unpickle or load code."""
    try:
        with zipfile.ZipFile(path) as archive:
            # The archive has one root folder (the program's name); torch reads names below it.
            names = {n.split("/", 1)[1]: n for n in archive.namelist() if "/" in n}
            if not any(n.startswith("models/") and n.endswith(".json") for n in names):
                raise NpuqError(f"{path}: not a torch.export archive of the current format (no models/*.json); "
                                "quantize again")
            for name in names:
                pickled = name.endswith(".pt") and not name.startswith("data/sample_inputs/")
                if pickled or name.startswith(_PT2_CODE_DIRS) or name.endswith((".so", ".dll", ".dylib")):
                    raise NpuqError(f"{path}: the archive holds {name}, which loading would unpickle or execute; "
                                    "refusing it (npuq never writes one): quantize again")
            for folder, suffix, prefix in _PT2_CONFIGS:
                for name in (n for n in names if n.startswith(folder) and n.endswith(suffix)):
                    payloads = json.loads(archive.read(names[name])).get("config", {})
                    for fqn, meta in payloads.items():
                        if meta.get("use_pickle") or not str(meta.get("path_name", "")).startswith(prefix):
                            raise NpuqError(f"{path}: {fqn} is stored as a pickled object, which loading would "
                                            "unpickle; refusing it (npuq never writes one): quantize again")
    except NpuqError:
        raise
    except (zipfile.BadZipFile, OSError, KeyError, ValueError, AttributeError, TypeError, RecursionError) as exc:
        raise NpuqError(f"{path}: not a readable program archive ({type(exc).__name__}: {exc}); quantize again") from None


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Make every torch.load in the block restricted to tensors and plain containers
    (``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, which torch reads at each call), whatever the caller asks."""
    saved = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def load_program(path: Path) -> torch.export.ExportedProgram:
    """A program saved by :func:`save_artifact`, loaded without running code from the file."""
    import pickle

    import torchao.quantization.pt2e  # noqa: F401  (registers the quantized_decomposed ops)

    check_pt2_pickle_free(path)
    try:
        with _weights_only_loads():
            return torch.export.load(path)
    except pickle.UnpicklingError:
        raise NpuqError(f"{path}: the archive holds a pickled object other than plain tensors; refusing to unpickle "
                        "it (that could run code from the file): quantize again") from None
    except Exception as exc:  # torch raises many types for a damaged or foreign file
        raise NpuqError(f"{path}: cannot load the program ({type(exc).__name__}: {exc}); quantize again") from None


def load_artifact(folder: str | os.PathLike, fold_constants: bool = True) -> QuantizedModel:
    """Read an artifact back; ``.logits(tokens (B, T)) -> (B, T, V)`` runs its prefill and
    decode programs from an empty cache (a LogitsFn for npuq.eval).

    ``fold_constants`` dequantizes the integer weights once at load time instead of at every
    call (:func:`npuq.quantize.pt2e.fold_constant_dequant`): same numbers, a faster CPU
    simulation, float-sized weights in memory. Pass False to keep the programs as saved.
    """
    from npuq.calibrate.encodings import read_encodings

    path = Path(folder)
    config = read_artifact(path)
    encodings = read_encodings(path / "encodings.json")  # checked before the slow program loads
    programs = {}
    for kind in ("decode", "prefill"):
        module = load_program(program_path(path, config, kind)).module()
        programs[kind] = fold_constant_dequant(module) if fold_constants else module
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
