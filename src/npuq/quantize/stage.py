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

from npuq.calibrate.split import split_windows
from npuq.data.corpora import (CALIB_CORPUS, CALIB_DRAW, CALIB_SAMPLINGS, calibration_draw, corpus_tokens, load_corpus,
                               replaced_characters)
from npuq.device import is_cpu
from npuq.errors import NpuqError
from npuq.fsio import folder_lock
from npuq.models import layer_bytes, load_model, model_config, open_streamed
from npuq.models.stream import StreamedDecoder
from npuq.optimize.budget import BudgetReport, budget_recipe, check_budget_base
from npuq.optimize.driver import RecoveryOptions
from npuq.optimize.gptq import GptqOptions
from npuq.optimize.recovery import PartRecovery, RoundingSummary, SeqMseSummary
from npuq.optimize.rotate import rotate_model, rotate_streamed
from npuq.partition import fewest_runs
from npuq.quant.recipe import ROTATE_CHOICES, load_recipe
from npuq.quant.size import WeightSize, model_weights, recipe_size
from npuq.quantize.artifact import ArtifactExtra, ModelInfo, check_destination, start_weights_sha256, writing_artifact
from npuq.quantize.pt2e import CALIBRATION_MODES, default_prefill_len, even_parts, quantize_model
from npuq.records import optional_key
from npuq.resources import USABLE_FRACTION, available_memory
from npuq.runtime.context import ExecutionContext

MIN_BITS_PER_WEIGHT = 4  # --bits-per-weight: every weight at 4 bits
ROTATION_SEED = 0  # the random signs of the Hadamard matrices: fixed, so a rerun quantizes alike


@dataclass(frozen=True)
class QuantizeOptions:
    """Everything that decides the artifact; each field is the ``npuq quantize`` flag of the same
    name. Defaults that depend on other fields are filled in on construction (prefill length,
    layer inputs, act-order, GPTQ's damping, the calibration draw where it does not depend on the
    model), so two records that quantize alike are equal and hash alike."""

    model: str = "smollm2-135m"
    scheme: str | None = None  # replaces the recipe's default scheme
    recipe: str | None = None  # built-in name or JSON file; None: the model's default
    calib_corpus: str = CALIB_CORPUS
    # None: calibration_draw's; filled in on construction without SeqMSE/GPTQ (4096), by the stage
    # with them, from the model's widest layer input (:meth:`calibration`)
    calib_tokens: int | None = None
    # tokens of the calib split skipped before the calibration text (of each part of a mix): another
    # draw of the same corpus; None (no key, so earlier records keep their keys): 0
    calib_offset: int | None = optional_key()
    # CALIB_SAMPLINGS: one stretch of the split, or windows spread over all of it (corpus_tokens);
    # None: calibration_draw's, as calib_tokens; "contiguous" without SeqMSE/GPTQ is stored as None
    # (no key), so the records of runs without recovery keep the keys they had
    calib_sampling: str | None = optional_key()
    context: int = 512
    calibration_mode: str = "onepass"
    prefill_len: int | None = None  # None: default_prefill_len(context)
    batch_size: int = 8  # windows per one-pass calibration forward
    seq_mse: int | None = None  # candidate scales per weight; None: min/max scales
    seq_mse_granularity: str = "channel"
    weight_rounding: str = "nearest"
    layer_inputs: str | None = None  # None: "quantized" when recovery is on (RecoveryOptions)
    act_order: bool | None = None  # None: on with GPTQ
    gptq_damp: float | None = optional_key()  # GPTQ's damping; None: GptqOptions' with GPTQ (no key without GPTQ)
    gptq_damp_down: float | None = optional_key()  # the same for the MLP down projections
    rotate: str | None = None  # ROTATE_CHOICES; None: the recipe's (built-in 4-bit recipes: r1). Read only
    # by load_recipe, which settles the rotation into the recipe (Recipe.rotation): nothing reads both
    parts: int | None = optional_key()  # quantize in this many parts, streamed; None: auto_parts
    # mean weight bits to choose each layer's format for (npuq.optimize.budget); None (no key,
    # so the records of runs without it keep their keys): the recipe's formats
    bits_per_weight: float | None = optional_key()

    def __post_init__(self) -> None:
        if self.bits_per_weight is not None and not MIN_BITS_PER_WEIGHT <= self.bits_per_weight <= 64:
            raise NpuqError(f"--bits-per-weight {self.bits_per_weight:g} is outside {MIN_BITS_PER_WEIGHT}..64: the "
                            f"smallest weight format takes {MIN_BITS_PER_WEIGHT} bits")
        if self.rotate is not None and self.rotate not in ROTATE_CHOICES:
            raise NpuqError(f"unknown --rotate {self.rotate!r}; choose one of {', '.join(ROTATE_CHOICES)}")
        if self.calibration_mode not in CALIBRATION_MODES:
            raise NpuqError(f"unknown --calibration-mode {self.calibration_mode!r}; choose one of "
                            f"{', '.join(CALIBRATION_MODES)}")
        if self.context < 2:
            raise NpuqError(f"--context {self.context} is too small: a window needs at least 2 tokens")
        if self.calib_offset is not None and self.calib_offset < 0:
            raise NpuqError(f"--calib-offset {self.calib_offset} must be 0 or more (tokens of the calib split to skip)")
        if self.calib_offset == 0:  # the default, so the two records are equal
            object.__setattr__(self, "calib_offset", None)
        if self.calib_sampling is not None and self.calib_sampling not in CALIB_SAMPLINGS:
            raise NpuqError(f"unknown --calib-sampling {self.calib_sampling!r}; choose one of "
                            f"{', '.join(CALIB_SAMPLINGS)}")
        if self.parts is not None and self.parts < 1:
            raise NpuqError(f"--parts {self.parts} must be at least 1")
        if self.batch_size < 1:
            raise NpuqError(f"--batch-size {self.batch_size} must be at least 1")
        prefill_len = default_prefill_len(self.context) if self.prefill_len is None else self.prefill_len
        if not 1 <= prefill_len < self.context:
            raise NpuqError(f"--prefill-len {prefill_len} must be at least 1 and below --context {self.context}")
        object.__setattr__(self, "prefill_len", prefill_len)
        if self.act_order and self.weight_rounding != "gptq":
            raise NpuqError("--act-order orders GPTQ's rounding and does nothing with nearest rounding: "
                            "add --weight-rounding gptq, or drop --act-order")
        for flag, damp in (("--gptq-damp", self.gptq_damp), ("--gptq-damp-down", self.gptq_damp_down)):
            if damp is not None and not 0 < damp < float("inf"):
                raise NpuqError(f"{flag} {damp:g} must be a positive number (a fraction of the mean input energy "
                                "added to the Gram matrix's diagonal; 0.01 to 3 are usual)")
            if damp is not None and self.weight_rounding != "gptq":
                raise NpuqError(f"{flag} damps GPTQ's Hessian and does nothing with nearest rounding: "
                                f"add --weight-rounding gptq, or drop {flag}")
        if self.weight_rounding == "gptq":  # GPTQ's own defaults for what was not given
            default = GptqOptions()
            object.__setattr__(self, "act_order", default.act_order if self.act_order is None else self.act_order)
            object.__setattr__(self, "gptq_damp", default.damp if self.gptq_damp is None else self.gptq_damp)
            object.__setattr__(self, "gptq_damp_down",
                               default.damp_down if self.gptq_damp_down is None else self.gptq_damp_down)
        recovery = RecoveryOptions(self.seq_mse, self.seq_mse_granularity, self.weight_rounding, self.layer_inputs,
                                   self._gptq)  # its checks, and its defaults filled in
        # the resolved choices, so two records that quantize alike are equal; none without SeqMSE or GPTQ
        object.__setattr__(self, "layer_inputs", recovery.layer_inputs if recovery.recovers else None)
        if self.weight_rounding != "gptq":  # act-order orders GPTQ only: off with SeqMSE alone
            object.__setattr__(self, "act_order", False if recovery.recovers else None)
        if not recovery.recovers:  # the draw does not depend on the model: filled in now
            tokens, sampling = self.calibration(None)
            object.__setattr__(self, "calib_tokens", tokens)
            object.__setattr__(self, "calib_sampling", None if sampling == CALIB_DRAW[1] else sampling)
        elif self.calib_tokens is not None:
            self.calibration(None)  # its check, before any work

    @property
    def _gptq(self) -> GptqOptions | None:
        if self.weight_rounding != "gptq":
            return None
        return GptqOptions(act_order=self.act_order, damp=self.gptq_damp, damp_down=self.gptq_damp_down)

    @property
    def recovery(self) -> RecoveryOptions | None:
        """The SeqMSE/GPTQ options as the driver takes them; None when neither is on."""
        if not (self.seq_mse is not None or self.weight_rounding != "nearest"):
            return None
        return RecoveryOptions(self.seq_mse, self.seq_mse_granularity, self.weight_rounding, self.layer_inputs,
                               self._gptq)

    def calibration(self, widest_input: int | None) -> tuple[int, str]:
        """(tokens, sampling) of the calibration text (calibration_draw): ``widest_input`` is the
        model's widest linear-layer input, which decides the draw where SeqMSE/GPTQ run."""
        if self.recovery is None:
            widest_input = None
        tokens, sampling = calibration_draw(widest_input, self.calib_tokens, self.calib_sampling)
        if tokens < self.context:
            raise NpuqError(f"--calib-tokens {tokens} is less than one window of --context {self.context}: "
                            "raise it or lower the context")
        return tokens, sampling

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
    seq_mse: SeqMseSummary | None = None  # None: neither SeqMSE nor GPTQ ran
    weight_rounding: RoundingSummary | None = None
    layer_inputs: str | None = None
    # SeqMSE/GPTQ's walk: the calibration windows through the blocks and the layers' input Grams
    gram_seconds: float | None = None
    export_seconds: float | None = None  # the part of prepare_seconds that traced the model graph
    save_seconds: float | None = None  # writing the artifact folder
    rotation: dict[str, Any] | None = None  # npuq.optimize.rotate.RotationReport; None: not rotated
    parts: int = 1  # parts the model was quantized in, one after another
    streamed: bool = False  # the weights were read from disk one part at a time, never the whole model
    bits_per_weight: float | None = None  # mean code bits per weight parameter (npuq.quant.size); None: not measured
    weight_bytes: int | None = None  # packed weight codes plus their scales
    budget: BudgetReport | None = None  # what --bits-per-weight chose; None: not given

    def describe(self) -> str:
        rotated = f", rotated {'+'.join(r for r in ('r1', 'r2') if self.rotation[r])}" if self.rotation else ""
        if self.parts > 1:
            rotated += f", in {self.parts} parts{' streamed' if self.streamed else ''}"
        if self.bits_per_weight is not None:
            rotated += f", {self.bits_per_weight:.3f} bits per weight"
        return (f"{self.artifact}: {self.scheme} ({self.recipe}{rotated}), {self.calibration_mode} calibration on "
                f"{self.calibration_tokens} tokens in {self.calibration_seconds:.1f} s (prepare "
                f"{self.prepare_seconds:.1f} s, convert {self.convert_seconds:.1f} s, total {self.total_seconds:.1f} s, "
                f"{self.threads} threads, {self.device})")


def check_quantize(options: QuantizeOptions) -> Any:
    """What can be checked without the model, beyond the record's own checks: the recipe (a
    file is read) and the calibration corpus. Returns (recipe, calibration documents); the
    recipe holds the rotation decided from the recipe's own and ``--rotate``."""
    recipe = load_recipe(options.recipe, options.scheme, options.rotate)
    if options.bits_per_weight is not None:
        check_budget_base(recipe)
    return recipe, load_corpus(options.calib_corpus, "calib")  # an empty or missing corpus fails here


PART_BYTES = 1 << 30  # the most one part's float32 weights take by default (a Qwen2.5-7B block: 0.93 GB)
WHOLE_FACTOR = 2.5  # peak memory of quantizing the whole model / its float32 weights (measured below)


def auto_parts(cfg: Any, available: int | None = None, *, whole: bool = False) -> tuple[tuple[int, int], ...]:
    """The (first, end) layers of each part ``npuq quantize`` takes without ``--parts``, for a
    model of config ``cfg`` given ``available`` bytes of memory (default: what this process may
    use now); docs/design.md §13.

    One part, the whole model loaded (the flow and the artifact of a model of one part), where
    its float32 weights take at most PART_BYTES and WHOLE_FACTOR times them fit the usable
    memory (Qwen2.5-Coder-0.5B, 2.5 GB of float32 weights as npuq holds them, peaked at 4.7 GB
    quantizing 16a8w whole), or where ``whole`` (the run needs the whole model: sequential
    calibration, SeqMSE/GPTQ on a GPU) and it fits. Otherwise parts, streamed: the fewest runs
    of layers whose float32 weights take at most PART_BYTES each (a quarter of the usable memory
    where that is less), the embedding table counted with the first part and the final norm
    and head with the last, as even as that count allows; a part holding a table larger than
    the limit less one layer is that table and one layer. A part's peak is its float32 weights
    and their integer codes (at most as large) over what the process holds anyway, so the run's
    peak stays near one part's, whatever the model's size or the memory to spare: the layout
    depends on the model alone wherever the memory allows PART_BYTES parts."""
    usable = USABLE_FRACTION * (available_memory() if available is None else available)
    sizes = layer_bytes(cfg)
    weights = sum(sizes)
    if WHOLE_FACTOR * weights <= usable and (weights <= PART_BYTES or whole):
        return ((0, cfg.num_layers),)
    return fewest_runs(sizes, int(min(PART_BYTES, usable / 4)))


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
    start = time.perf_counter()
    check_destination(out, force)  # cheap checks first: the model takes seconds to load
    recipe, documents = check_quantize(o)
    max_context = o.context if o.context > 4096 else None
    cfg = model_config(o.model, max_context)
    calib_tokens, sampling = o.calibration(cfg.widest_linear_input)  # its checks, before any work
    # Sequential calibration runs the whole model token by token; SeqMSE/GPTQ on a GPU visit it
    # whole where it fits (in parts they run on the CPU, as streaming does).
    needs_whole = o.calibration_mode != "onepass" or (o.recovery is not None and not is_cpu(ctx.device))
    layout = None if o.parts else auto_parts(cfg, whole=needs_whole)
    parts = o.parts or len(layout)
    if parts > 1 and o.calibration_mode != "onepass":
        why = "" if o.parts else f"it does not fit this machine's memory whole, so it is quantized in {parts} parts, and "
        raise NpuqError(f"{o.model}: {why}a model quantized in parts takes one-pass calibration for now: use "
                        "--calibration-mode onepass")
    if parts > cfg.num_layers:
        raise NpuqError(f"--parts {parts}: the model has {cfg.num_layers} layers, so at most {cfg.num_layers} parts")
    layout = layout or even_parts(cfg.num_layers, parts)
    loaded = (open_streamed if parts > 1 else load_model)(o.model, max_context=max_context)
    if o.context > loaded.config.max_position_embeddings:
        raise NpuqError(f"--context {o.context} exceeds the model's limit of {loaded.config.max_position_embeddings}")
    tokens = corpus_tokens(loaded.encoder, documents, calib_tokens, offset=o.calib_offset or 0,
                           spread=o.context if sampling == "spread" else None)
    if len(tokens) < 2:
        raise NpuqError(f"--calib-offset {o.calib_offset} skips the whole calib split of {o.calib_corpus!r} (its "
                        "text ends first): give a smaller offset, or a longer corpus")
    streamed = isinstance(loaded.model, StreamedDecoder)
    # Timing thread counts runs the model; streamed, each run would read every weight from disk.
    # Before the weights hash starts: its thread would share the CPUs being timed.
    plan = ctx.plan_model(None if streamed else loaded.model, (o.phase,), o.context)
    weights_sha256 = start_weights_sha256(loaded.model)  # of the float weights as loaded
    if streamed:
        # Before the first part, not beside it: the hash widens each tensor to float32 in turn,
        # and a 7B's embedding table (2.2 GB) next to the first part's took the peak to 9 GiB.
        weights_sha256()
    rotation = None
    folded = recipe.rotation
    if folded is not None:  # before everything that reads the weights: the artifact holds rotated ones
        if streamed:  # each part is rotated as it is read: the hash reads the checkpoint as it is
            rotation = rotate_streamed(loaded.model, seed=ROTATION_SEED, r1=folded.r1, r2=folded.r2)
        else:
            weights_sha256()  # the rotation writes the weights in place: the hash first
            rotation = rotate_model(loaded.model, seed=ROTATION_SEED, r1=folded.r1, r2=folded.r2)
        if ctx.progress:
            print(rotation.describe(), file=sys.stderr, flush=True)
    budget = None
    if o.bits_per_weight is not None:  # the formats, measured on the weights as calibrated (rotated)
        with ctx.scope(o.phase):
            recipe, budget = budget_recipe(loaded.model, recipe, split_windows(tokens, o.context).rows(),
                                           o.bits_per_weight, progress=ctx.progress, parts=layout)
    recovery = None
    if o.recovery is not None:  # SeqMSE/GPTQ on each part as quantize_model reads it
        weights_sha256()  # the recovery writes its rounded weights in place: the hash first
        recovery = PartRecovery(loaded.model.skeleton if streamed else loaded.model, recipe,
                                split_windows(tokens, o.context), o.recovery, progress=ctx.progress,
                                device=None if streamed else ctx.device)
    with writing_artifact(out, parts, force=force) as writer:
        qm = quantize_model(
            loaded.model, recipe, tokens, context=o.context, mode=o.calibration_mode, prefill_len=o.prefill_len,
            batch_size=o.batch_size, num_threads=ctx.threads(o.phase), progress=ctx.progress,
            device=ctx.device, parts=layout, store=writer.store, recover=recovery,
        )
        optimized = recovery.summary() if recovery is not None else None
        saving = time.perf_counter()
        replaced = replaced_characters(documents)
        calibration = {"corpus": o.calib_corpus, "split": "calib", "tokens_requested": calib_tokens,
                       "offset": o.calib_offset or 0, "sampling": sampling,
                       "tokens": qm.stats["calibration_tokens"], "mode": o.calibration_mode,
                       "batch_size": o.batch_size, "batch_size_used": qm.stats["batch_size"],
                       "replacement_characters": replaced,
                       "num_threads": ctx.requested, "thread_plan": plan.to_dict(),
                       "device": str(ctx.device)}
        rotation_json = None if rotation is None else dataclasses.asdict(rotation)
        model = ModelInfo(o.model, loaded.source, weights_sha256())
        size = recipe_size(qm.recipe, model_weights(loaded.model.skeleton if streamed else loaded.model))
        writer.finish(qm, model=model, calibration=calibration, optimize=optimized, rotation=rotation_json,
                      extra=ArtifactExtra(size, budget, recipe if budget else None))
    saved = time.perf_counter() - saving  # the parts' programs were written as they were made (convert_seconds)
    path = Path(out)
    s = qm.stats
    return QuantizeResult(
        artifact=str(path), scheme=s["scheme"], recipe=recipe.name,
        recipe_summary=size_summary(qm.plan.summary() if qm.plan is not None else "", size, budget),
        calibration_mode=s["calibration_mode"], calibration_tokens=s["calibration_tokens"],
        calibration_seconds=s["calibration_seconds"], prepare_seconds=s["prepare_seconds"],
        convert_seconds=s["convert_seconds"], total_seconds=time.perf_counter() - start, threads=s["threads"],
        thread_plan=plan.to_dict(), device=str(ctx.device), context=o.context, prefill_len=qm.prefill_len,
        batch_size=s["batch_size"], replacement_characters=replaced,
        seq_mse=optimized.seq_mse if optimized is not None else None,
        weight_rounding=optimized.weight_rounding if optimized is not None else None,
        layer_inputs=optimized.layer_inputs if optimized is not None else None,
        gram_seconds=optimized.gram_seconds if optimized is not None else None,
        export_seconds=s.get("export_seconds"), save_seconds=saved, rotation=rotation_json,
        parts=parts, streamed=streamed,
        bits_per_weight=size.bits_per_weight, weight_bytes=size.weight_bytes, budget=budget,
    )


def size_summary(summary: str, size: WeightSize, budget: BudgetReport | None) -> str:
    """The recipe summary with the weights' size (and the budget's choice) below it."""
    lines = [summary] if summary else []
    lines.append(f"weights: {size.describe()}")
    if budget is not None:
        lines.append(f"{budget.describe()}; the recipe: {budget.recipe_file} in the artifact (--recipe takes it)")
    return "\n".join(lines)
