"""The quantized artifact: a folder written atomically, and read back as a LogitsFn.

    DIR/decode.pt2       converted decode program (AR-1), torch.export.save
    DIR/prefill.pt2      converted prefill program (AR-N), same encodings
    DIR/encodings.json   per-tensor encodings (npuq.calibrate.encodings)
    DIR/config.json      every option, the recipe and what it matched, versions, the sha256 of
                         the float weights, timings

The folder is assembled in a temporary sibling and renamed into place, so a reader never
sees half an artifact; an existing DIR is refused unless ``force``, and then replaced only
once the new one is complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from npuq.artifact import atomic_dir
from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.quant.pipeline import QuantizedModel, fold_constant_dequant
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


def save_artifact(qm: QuantizedModel, out: str | os.PathLike, *, force: bool = False,
                  extra_config: dict[str, Any] | None = None) -> Path:
    """Write ``qm`` to the folder ``out`` atomically (see the module docstring)."""
    final = check_destination(out, force)
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
    """The artifact's config.json, after checking it is a complete artifact of this format."""
    path = Path(folder)
    if not path.is_dir():
        raise NpuqError(f"--artifact {path}: no such folder; give the --out folder of 'npuq quantize'")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise NpuqError(f"--artifact {path}: no config.json, so not an npuq artifact; give the --out folder of 'npuq quantize'")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise NpuqError(f"--artifact {path}: config.json is not valid JSON ({exc}); quantize again") from None
    fmt = config.get("format")
    if fmt != ARTIFACT_FORMAT:
        made_by = config.get("versions", {}).get("npuq", "an unknown version")
        raise NpuqError(
            f"--artifact {path}: format {fmt!r} written by npuq {made_by} is not {ARTIFACT_FORMAT!r}, "
            "which this npuq reads; quantize the model again with this npuq"
        )
    for key in ("model_config", "context", "programs"):
        if key not in config:
            raise NpuqError(f"--artifact {path}: config.json lacks {key!r}; the artifact is incomplete, quantize again")
    for kind in ("decode", "prefill"):
        entry = config["programs"].get(kind)
        if entry is None or not (path / entry["file"]).is_file():
            missing = entry["file"] if entry else f"{kind} program"
            raise NpuqError(f"--artifact {path}: {missing} is missing; the artifact is incomplete, quantize again")
    return config


def load_program(path: Path) -> torch.export.ExportedProgram:
    import torchao.quantization.pt2e  # noqa: F401  (registers the quantized_decomposed ops)

    try:
        return torch.export.load(path)
    except Exception as exc:  # torch raises many types for a damaged or foreign file
        raise NpuqError(f"{path}: cannot load the program ({type(exc).__name__}: {exc}); quantize again") from None


def load_artifact(folder: str | os.PathLike, fold_constants: bool = True) -> QuantizedModel:
    """Read an artifact back; ``.logits(tokens (B, T)) -> (B, T, V)`` runs its prefill and
    decode programs from an empty cache (a LogitsFn for npuq.eval).

    ``fold_constants`` dequantizes the integer weights once at load time instead of at every
    call (:func:`npuq.quant.pipeline.fold_constant_dequant`): same numbers, a faster CPU
    simulation, float-sized weights in memory. Pass False to keep the programs as saved.
    """
    path = Path(folder)
    config = read_artifact(path)
    programs = {}
    for kind in ("decode", "prefill"):
        module = load_program(path / config["programs"][kind]["file"]).module()
        programs[kind] = fold_constant_dequant(module) if fold_constants else module
    encodings = json.loads((path / "encodings.json").read_text(encoding="utf-8"))
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
