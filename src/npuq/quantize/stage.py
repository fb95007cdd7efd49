"""The quantize stage: one options record in, the artifact folder and one result record out.

``npuq quantize`` and ``npuq run`` build the same :class:`QuantizeOptions`; it is checked once,
on construction, before any model loads, and ``npuq run`` keys its quantize stage on the
whole record.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npuq.data.corpora import corpus_tokens
from npuq.errors import NpuqError
from npuq.fsio import folder_lock
from npuq.optimize.driver import RecoveryOptions
from npuq.optimize.gptq import GptqOptions
from npuq.optimize.recovery import optimize_for_recipe
from npuq.quant.recipe import ROTATE_CHOICES, ROTATIONS
from npuq.quantize.pt2e import CALIBRATION_MODES, default_prefill_len, quantize_model
from npuq.runtime.context import ExecutionContext

ROTATION_SEED = 0  # the random signs of the Hadamard matrices: fixed, so a rerun quantizes alike


@dataclass(frozen=True)
class QuantizeOptions:
    """Everything that decides the artifact; each field is the ``npuq quantize`` flag of the same
    name. Defaults that depend on other fields are filled in on construction (prefill length,
    layer inputs, act-order), so two records that quantize alike are equal and hash alike."""

    model: str = "smollm2-135m"
    scheme: str | None = None  # replaces the recipe's default scheme
    recipe: str | None = None  # built-in name or JSON file; None: the model's default
    calib_corpus: str = "builtin"
    calib_tokens: int = 4096
    context: int = 512
    calibration_mode: str = "onepass"
    prefill_len: int | None = None  # None: default_prefill_len(context)
    batch_size: int = 8  # windows per one-pass calibration forward
    seq_mse: int | None = None  # candidate scales per weight; None: min/max scales
    seq_mse_granularity: str = "channel"
    weight_rounding: str = "nearest"
    layer_inputs: str | None = None  # None: "quantized" when recovery is on (RecoveryOptions)
    act_order: bool | None = None  # None: on with GPTQ
    rotate: str | None = None  # ROTATE_CHOICES; None: the recipe's (built-in 4-bit recipes: r1)

    def __post_init__(self) -> None:
        if self.rotate is not None and self.rotate not in ROTATE_CHOICES:
            raise NpuqError(f"unknown --rotate {self.rotate!r}; choose one of {', '.join(ROTATE_CHOICES)}")
        if self.calibration_mode not in CALIBRATION_MODES:
            raise NpuqError(f"unknown --calibration-mode {self.calibration_mode!r}; choose one of "
                            f"{', '.join(CALIBRATION_MODES)}")
        if self.context < 2:
            raise NpuqError(f"--context {self.context} is too small: a window needs at least 2 tokens")
        if self.calib_tokens < self.context:
            raise NpuqError(f"--calib-tokens {self.calib_tokens} is less than one window of --context {self.context}: "
                            "raise it or lower the context")
        if self.batch_size < 1:
            raise NpuqError(f"--batch-size {self.batch_size} must be at least 1")
        prefill_len = default_prefill_len(self.context) if self.prefill_len is None else self.prefill_len
        if not 1 <= prefill_len < self.context:
            raise NpuqError(f"--prefill-len {prefill_len} must be at least 1 and below --context {self.context}")
        object.__setattr__(self, "prefill_len", prefill_len)
        if self.act_order and self.weight_rounding != "gptq":
            raise NpuqError("--act-order orders GPTQ's rounding and does nothing with nearest rounding: "
                            "add --weight-rounding gptq, or drop --act-order")
        gptq = None
        if self.weight_rounding == "gptq":
            gptq = GptqOptions() if self.act_order is None else GptqOptions(act_order=self.act_order)
        recovery = RecoveryOptions(self.seq_mse, self.seq_mse_granularity, self.weight_rounding, self.layer_inputs,
                                   gptq)  # its checks, and its defaults filled in
        # the resolved choices, so two records that quantize alike are equal; none without SeqMSE or GPTQ
        object.__setattr__(self, "layer_inputs", recovery.layer_inputs if recovery.recovers else None)
        object.__setattr__(self, "act_order", (recovery.gptq is not None and recovery.gptq.act_order)
                           if recovery.recovers else None)

    @property
    def recovery(self) -> RecoveryOptions | None:
        """The SeqMSE/GPTQ options as the driver takes them; None when neither is on."""
        if not (self.seq_mse is not None or self.weight_rounding != "nearest"):
            return None
        gptq = GptqOptions(act_order=self.act_order) if self.weight_rounding == "gptq" else None
        return RecoveryOptions(self.seq_mse, self.seq_mse_granularity, self.weight_rounding, self.layer_inputs, gptq)

    @property
    def phase(self) -> str:
        """The thread-plan phase calibration runs: whole contexts, or AR-1 decode steps."""
        return "calibrate" if self.calibration_mode == "onepass" else "decode"


@dataclass(frozen=True)
class QuantizeResult:
    artifact: str  # the folder written
    scheme: str
    recipe: str
    recipe_summary: str  # which rule and scheme each layer got
    calibration_mode: str
    calibration_tokens: int
    calibration_seconds: float
    prepare_seconds: float
    convert_seconds: float
    total_seconds: float
    threads: int  # during calibration
    thread_plan: dict[str, Any]
    device: str
    context: int
    prefill_len: int
    batch_size: int  # windows per forward actually used (the memory guard may lower it)
    replacement_characters: int  # non-UTF-8 byte sequences in the calibration text, read as U+FFFD
    seq_mse: dict[str, Any] | None = None
    weight_rounding: dict[str, Any] | None = None
    layer_inputs: str | None = None
    export_seconds: float | None = None  # the part of prepare_seconds that traced the model graph
    save_seconds: float | None = None  # writing the artifact folder
    rotation: dict[str, Any] | None = None  # npuq.optimize.rotate.RotationReport; None: not rotated

    def describe(self) -> str:
        rotated = f", rotated {'+'.join(r for r in ('r1', 'r2') if self.rotation[r])}" if self.rotation else ""
        return (f"{self.artifact}: {self.scheme} ({self.recipe}{rotated}), {self.calibration_mode} calibration on "
                f"{self.calibration_tokens} tokens in {self.calibration_seconds:.1f} s (prepare "
                f"{self.prepare_seconds:.1f} s, convert {self.convert_seconds:.1f} s, total {self.total_seconds:.1f} s, "
                f"{self.threads} threads, {self.device})")


def check_quantize(options: QuantizeOptions) -> Any:
    """What can be checked without the model, beyond the record's own checks: the recipe (a
    file is read) and the calibration corpus. Returns (recipe, calibration documents)."""
    from npuq.data.corpora import load_corpus
    from npuq.quant.recipe import load_recipe

    recipe = load_recipe(options.recipe, options.scheme)
    if options.rotate is not None:
        recipe = recipe.with_rotation(None if options.rotate == "none" else options.rotate)
    return recipe, load_corpus(options.calib_corpus, "calib")  # an empty or missing corpus fails here


def quantize_to_artifact(
    options: QuantizeOptions, out: str | Path, ctx: ExecutionContext | None = None, *, force: bool = False
) -> QuantizeResult:
    """Quantize ``options.model`` and write the artifact folder ``out``.

    ``ctx`` (default: the CPU, automatic threads) says where the Gram collection, the SeqMSE/GPTQ
    search and the calibration forwards run and at how many threads; the artifact always holds
    CPU tensors.
    """
    with folder_lock(out, "npuq quantize"):  # one writer per folder
        return _quantize(options, out, ctx or ExecutionContext.create("cpu"), force)


def _quantize(o: QuantizeOptions, out: str | Path, ctx: ExecutionContext, force: bool) -> QuantizeResult:
    from npuq.data.corpora import replaced_characters
    from npuq.models import load_model
    from npuq.quantize.artifact import ModelInfo, check_destination, save_artifact, start_weights_sha256

    start = time.perf_counter()
    check_destination(out, force)  # cheap checks first: the model takes seconds to load
    recipe, documents = check_quantize(o)
    loaded = load_model(o.model, max_context=o.context if o.context > 4096 else None)
    if o.context > loaded.config.max_position_embeddings:
        raise NpuqError(f"--context {o.context} exceeds the model's limit of {loaded.config.max_position_embeddings}")
    tokens = corpus_tokens(loaded.encoder, documents, o.calib_tokens)
    weights_sha256 = start_weights_sha256(loaded.model)  # of the float weights as loaded
    rotation = None
    if recipe.rotate is not None:  # before everything that reads the weights: the artifact holds rotated ones
        from npuq.optimize.rotate import rotate_model

        weights_sha256()  # the rotation writes the weights in place: the hash first

        r1, r2 = ROTATIONS[recipe.rotate]
        rotation = rotate_model(loaded.model, seed=ROTATION_SEED, r1=r1, r2=r2)
        if ctx.progress:
            print(rotation.describe(), file=sys.stderr, flush=True)
    plan = ctx.plan_model(loaded.model, (o.phase,), o.context)
    weight_scales, optimized = None, None
    if o.recovery is not None:
        from npuq.calibrate.split import split_windows

        weights_sha256()  # the recovery writes its rounded weights in place: the hash first

        with ctx.scope(o.phase):
            weight_scales, optimized = optimize_for_recipe(loaded.model, recipe, split_windows(tokens, o.context),
                                                           o.recovery, progress=ctx.progress, device=ctx.device)
    qm = quantize_model(
        loaded.model, recipe, tokens, context=o.context, mode=o.calibration_mode, prefill_len=o.prefill_len,
        batch_size=o.batch_size, num_threads=ctx.threads(o.phase), progress=ctx.progress,
        weight_scales=weight_scales, device=ctx.device,
    )
    replaced = replaced_characters(documents)
    calibration = {"corpus": o.calib_corpus, "split": "calib", "tokens_requested": o.calib_tokens,
                   "tokens": qm.stats["calibration_tokens"], "mode": o.calibration_mode,
                   "batch_size": o.batch_size, "batch_size_used": qm.stats["batch_size"],
                   "replacement_characters": replaced,
                   "num_threads": ctx.requested, "thread_plan": plan.to_dict(),
                   "device": str(ctx.device)}
    saving = time.perf_counter()
    rotation_json = None if rotation is None else dataclasses.asdict(rotation)
    model = ModelInfo(o.model, loaded.source, weights_sha256())
    path = save_artifact(qm, out, force=force, model=model, calibration=calibration, optimize=optimized,
                         rotation=rotation_json)
    saved = time.perf_counter() - saving
    s = qm.stats
    return QuantizeResult(
        artifact=str(path), scheme=s["scheme"], recipe=recipe.name,
        recipe_summary=qm.plan.summary() if qm.plan is not None else "",
        calibration_mode=s["calibration_mode"], calibration_tokens=s["calibration_tokens"],
        calibration_seconds=s["calibration_seconds"], prepare_seconds=s["prepare_seconds"],
        convert_seconds=s["convert_seconds"], total_seconds=time.perf_counter() - start, threads=s["threads"],
        thread_plan=plan.to_dict(), device=str(ctx.device), context=o.context, prefill_len=qm.prefill_len,
        batch_size=s["batch_size"], replacement_characters=replaced,
        seq_mse=optimized["seq_mse"] if optimized else None,
        weight_rounding=optimized["weight_rounding"] if optimized else None,
        layer_inputs=optimized["layer_inputs"] if optimized else None,
        export_seconds=s.get("export_seconds"), save_seconds=saved, rotation=rotation_json,
    )
