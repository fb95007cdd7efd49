"""Word perplexity of SmolLM2-135M under each quantization recipe and accuracy-recovery method.

Calibration text is the builtin corpus's calib split, evaluation its disjoint eval split, both
at context 512. Every configuration starts from the same float weights; a configuration with
``rotate`` ("r1" or "r1+r2") first folds rotations into them (npuq.optimize.rotate, seed 0),
and each rotation used also gets a float row of its own (same perplexity as float to ~1e-6).
Writes JSON:

    .venv/bin/python bench/accuracy.py [--calib-tokens 2048] [--eval-tokens 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from npuq.fsio import write_json
from npuq.calibrate.split import split_windows
from npuq.data import load_corpus
from npuq.eval.perplexity import evaluate_perplexity
from npuq.models import load_model
from npuq.quantize.pt2e import fold_constant_dequant, quantize_model
from npuq.quant.recipe import load_recipe
from npuq.data.corpora import corpus_tokens
from npuq.optimize.recovery import optimize_for_recipe
from npuq.optimize.rotate import rotate_model
from npuq.runtime.runner import forward_logits


def config(label: str, recipe: str, seq_mse: int | None = None, granularity: str = "channel", rounding: str = "nearest",
           inputs: str = "float", act_order: bool = False, rotate: str | None = None) -> dict:
    assert rotate in ROTATIONS, rotate
    return {"config": label, "recipe": recipe, "seq_mse": seq_mse, "granularity": granularity if seq_mse else None,
            "rounding": rounding, "layer_inputs": inputs, "act_order": act_order if rounding == "gptq" else None,
            "rotate": rotate}


ROTATIONS = {None: None, "r1": dict(r1=True, r2=False), "r1+r2": dict(r1=True, r2=True)}  # rotate → rotate_model flags
ROTATION_SEED = 0


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
for _recipe in ("16a4w", "16a4w_block", "16a4w_mixed"):  # npuq's defaults on rotated weights
    for _rotate in ("r1", "r1+r2"):
        CONFIGS.append(config(f"{_recipe} + SeqMSE channel + GPTQ act-order, quantized inputs, rotated {_rotate}",
                              _recipe, 50, rounding="gptq", inputs="quantized", act_order=True, rotate=_rotate))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--only", action="append", help="run only configurations whose label contains this")
    ap.add_argument("--exact", action="store_true", help="--only names whole labels")
    ap.add_argument("--out", default="out/bench/accuracy.json")
    args = ap.parse_args()

    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    float_state = {k: v.clone() for k, v in model.state_dict().items()}
    float_config = model.config
    rotated: dict[str, tuple] = {}  # rotate → (state, config, report), computed once

    def load_weights(rotate: str | None) -> dict | None:
        """The float weights, rotated as ``rotate`` says; returns the rotation report (JSON)."""
        model.load_state_dict(float_state)
        model.config = float_config
        if rotate is None:
            return None
        if rotate not in rotated:
            report = rotate_model(model, seed=ROTATION_SEED, **ROTATIONS[rotate])
            rotated[rotate] = ({k: v.clone() for k, v in model.state_dict().items()}, model.config,
                               dataclasses.asdict(report))
        state, cfg, report = rotated[rotate]
        model.load_state_dict(state)
        model.config = cfg
        return report

    calib = corpus_tokens(tok, "builtin", args.calib_tokens)
    docs = load_corpus("builtin", "eval")

    def evaluate(logits_fn):
        r = evaluate_perplexity(logits_fn, tok, docs, args.context, max_tokens=args.eval_tokens)
        return {k: getattr(r, k) for k in ("word_perplexity", "byte_perplexity", "bits_per_byte", "tokens", "seconds")}

    rows = [{"config": "float", "rotate": None, **evaluate(lambda t: forward_logits(model, t))}]
    print(json.dumps(rows[-1]), flush=True)
    selected = [spec for spec in CONFIGS
                if not args.only or any(o == spec["config"] if args.exact else o in spec["config"] for o in args.only)]
    for rotate in dict.fromkeys(spec["rotate"] for spec in selected if spec["rotate"]):
        report = load_weights(rotate)
        row = {"config": f"float, rotated {rotate}", "rotate": rotate, "rotation": report,
               **evaluate(lambda t: forward_logits(model, t))}
        row["ppl_over_float"] = row["word_perplexity"] / rows[0]["word_perplexity"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    for spec in selected:
        row = dict(spec)
        report = load_weights(spec["rotate"])
        if report is not None:
            row["rotation"] = report
        recipe = load_recipe(spec["recipe"])
        start = time.perf_counter()
        scales = None
        if spec["seq_mse"] is not None or spec["rounding"] != "nearest":
            scales, summary = optimize_for_recipe(
                model, recipe, split_windows(calib, args.context), seq_mse=spec["seq_mse"],
                granularity=spec["granularity"] or "channel", rounding=spec["rounding"], progress=False,
                inputs=spec["layer_inputs"], act_order=bool(spec["act_order"]))
            row.update(optimize=summary)
        row["optimize_seconds"] = time.perf_counter() - start
        qm = quantize_model(model, recipe, calib, context=args.context, weight_scales=scales)
        row["quantize_seconds"] = sum(qm.stats[k] for k in ("prepare_seconds", "calibration_seconds", "convert_seconds"))
        qm.decode, qm.prefill = fold_constant_dequant(qm.decode), fold_constant_dequant(qm.prefill)  # same numbers, faster
        with torch.no_grad():
            row.update(evaluate(qm.logits))
        row["ppl_over_float"] = row["word_perplexity"] / rows[0]["word_perplexity"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    load_weights(None)
    result = {"model": args.model, "context": args.context, "calib_tokens": len(calib), "eval_tokens": args.eval_tokens,
              "corpus": "builtin (calib / eval splits)", "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
