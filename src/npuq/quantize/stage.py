"""The ``npuq quantize`` workflow as one typed function: model → calibration tokens → artifact."""

from __future__ import annotations

import time
from typing import Any

from npuq.data.corpora import corpus_tokens
from npuq.errors import NpuqError
from npuq.optimize.recovery import optimize_for_recipe, resolve_recovery


def plan_phase(calibration_mode: str) -> str:
    """The thread-plan phase a calibration mode runs: whole contexts, or AR-1 decode steps."""
    return "calibrate" if calibration_mode == "onepass" else "decode"


def calibration_thread_plan(model: Any, calibration_mode: str, context: int, num_threads: int,
                            device: Any = None) -> Any:
    """The ThreadPlan for calibration: ``num_threads`` if positive, else measured (or cached)
    on the float workload of the phase (npuq.threads, docs/design.md §4); on a GPU ``device``
    nothing is measured (:meth:`ThreadPlan.untuned`)."""
    from npuq.device import is_cpu
    from npuq.threads import ThreadPlan, plan_threads
    from npuq.runtime.workloads import phase_workload

    phase = plan_phase(calibration_mode)
    if not is_cpu(device):
        return ThreadPlan.untuned((phase,), num_threads)
    plan, _ = plan_threads({phase: phase_workload(model, phase, context)}, num_threads)
    return plan


def quantize_to_artifact(
    model: str,
    out: str,
    *,
    scheme: str | None = None,
    recipe: str | None = None,
    corpus: str = "builtin",
    calib_tokens: int = 4096,
    context: int = 512,
    calibration_mode: str = "onepass",
    prefill_len: int | None = None,
    batch_size: int = 8,
    num_threads: int = 0,
    force: bool = False,
    progress: bool = True,
    seq_mse: int | None = None,
    seq_mse_granularity: str = "channel",
    weight_rounding: str = "nearest",
    device: str = "cpu",
    layer_inputs: str | None = None,
    act_order: bool | None = None,
) -> tuple[dict[str, Any], str]:
    """Quantize ``model`` and write the artifact; returns (JSON result, recipe summary).

    ``seq_mse`` N searches N candidate weight scales per layer (npuq.optimize.seqmse);
    ``weight_rounding`` "gptq" rounds with error compensation instead of to nearest;
    ``layer_inputs`` "quantized" fits both to the partly quantized model's own layer inputs;
    ``act_order`` makes GPTQ round the columns of largest input energy first (None for either:
    the defaults of :func:`resolve_recovery`).
    ``device`` (auto, cpu, cuda, cuda:N; :func:`npuq.device.resolve_device`) runs the Gram
    collection, the search and the calibration forwards; the artifact holds CPU tensors.
    """
    from npuq.device import resolve_device
    from npuq.models import load_model
    from npuq.quantize.artifact import check_destination, save_artifact, weights_sha256
    from npuq.quantize.pt2e import CALIBRATION_MODES, quantize_model
    from npuq.quant.recipe import load_recipe

    start = time.perf_counter()
    target = resolve_device(device)  # before any work: a missing GPU is a one-line error
    if calibration_mode not in CALIBRATION_MODES:
        raise NpuqError(f"unknown --calibration-mode {calibration_mode!r}; choose one of {', '.join(CALIBRATION_MODES)}")
    check_destination(out, force)  # cheap checks first: the model takes seconds to load
    resolve_recovery(seq_mse, weight_rounding, layer_inputs, act_order)
    chosen = load_recipe(recipe, scheme, model)
    if calib_tokens < context:
        raise NpuqError(f"--calib-tokens {calib_tokens} is less than one window of --context {context}: raise it or lower the context")
    if prefill_len is not None and not 1 <= prefill_len < context:
        raise NpuqError(f"--prefill-len {prefill_len} must be at least 1 and below --context {context}")
    from npuq.data.corpora import load_corpus, replaced_characters

    documents = load_corpus(corpus, "calib")  # an empty or missing corpus fails before the model loads
    loaded = load_model(model, max_context=context if context > 4096 else None)
    if context > loaded.config.max_position_embeddings:
        raise NpuqError(f"--context {context} exceeds the model's limit of {loaded.config.max_position_embeddings}")
    tokens = corpus_tokens(loaded.tokenizer, documents, calib_tokens)
    plan = calibration_thread_plan(loaded.model, calibration_mode, context, num_threads, target)
    weight_scales, optimized = None, None
    if seq_mse is not None or weight_rounding != "nearest":
        from npuq.calibrate.split import split_windows

        with plan.scope(plan_phase(calibration_mode)):
            weight_scales, optimized = optimize_for_recipe(
                loaded.model, chosen, split_windows(tokens, context), seq_mse=seq_mse,
                granularity=seq_mse_granularity, rounding=weight_rounding, progress=progress, device=target,
                inputs=layer_inputs, act_order=act_order,
            )
    qm = quantize_model(
        loaded.model, chosen, tokens, context=context, mode=calibration_mode, prefill_len=prefill_len,
        batch_size=batch_size, num_threads=plan.threads[plan_phase(calibration_mode)], progress=progress,
        weight_scales=weight_scales, device=target,
    )
    extra = {
        "model": {"name": model, "source": loaded.source, "weights_sha256": weights_sha256(loaded.model)},
        "calibration": {"corpus": corpus, "split": "calib", "tokens_requested": calib_tokens,
                        "tokens": qm.stats["calibration_tokens"], "mode": calibration_mode,
                        "batch_size": batch_size, "batch_size_used": qm.stats["batch_size"],
                        "replacement_characters": replaced_characters(documents),
                        "num_threads": num_threads, "thread_plan": plan.to_dict(),
                        "device": str(target)},
        "optimize": optimized,
    }
    path = save_artifact(qm, out, force=force, extra_config=extra)
    result = {
        key: qm.stats[key]
        for key in ("scheme", "calibration_mode", "calibration_tokens", "calibration_seconds", "prepare_seconds",
                    "convert_seconds")
    }
    result.update(total_seconds=time.perf_counter() - start, threads=qm.stats["threads"], thread_plan=plan.to_dict(),
                  artifact=str(path), device=str(target),
                  recipe=chosen.name, context=context, prefill_len=qm.prefill_len,
                  batch_size=qm.stats["batch_size"], replacement_characters=extra["calibration"]["replacement_characters"])
    if optimized is not None:
        result.update(seq_mse=optimized["seq_mse"], weight_rounding=optimized["weight_rounding"],
                      layer_inputs=optimized["layer_inputs"])
    return result, qm.plan.summary() if qm.plan is not None else ""
