"""The report of ``npuq run``: report.json (data) and report.html (the same, for people).

Built only from the stage results, so a re-run that reuses every stage rebuilds the same
report without loading the model.
"""

from __future__ import annotations

import datetime
import re
from collections import Counter
from pathlib import Path
from typing import Any

from npuq import __version__
from npuq.eval.layers import worst
from npuq.optimize.budget import BudgetReport
from npuq.optimize.rotate import RotationReport
from npuq.quantize.artifact import read_artifact
from npuq.records import to_json
from npuq.runs import RunResults
from npuq.report.html import Figure, Section, Table, figure_png, render
from npuq.threads.plot import sweep_figure
from npuq.threads.tuner import TuneResult

WORST = 5


DIVERGENCE = ("kld_mean", "kld_p99", "top1_agreement")  # against the float model, on the same windows
EXPORT_FACTS = ("qnn_version", "qnn_version_source", "htp_arch", "soc", "embedding_pattern", "files")  # of ExportResult


def _ppl_rows(ppl: dict[str, dict[str, Any]]) -> list[list[Any]]:
    base = ppl["float"]["word_perplexity"]
    return [[name, r["word_perplexity"], r["word_perplexity"] / base, r["byte_perplexity"], r["bits_per_byte"],
             *(r.get(k) for k in DIVERGENCE), r["tokens"], r["seconds"]] for name, r in ppl.items()]


def _kind(path: str) -> str:
    """Projection kind of a linear layer path: "layers.3.mlp.down_proj" → "down_proj"."""
    return path.rsplit(".", 1)[-1]


def layers_figure(layers: list[dict[str, Any]], worst: list[dict[str, Any]]) -> bytes:
    # matplotlib (0.2-0.6 s) loads only to draw a figure
    import matplotlib

    matplotlib.use("Agg")
    # pyplot once the backend is chosen (Agg: no display needed)
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.6), sharex=True)
    x = list(range(len(layers)))
    kinds = sorted({_kind(r["path"]) for r in layers})
    colors = {k: plt.cm.tab10(i % 10) for i, k in enumerate(kinds)}
    for axis, key, label in ((top, "output_sqnr_db", "output SQNR (dB)"), (bottom, "weight_sqnr_db", "weight SQNR (dB)")):
        for kind in kinds:
            pts = [(i, r[key]) for i, r in zip(x, layers) if _kind(r["path"]) == kind and r[key] is not None]
            if pts:
                axis.scatter(*zip(*pts), s=12, color=colors[kind], label=kind)
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
    top.plot(x, [r["output_sqnr_db"] if r["output_sqnr_db"] is not None else float("nan") for r in layers],
             color="#999999", linewidth=0.7, zorder=0)
    index = {r["path"]: i for i, r in enumerate(layers)}
    for r in worst:
        i = index[r["path"]]
        bottom.annotate(r["path"], (i, r["weight_sqnr_db"]), xytext=(4, -10), textcoords="offset points", fontsize=7)
    top.set_title("quantization error per linear layer, in execution order (higher is better)")
    top.legend(fontsize=7, ncol=min(len(kinds), 8), loc="lower left")
    bottom.set_xlabel("linear layer (execution order)")
    fig.tight_layout()
    return figure_png(fig)


def recipe_rows(plan: list[dict[str, str]]) -> list[list[Any]]:
    """Layers grouped by (kind, rule, scheme), with a count and an example path each."""
    groups: Counter = Counter()
    example: dict[tuple[str, str, str], str] = {}
    for row in plan:
        key = (row["kind"], row["rule"], row["scheme"])
        groups[key] += 1
        example.setdefault(key, re.sub(r"\.\d+\.", ".N.", row["path"] or "(top)"))
    return [[k, rule, scheme, n, example[(k, rule, scheme)]] for (k, rule, scheme), n in groups.items()]


def build_report(run: RunResults) -> tuple[dict[str, Any], str]:
    """(report.json content, report.html text) of a finished run."""
    q, export, out = run.quantize, run.export, run.out
    artifact = read_artifact(out / "artifact")
    ppl = {"float": run.eval_float, "quantized": run.eval_quantized, "exported": run.eval_exported}
    layer_list = [e.to_dict() for e in run.layers.layers]
    worst_layers = [e.to_dict() for e in worst(run.layers.layers, WORST)]
    calibration = {
        "mode": q.calibration_mode, "tokens": q.calibration_tokens, "threads": q.threads,
        "prepare_seconds": q.prepare_seconds, "calibration_seconds": q.calibration_seconds,
        "convert_seconds": q.convert_seconds,
        "seq_mse_seconds": q.seq_mse.seconds if q.seq_mse is not None else 0.0,
        "weight_rounding_seconds": q.weight_rounding.seconds if q.weight_rounding is not None else 0.0,
        "rotation_seconds": (q.rotation or {}).get("seconds") or 0.0,
        "total_seconds": q.total_seconds,
    }
    calibration["other_seconds"] = calibration["total_seconds"] - sum(
        v for k, v in calibration.items() if k.endswith("_seconds") and k != "total_seconds")
    report = {
        "npuq_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "options": to_json(run.options),
        "execution": to_json(run.execution),
        "model": to_json(run.model),
        "scheme": q.scheme,
        "recipe": {"name": q.recipe, "plan": list(artifact.recipe_plan or ()), "summary": q.recipe_summary,
                   "rotation": q.rotation, "budget": to_json(q.budget) if q.budget is not None else None},
        "bits_per_weight": q.bits_per_weight,  # mean code bits per weight parameter (npuq.quant.size)
        "weight_bytes": q.weight_bytes,
        "threads": to_json(run.threads),
        "calibration": calibration,
        "layers": {"tokens": run.layers.tokens, "layers": layer_list, "worst": worst_layers},
        "perplexity": {k: {f: getattr(v, f) for f in ("word_perplexity", "byte_perplexity", "bits_per_byte", "tokens",
                                                      "words", "bytes", "documents", "context", "seconds")
                           + (DIVERGENCE if k != "float" else ())}
                       for k, v in ppl.items()},
        "export": {k: v for k, v in to_json(export).items() if k in EXPORT_FACTS},
        "generations": to_json(run.generations)["generations"],
        "files": {name: sorted(str(p.relative_to(out)) for p in (out / name).rglob("*") if p.is_file())
                  for name in ("artifact", "onnx")},
        "stages": [to_json(s) for s in run.stages],
        "seconds": run.seconds,
    }
    report["files"]["report"] = ["report.html", "report.json"]
    return report, render_html(report)


def rotation_text(rotation: dict[str, Any] | None) -> str:
    if not rotation:
        return "No rotation was folded into the weights."
    return ("Before calibration, " + RotationReport(**rotation).describe() + ". The float model computes the same "
            "function; the per-layer errors compare both in the rotated basis.")


def budget_text(report: dict[str, Any]) -> str:
    """The weights' size, and what --bits-per-weight chose."""
    if report.get("bits_per_weight") is None:
        return ""
    text = (f"Weights: {report['bits_per_weight']:.4f} code bits per weight parameter on average (linear layers, lm "
            f"head and embedding table; scales excluded), {report['weight_bytes']:,} bytes with their scales.")
    budget = report["recipe"].get("budget")
    if budget:
        text += (f" Formats chosen by --bits-per-weight: {BudgetReport(**budget).describe()}; the recipe is "
                 f"artifact/{budget['recipe_file']}, which --recipe takes.")
    return text


def render_html(report: dict[str, Any]) -> str:
    m, ppl, exp = report["model"], report["perplexity"], report["export"]
    ratio = ppl["quantized"]["word_perplexity"] / ppl["float"]["word_perplexity"]
    qnn = f"QNN {exp['qnn_version']} ({exp['qnn_version_source']})" if exp["qnn_version"] else "QNN version unknown"
    bits = report.get("bits_per_weight")
    size = f" ({bits:.3f} bits per weight, {report['weight_bytes'] / 1e6:.2f} MB of weights)" if bits is not None else ""
    summary = Section("Summary", [
        f"{m['model']} ({m['architecture']}, {m['parameters'] / 1e6:.1f} M parameters) quantized {report['scheme']} "
        f"with recipe {report['recipe']['name']}{size}: word perplexity {ppl['float']['word_perplexity']:.2f} (float) → "
        f"{ppl['quantized']['word_perplexity']:.2f} (quantized, {ratio:.3f}x) → "
        f"{ppl['exported']['word_perplexity']:.2f} (exported QDQ ONNX on ONNX Runtime). Divergence from the float "
        f"model, per scored token: KLD mean {ppl['quantized']['kld_mean']:.4g} nats, top-1 agreement "
        f"{ppl['quantized']['top1_agreement']:.1%} (quantized); {ppl['exported']['kld_mean']:.4g} nats, "
        f"{ppl['exported']['top1_agreement']:.1%} (exported).",
        f"Exported for {qnn}, HTP arch {_arch(exp)}, embedding pattern {exp['embedding_pattern']}. "
        f"Deployable files: onnx/ ({', '.join(Path(f).name for f in report['files']['onnx'])}); the quantized "
        f"programs and encodings: artifact/.",
        f"Run time {report['seconds']:.1f} s; stages reused from an earlier run: "
        f"{sum(s['cached'] for s in report['stages'])} of {len(report['stages'])}.",
    ])
    model = Section("Model", [Table(["fact", "value"], [[k, v] for k, v in m.items()])])
    perplexity = Section("Perplexity", [
        Table(["graphs", "word ppl", "× float", "byte ppl", "bits/byte", "KLD mean (nats)", "KLD p99 (nats)",
               "top-1 agreement", "tokens", "seconds"], _ppl_rows(ppl),
              caption=f"context {ppl['float']['context']}, {ppl['float']['documents']} documents of the "
                      f"{report['options']['eval_corpus']} corpus's eval split, each token scored once"),
        "quantized = the PT2E QDQ programs (prefill chunks, then decode steps with the quantized KV cache, as on "
        "the device); exported = decode.onnx and prefill.onnx on ONNX Runtime's CPU provider with graph "
        "optimizations off (the exact QDQ reference). KLD: KL(float ‖ graphs) of each scored token's next-token "
        "distribution over the whole vocabulary, from the float model run on the same windows (its mean and 99th "
        "percentile, as llama.cpp's perplexity --kl-divergence reports); top-1 agreement: the share of scored "
        "tokens whose most likely next token is the float model's.",
    ])
    gens = report["generations"]
    generations = Section("Greedy generations", [Table(
        ["prompt", "float", "quantized", "same tokens"],
        [[g["prompt"], g["float"], g["quantized"], f"{g['same_tokens']}/{g['tokens']}"] for g in gens])])
    lay = report["layers"]
    layers = Section("Quantization error per layer", [
        "Not measured: the float model did not fit memory and ran streamed, block by block."] if not lay["layers"]
        else [
        Figure(layers_figure(lay["layers"], lay["worst"]),
               f"{len(lay['layers'])} linear layers, {lay['tokens']} tokens of held-out text"),
        Table(["layer", "weight SQNR (dB)", "output SQNR (dB)"],
              [[w["path"], w["weight_sqnr_db"], w["output_sqnr_db"]] for w in lay["worst"]],
              caption=f"the {len(lay['worst'])} layers whose weights lose the most to quantization"),
        "Output SQNR compares each layer's output with the float model's and includes everything before it; "
        "a sudden drop marks a layer worth a finer scheme in the recipe (see npuq quantize --recipe).",
    ])
    recipe = Section("Recipe", [
        Table(["op", "rule", "scheme", "layers", "example"], recipe_rows(report["recipe"]["plan"])),
        ("pre", report["recipe"]["summary"].split("\n", 1)[0] if report["recipe"]["summary"] else ""),
        rotation_text(report["recipe"]["rotation"]),
        *([budget_text(report)] if report.get("bits_per_weight") is not None else []),
    ])
    cal = report["calibration"]
    calibration = Section("Calibration time", [Table(
        ["part", "seconds"],
        [[k.removesuffix("_seconds").replace("_", " "), v] for k, v in cal.items() if k.endswith("_seconds")],
        caption=f"{cal['mode']} calibration on {cal['tokens']} tokens, {cal['threads']} threads; other = loading, "
                "thread planning and writing the artifact")])
    th = report["threads"]
    sweeps = [TuneResult.from_dict(s) for s in th["sweeps"]]
    threads = Section("Threads", [
        f"Not timed: the float model did not fit memory and ran streamed; every phase ran at "
        f"{max(th['plan'].values())} threads."] if not sweeps else [
        Figure(figure_png(sweep_figure(sweeps, f"ceiling {th['ceiling']} threads")), "ms per step; the chosen count is ringed"),
        Table(["phase", "threads", "ms per step", "× default"],
              [[s.phase, s.best, None if s.best_seconds is None else s.best_seconds * 1e3, s.speedup_vs_default]
               for s in sweeps]),
    ])
    export = Section("Export", [Table(["", ""], [
        ["QNN SDK", qnn], ["HTP arch", _arch(exp)], ["embedding pattern", exp["embedding_pattern"]],
        *[[k, v] for k, v in exp["files"].items()]])])
    stages = Section("Stages", [Table(["stage", "key", "reused", "seconds"],
                                      [[s["stage"], s["key"], s["cached"], s["seconds"]] for s in report["stages"]])])
    title = f"npuq run: {m['model']} → {report['scheme']}"
    subtitle = f"npuq {report['npuq_version']}, {report['created']}"
    return render(title, subtitle, [summary, perplexity, generations, layers, model, recipe, calibration, threads,
                                    export, stages])


def _arch(export: dict[str, Any]) -> str:
    """v75 (SM8650), v73, or unknown."""
    if not export.get("htp_arch"):
        return "unknown"
    return f"v{export['htp_arch']}" + (f" ({export['soc']})" if export.get("soc") else "")
