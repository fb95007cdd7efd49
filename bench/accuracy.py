"""Word perplexity of SmolLM2-135M under each quantization recipe and accuracy-recovery method,
on three domains.

Calibration text is the builtin corpus's calib split (CPython's reference documentation), drawn
for each row as ``npuq quantize`` would draw it unless --calib-tokens / --calib-sampling say
otherwise: 4096 tokens in one stretch, or 8192 spread over the split where SeqMSE or GPTQ fit
layers of more than 4096 inputs (npuq.data.corpora.calibration_draw; SmolLM2-135M has none).
Every configuration is scored at context 512 on

- ``builtin``: the builtin corpus's eval split, disjoint from calib but of the same domain;
- ``prose``: English prose of another domain, never used for calibration or tuning: the 1911
  Encyclopaedia Britannica article on Shakespeare (the eval split of npuq's ``prose`` corpus,
  downloaded into npuq's cache on first use);
- ``code``: Python source, never used for calibration unless a row's calib names it: the eval
  split of npuq's ``code`` corpus (standard library modules of the running Python; 4096 tokens
  are cmd.py and the start of code.py).

Every configuration starts from the same float weights; one with ``rotate`` ("r1" or "r1+r2")
first folds rotations into them (npuq.optimize.rotate, seed 0, as ``npuq quantize --rotate``
does), and each rotation used also gets a float row of its own (same perplexity as float to
~1e-6). ``--set domains`` (default): float, 16a8w, and 16a4w / 16a4w_block / 16a4w_mixed /
16a4w_block_mixed with SeqMSE 50 + GPTQ (npuq's defaults for them: quantized layer inputs,
act-order) without and with each rotation, and with GPTAQ (rotated r1); ``--set recovery``:
the recovery methods one by one on the builtin domain's recipes; ``--set calibration``: 16a8w
(plain and rotated r1), 16a4w, 16a4w_block and 16a4w_mixed (rotated r1, SeqMSE + GPTQ) calibrated on the builtin calib split alone or half
and half with other prose (``builtin+prose``: the calib split of ``prose`` is Milton's
Areopagitica, never scored); ``--set calibration-mix``: the default 16a8w (rotated r1) and
16a4w_mixed / 16a4w_block (rotated r1, SeqMSE + GPTQ) calibrated on each of builtin,
builtin+prose, builtin+code, builtin+prose+code and prose+code (equal token shares), the
measurement behind the default calibration text (docs/design.md §12). ``--layer-tokens N`` also records, per quantized row, every linear
layer's output and weight SQNR against the float model in the row's basis (rotated as the row
is; npuq.eval.layers, as ``npuq run``'s layers stage) on the first N tokens of the builtin eval
split, and for rows that rotate, the lowest and the largest loss against the same row
unrotated when that row ran too. ``--kl-divergence`` also scores the float model on each
quantized row's windows and records, per domain, the mean and 99th percentile of the per-token
KL divergence from it and the top-1 agreement (npuq.eval.kld, as ``npuq eval --kl-divergence``):
steadier between calibration draws than a perplexity ratio. Writes JSON, again after every row:

    .venv/bin/python bench/accuracy.py [--set domains] [--calib-tokens N] [--calib-offset 0] [--calib-sampling contiguous|spread] [--eval-tokens 4096] [--layer-tokens 0] [--kl-divergence] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import platform
import time
from pathlib import Path

import torch

from npuq.fsio import write_json
from npuq.calibrate.split import split_windows
from npuq.data import load_corpus
from npuq.eval.layers import layer_errors
from npuq.eval.perplexity import evaluate_perplexity
from npuq.models import load_model
from npuq.quantize.passes import fold_constant_dequant
from npuq.quantize.pt2e import SCORING_BATCH, quantize_model
from npuq.quant.recipe import ROTATIONS, load_recipe
from npuq.quantize.stage import ROTATION_SEED
from npuq.data.corpora import CALIB_SAMPLINGS, calibration_draw, corpus_tokens
from npuq.optimize.driver import RecoveryOptions
from npuq.optimize.gptq import GptqOptions
from npuq.optimize.recovery import optimize_for_recipe
from npuq.optimize.rotate import rotate_model
from npuq.records import to_json
from npuq.runtime.runner import forward_logits


def config(label: str, recipe: str, seq_mse: int | None = None, granularity: str = "channel", rounding: str = "nearest",
           inputs: str = "float", act_order: bool = False, rotate: str | None = None, calib: str = "builtin") -> dict:
    assert rotate is None or rotate in ROTATIONS, rotate
    return {"config": label, "recipe": recipe, "seq_mse": seq_mse, "granularity": granularity if seq_mse else None,
            "rounding": rounding, "layer_inputs": inputs, "act_order": act_order if rounding == "gptq" else None,
            "rotate": rotate, "calib": calib}


DOMAIN_CONFIGS = [config("16a8w", "16a8w")]
for _recipe in ("16a4w", "16a4w_block", "16a4w_mixed", "16a4w_block_mixed"):
    for _rotate in (None, "r1", "r1+r2"):
        DOMAIN_CONFIGS.append(config(f"{_recipe} + SeqMSE + GPTQ" + (f", rotated {_rotate}" if _rotate else ""),
                                     _recipe, 50, rounding="gptq", inputs="quantized", act_order=True, rotate=_rotate))
    # GPTAQ (--layer-inputs asymmetric): each layer fitted to the float model's output (issue #29 item 3)
    DOMAIN_CONFIGS.append(config(f"{_recipe} + SeqMSE + GPTAQ, rotated r1", _recipe, 50, rounding="gptq",
                                 inputs="asymmetric", act_order=True, rotate="r1"))

CONFIGS = [
    config("16a8w", "16a8w"),
    config("16a4w min/max", "16a4w"),
    config("16a4w + SeqMSE layer", "16a4w", 50, "layer"),
    config("16a4w + SeqMSE channel", "16a4w", 50),
    config("16a4w + GPTQ", "16a4w", rounding="gptq"),
    config("16a4w + SeqMSE channel + GPTQ", "16a4w", 50, rounding="gptq"),
    config("16a4w + SeqMSE channel + GPTQ, quantized inputs", "16a4w", 50, rounding="gptq", inputs="quantized"),
    config("16a4w + SeqMSE channel + GPTQ act-order, quantized inputs", "16a4w", 50, rounding="gptq",
           inputs="quantized", act_order=True),
    config("16a4w_mixed min/max", "16a4w_mixed"),
    config("16a4w_mixed + SeqMSE channel + GPTQ", "16a4w_mixed", 50, rounding="gptq"),
    config("16a4w_mixed + SeqMSE channel + GPTQ act-order", "16a4w_mixed", 50, rounding="gptq", act_order=True),
    config("16a4w_mixed + SeqMSE channel + GPTQ act-order, quantized inputs", "16a4w_mixed", 50, rounding="gptq",
           inputs="quantized", act_order=True),
    config("16a4w_block min/max", "16a4w_block"),
    config("16a4w_block + GPTQ", "16a4w_block", rounding="gptq"),
    config("16a4w_block + SeqMSE channel + GPTQ", "16a4w_block", 50, rounding="gptq"),
    config("16a4w_block + SeqMSE channel + GPTQ act-order", "16a4w_block", 50, rounding="gptq", act_order=True),
    config("16a4w_block + SeqMSE channel + GPTQ, quantized inputs", "16a4w_block", 50, rounding="gptq",
           inputs="quantized"),
    config("16a4w_block + SeqMSE channel + GPTQ act-order, quantized inputs", "16a4w_block", 50, rounding="gptq",
           inputs="quantized", act_order=True),
]
MIX = "builtin+prose"  # the builtin calib split and Areopagitica, half the tokens each (npuq's mix)
CALIBRATION_CONFIGS = [config(f"16a8w, calibrated on {c}", "16a8w", calib=c) for c in ("builtin", MIX)]
CALIBRATION_CONFIGS += [config(f"16a8w, rotated r1, calibrated on {c}", "16a8w", rotate="r1", calib=c)
                        for c in ("builtin", MIX)]
CALIBRATION_CONFIGS += [config(f"{r} + SeqMSE + GPTQ, rotated r1, calibrated on {c}", r, 50, rounding="gptq",
                               inputs="quantized", act_order=True, rotate="r1", calib=c)
                        for r in ("16a4w", "16a4w_block", "16a4w_mixed") for c in ("builtin", MIX)]
# The default calibration text (issue #29): each mix of the three offline-or-cached kinds of text, for the default
# 16a8w (R1) and the best 4-bit recipes, scored on all three domains.
MIXES = ("builtin", "builtin+prose", "builtin+code", "builtin+prose+code", "prose+code")
CALIBRATION_MIX_CONFIGS = [config(f"16a4w_mixed + SeqMSE + GPTQ, rotated r1, calibrated on {c}", "16a4w_mixed", 50,
                                  rounding="gptq", inputs="quantized", act_order=True, rotate="r1", calib=c)
                           for c in MIXES]
CALIBRATION_MIX_CONFIGS += [config(f"16a8w, rotated r1, calibrated on {c}", "16a8w", rotate="r1", calib=c)
                            for c in MIXES]
CALIBRATION_MIX_CONFIGS += [config(f"16a4w_block + SeqMSE + GPTQ, rotated r1, calibrated on {c}", "16a4w_block", 50,
                                   rounding="gptq", inputs="quantized", act_order=True, rotate="r1", calib=c)
                            for c in MIXES]
SETS = {"domains": DOMAIN_CONFIGS, "recovery": CONFIGS, "calibration": CALIBRATION_CONFIGS,
        "calibration-mix": CALIBRATION_MIX_CONFIGS}
DOMAINS = {"builtin": "builtin eval split",
           "prose": "prose eval split (the 1911 Britannica article on Shakespeare)",
           "code": "code eval split (Python standard library modules; see npuq.data.code)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=None,
                    help="calibration tokens (default: npuq quantize's for each row)")
    ap.add_argument("--calib-offset", type=int, default=0,
                    help="start each calibration text this many tokens into its split (each part of a mix into "
                         "its own): another draw of the same kind of text, to measure how much a row moves between draws")
    ap.add_argument("--calib-sampling", choices=CALIB_SAMPLINGS, default=None,
                    help="as npuq quantize's: one stretch of the split, or windows of --context tokens spread over "
                         "it (default: npuq quantize's for each row)")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--set", choices=sorted(SETS), default="domains", help="which configurations (see above)")
    ap.add_argument("--only", action="append", help="run only configurations whose label contains this")
    ap.add_argument("--exact", action="store_true", help="--only names whole labels")
    ap.add_argument("--gptq-damp", type=float, default=None, help="GPTQ's damping (fraction of H's mean diagonal; "
                    "default: npuq's)")
    ap.add_argument("--gptq-damp-down", type=float, default=None, help="GPTQ's damping of the MLP down projections "
                    "(default: npuq's)")
    ap.add_argument("--layer-tokens", type=int, default=0, help="per-layer SQNR on this many eval tokens (0: off)")
    ap.add_argument("--kl-divergence", action="store_true",
                    help="also score the float model on each quantized row's windows: kld_mean, kld_p99 and "
                         "top1_agreement per domain, as npuq eval --kl-divergence (one more float forward per batch)")
    ap.add_argument("--out", default="out/bench/accuracy.json")
    args = ap.parse_args()

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    float_state = {k: v.clone() for k, v in model.state_dict().items()}
    float_config = model.config
    reference = copy.deepcopy(model) if args.kl_divergence else None  # the float model, unrotated: the same function
    rotated: dict[str, tuple] = {}  # rotate → (state, config, report), computed once

    def load_weights(rotate: str | None) -> dict | None:
        """The float weights, rotated as ``rotate`` says; returns the rotation report (JSON)."""
        model.load_state_dict(float_state)
        model.config = float_config
        if rotate is None:
            return None
        if rotate not in rotated:
            folded = ROTATIONS[rotate]
            report = rotate_model(model, seed=ROTATION_SEED, r1=folded.r1, r2=folded.r2)  # as npuq quantize --rotate does
            rotated[rotate] = ({k: v.clone() for k, v in model.state_dict().items()}, model.config,
                               dataclasses.asdict(report))
        state, cfg, report = rotated[rotate]
        model.load_state_dict(state)
        model.config = cfg
        return report

    selected = [spec for spec in SETS[args.set]
                if not args.only or any(o == spec["config"] if args.exact else o in spec["config"] for o in args.only)]
    calib_specs = {c: c for c in dict.fromkeys(["builtin"] + [spec["calib"] for spec in selected])}  # label → spec

    @functools.cache
    def calibration(spec: str, recovers: bool) -> tuple[tuple[int, ...], str]:
        """(tokens, sampling) as npuq quantize draws them: the flags given, its defaults for such a
        row (each part of a mix from its own offset)."""
        n, sampling = calibration_draw(model.config.widest_linear_input if recovers else None, args.calib_tokens,
                                       args.calib_sampling)
        ids = corpus_tokens(tok, spec, n, offset=args.calib_offset,
                            spread=args.context if sampling == "spread" else None)
        if args.calib_offset and len(ids) < n:
            ap.error(f"--calib-offset {args.calib_offset}: the {spec} calib split has only "
                     f"{args.calib_offset + len(ids)} tokens; use a smaller offset")
        return tuple(ids), sampling

    domains = {name: load_corpus(name, "eval") for name in DOMAINS}

    def evaluate(logits_fn, row, batch_size=1, reference_fn=None):
        """Score every domain into ``row``: metrics per domain, and ratios to the float row.
        ``batch_size`` > 1: windows of mixed lengths per call (the QDQ programs' scoring program).
        ``reference_fn``: the float model's logits, for the divergence from it on the same windows."""
        row["domains"] = {}
        for name, docs in domains.items():
            r = evaluate_perplexity(logits_fn, tok, docs, args.context, max_tokens=args.eval_tokens,
                                    batch_size=batch_size, mixed=batch_size > 1, reference_fn=reference_fn)
            keys = ("word_perplexity", "byte_perplexity", "bits_per_byte", "tokens", "seconds")
            m = {k: getattr(r, k) for k in keys + (("kld_mean", "kld_p99", "top1_agreement") if reference_fn else ())}
            if rows:
                base = rows[0]["domains"][name]
                m["word_over_float"] = m["word_perplexity"] / base["word_perplexity"]
                m["byte_over_float"] = m["byte_perplexity"] / base["byte_perplexity"]
            row["domains"][name] = m
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_result()  # after every row: a long run interrupted keeps what it measured

    rows: list[dict] = []
    # GPTQ's dampings for every row that rounds with GPTQ: the flags given, npuq's defaults for the rest
    gptq_damps = GptqOptions(**{k: v for k, v in (("damp", args.gptq_damp), ("damp_down", args.gptq_damp_down))
                                if v is not None})

    def write_result() -> None:
        result = {"model": args.model, "context": args.context, "calib_tokens": args.calib_tokens,
                  "calib_offset": args.calib_offset, "calib_sampling": args.calib_sampling,  # None: per row
                  "gptq_damp": gptq_damps.damp, "gptq_damp_down": gptq_damps.damp_down,
                  "eval_tokens": args.eval_tokens, "kl_divergence": args.kl_divergence, "calibration": calib_specs,
                  "domains": DOMAINS,
                  "python": platform.python_version(), "threads": torch.get_num_threads(), "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, result)
    layer_ids = corpus_tokens(tok, "builtin", args.layer_tokens, split="eval") if args.layer_tokens else []

    def compare_layers(row: dict) -> None:
        """For a rotated row: per-layer output SQNR minus that of the same row unrotated (if it ran)."""
        twin = next((r for r in rows if "layers" in r and r is not row and r["rotate"] is None
                     and (r["recipe"], r["seq_mse"], r["rounding"], r["calib"])
                     == (row["recipe"], row["seq_mse"], row["rounding"], row["calib"])), None)
        if row["rotate"] is None or twin is None:
            return
        diff = {p: row["layers"][p]["output_sqnr_db"] - twin["layers"][p]["output_sqnr_db"] for p in twin["layers"]
                if row["layers"].get(p, {}).get("output_sqnr_db") is not None
                and twin["layers"][p]["output_sqnr_db"] is not None}
        worst = min(diff, key=diff.get)
        row["vs_unrotated"] = {"of": twin["config"], "worst_layer": worst, "worst_db": diff[worst],
                               "mean_db": sum(diff.values()) / len(diff), "layers_better": sum(d > 0 for d in diff.values()),
                               "layers": len(diff),
                               "lowest_db": min(v["output_sqnr_db"] for v in row["layers"].values()
                                                if v["output_sqnr_db"] is not None),
                               "unrotated_lowest_db": min(v["output_sqnr_db"] for v in twin["layers"].values()
                                                          if v["output_sqnr_db"] is not None)}
    evaluate(lambda t: forward_logits(model, t), {"config": "float", "rotate": None})
    for rotate in dict.fromkeys(spec["rotate"] for spec in selected if spec["rotate"]):
        report = load_weights(rotate)
        evaluate(lambda t: forward_logits(model, t),
                 {"config": f"float, rotated {rotate}", "rotate": rotate, "rotation": report})
    for spec in selected:
        row = dict(spec)
        report = load_weights(spec["rotate"])
        if report is not None:
            row["rotation"] = report
        recipe = load_recipe(spec["recipe"]).with_rotation(spec["rotate"])  # the rotation this row folds in itself
        start = time.perf_counter()
        scales = None
        recovers = spec["seq_mse"] is not None or spec["rounding"] != "nearest"
        ids, row["calib_sampling"] = calibration(spec["calib"], recovers)
        calib = list(ids)
        row["calib_tokens"] = len(calib)
        if recovers:
            gptq = dataclasses.replace(gptq_damps, act_order=bool(spec["act_order"])) if spec["rounding"] == "gptq" else None
            recovery = RecoveryOptions(spec["seq_mse"], spec["granularity"] or "channel", spec["rounding"],
                                       spec["layer_inputs"], gptq)
            scales, summary = optimize_for_recipe(
                model, recipe, split_windows(calib, args.context), recovery, progress=False)
            row.update(optimize=to_json(summary))
        row["optimize_seconds"] = time.perf_counter() - start
        qm = quantize_model(model, recipe, calib, context=args.context, weight_scales=scales)
        row["quantize_seconds"] = sum(qm.stats[k] for k in ("prepare_seconds", "calibration_seconds", "convert_seconds"))
        folded: dict = {}  # one float copy of the weights for all programs: same numbers, faster
        qm.decode, qm.prefill, qm.scoring = (fold_constant_dequant(gm, folded) for gm in (qm.decode, qm.prefill, qm.scoring))
        with torch.no_grad():
            evaluate(qm.logits, row, SCORING_BATCH,  # four windows per call, as npuq eval --artifact
                     None if reference is None else lambda t: forward_logits(reference, t))
        if args.layer_tokens:
            load_weights(spec["rotate"])  # the float weights in the row's basis (recovery rounded them in place)
            errors = layer_errors(model, qm.graphs(), qm.config, args.context, layer_ids)
            row["layers"] = {e.path: {"output_sqnr_db": e.output_sqnr_db, "weight_sqnr_db": e.weight_sqnr_db}
                             for e in errors}
            compare_layers(row)
            print(json.dumps({"config": row["config"], "layers": row["layers"], "vs_unrotated": row.get("vs_unrotated")}),
                  flush=True)
    load_weights(None)
    write_result()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
