"""The ``npuq quantize`` workflow as one typed function: model → calibration tokens → artifact."""

from __future__ import annotations

import time
from typing import Any

from npuq.errors import NpuqError


def corpus_tokens(tokenizer: Any, corpus: Any, n_tokens: int, split: str = "calib") -> list[int]:
    """The first ``n_tokens`` tokens of the corpus's ``split`` (``corpus``: a spec, or documents
    already loaded): each document prefixed with BOS (else EOS), documents concatenated in id order."""
    from npuq.data import load_corpus

    prefix = getattr(tokenizer, "bos_token_id", None)
    if prefix is None:
        prefix = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for doc in load_corpus(corpus, split) if isinstance(corpus, str) else corpus:
        if len(ids) >= n_tokens:
            break
        body = list(tokenizer.encode(doc.target, add_special_tokens=False))
        ids += ([prefix] if prefix is not None else []) + body
    return ids[:n_tokens]


def plan_phase(calibration_mode: str) -> str:
    """The thread-plan phase a calibration mode runs: whole contexts, or AR-1 decode steps."""
    return "calibrate" if calibration_mode == "onepass" else "decode"


def calibration_thread_plan(model: Any, calibration_mode: str, context: int, num_threads: int,
                            device: Any = None) -> Any:
    """The ThreadPlan for calibration: ``num_threads`` if positive, else measured (or cached)
    on the float workload of the phase (npuq.threads, REFERENCE.md §4); on a GPU ``device``
    nothing is measured (:meth:`ThreadPlan.untuned`)."""
    from npuq.device import is_cpu
    from npuq.threads import ThreadPlan, plan_threads
    from npuq.threads.workloads import phase_workload

    phase = plan_phase(calibration_mode)
    if not is_cpu(device):
        return ThreadPlan.untuned((phase,), num_threads)
    plan, _ = plan_threads({phase: phase_workload(model, phase, context)}, num_threads)
    return plan


def resolve_recovery(
    seq_mse: int | None, weight_rounding: str, layer_inputs: str | None, act_order: bool | None
) -> tuple[str, bool]:
    """Check that the accuracy-recovery options make sense together (before any model loads)
    and fill in the defaults; returns (layer inputs, act-order).

    Unless set, SeqMSE and GPTQ fit each layer to the quantized model's own inputs and GPTQ
    uses act-order: on SmolLM2-135M at 4 bits the two together cut GPTQ's perplexity loss by
    a third or more (bench/accuracy.py, README), for ~10 s more collection and nothing at run
    time (the scales are fixed beforehand, so the column order leaves the format unchanged).
    """
    from npuq.optimize.driver import INPUTS, ROUNDINGS

    if seq_mse is not None and seq_mse < 1:
        raise NpuqError(f"--seq-mse {seq_mse}: the number of candidate scales must be at least 1 (the published default is 50)")
    if weight_rounding not in ROUNDINGS:
        raise NpuqError(f"--weight-rounding {weight_rounding!r}: choose one of {', '.join(ROUNDINGS)}")
    if layer_inputs is not None and layer_inputs not in INPUTS:
        raise NpuqError(f"--layer-inputs {layer_inputs!r}: choose one of {', '.join(INPUTS)}")
    if act_order is True and weight_rounding != "gptq":
        raise NpuqError("--act-order orders GPTQ's rounding and does nothing with nearest rounding: "
                        "add --weight-rounding gptq, or drop --act-order")
    if layer_inputs is not None and seq_mse is None and weight_rounding == "nearest":
        raise NpuqError(f"--layer-inputs {layer_inputs} chooses what SeqMSE and GPTQ fit to, and neither is on: "
                        "add --seq-mse N and/or --weight-rounding gptq, or drop --layer-inputs")
    return layer_inputs or "quantized", weight_rounding == "gptq" if act_order is None else act_order


def linear_weight_specs(model: Any, recipe: Any) -> dict[str, Any]:
    """WeightSpec of every linear layer under ``recipe`` whose weights the driver can optimise
    (at most its MAX_BITS): module path → bits, block size; LPBQ layers of 16a4w_block keep the
    backend's block-scale rule (npuq.optimize.driver)."""
    import torch

    from npuq.optimize.driver import MAX_BITS, WeightSpec
    from npuq.quant.schemes import PerBlock

    specs = {}
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        scheme = recipe.resolve(path, "linear")[0]
        if scheme.weight.bits > MAX_BITS:
            continue
        g = scheme.weight.granularity
        if isinstance(g, PerBlock):
            specs[path] = WeightSpec(bits=scheme.weight.bits, block_size=g.size, scale_bits=g.scale_bits,
                                     eps=scheme.weight.eps)
        else:
            specs[path] = WeightSpec(bits=scheme.weight.bits)
    return specs


def optimize_for_recipe(
    model: Any, recipe: Any, windows: Any, *, seq_mse: int | None, granularity: str, rounding: str, progress: bool,
    device: Any = None, inputs: str | None = None, act_order: bool | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """SeqMSE and/or GPTQ on every linear layer of the float ``model`` (weights rewritten in
    place on the chosen grid). Returns (module path → (O,) scales, or (O, blocks) for LPBQ, to
    pin; JSON summary).
    ``inputs``: "float" fits each layer to the float model's inputs, "quantized" to those of
    the model with every earlier layer already rounded (npuq.optimize.driver). ``act_order``:
    GPTQ rounds the columns in order of decreasing input energy. None: the defaults of
    :func:`resolve_recovery`.

    On a GPU ``device`` the model visits it for the Gram collection and the search and comes
    back to the CPU (where it is exported) with its rewritten weights."""
    from npuq.device import is_cpu
    from npuq.optimize.driver import MAX_BITS, optimize_weights

    inputs, act_order = resolve_recovery(seq_mse, rounding, inputs, act_order)
    specs = linear_weight_specs(model, recipe)
    if not specs:
        raise NpuqError(f"SeqMSE and GPTQ do not apply to recipe {recipe.name!r}: every linear layer has "
                        f"weights wider than {MAX_BITS} bits, whose rounding error is already negligible; drop "
                        "--seq-mse / --weight-rounding gptq, or choose a scheme with 8- or 4-bit weights")
    rows = [row.unsqueeze(0) for row in windows.rows()]
    options = {"seq_mse": seq_mse, "granularity": granularity, "rounding": rounding, "progress": progress,
               "inputs": inputs, "gptq_options": {"act_order": act_order}}
    if is_cpu(device):
        results, timings = optimize_weights(model, rows, specs, **options)
    else:
        try:
            results, timings = optimize_weights(model.to(device), rows, specs, **options)
        finally:
            model.to("cpu")
    before = sum(r.loss_minmax for r in results.values())
    after = sum(r.loss for r in results.values())
    summary = {
        "seq_mse": {"candidates": seq_mse, "granularity": granularity if seq_mse else None,
                    "seconds": timings["seq_mse_seconds"]},
        "weight_rounding": {"method": rounding, "seconds": timings["rounding_seconds"],
                            "act_order": act_order if rounding == "gptq" else None},
        "gram_seconds": timings["collect_seconds"],
        "layer_inputs": inputs,
        "layers": len(results),
        "output_error_reduction": 1 - after / before if before > 0 else 0.0,
    }
    return {name: r.scale for name, r in results.items()}, summary


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
    from npuq.quant.artifact import check_destination, save_artifact, weights_sha256
    from npuq.quant.pipeline import CALIBRATION_MODES, quantize_model
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
        from npuq.calibrate.windows import split_windows

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
