"""Word perplexity of SmolLM2-135M under each quantization recipe and accuracy-recovery method.

Calibration text is the builtin corpus's calib split, evaluation its disjoint eval split, both
at context 512. Every configuration starts from the same float weights. Writes JSON:

    .venv/bin/python bench/accuracy.py [--calib-tokens 2048] [--eval-tokens 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
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
from npuq.runtime.runner import forward_logits


def config(label: str, recipe: str, seq_mse: int | None = None, granularity: str = "channel", rounding: str = "nearest",
           inputs: str = "float", act_order: bool = False) -> dict:
    return {"config": label, "recipe": recipe, "seq_mse": seq_mse, "granularity": granularity if seq_mse else None,
            "rounding": rounding, "layer_inputs": inputs, "act_order": act_order if rounding == "gptq" else None}


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
    calib = corpus_tokens(tok, "builtin", args.calib_tokens)
    docs = load_corpus("builtin", "eval")

    def evaluate(logits_fn):
        r = evaluate_perplexity(logits_fn, tok, docs, args.context, max_tokens=args.eval_tokens)
        return {k: getattr(r, k) for k in ("word_perplexity", "byte_perplexity", "bits_per_byte", "tokens", "seconds")}

    rows = [{"config": "float", **evaluate(lambda t: forward_logits(model, t))}]
    print(json.dumps(rows[-1]), flush=True)
    for spec in CONFIGS:
        if args.only and not any(o == spec["config"] if args.exact else o in spec["config"] for o in args.only):
            continue
        model.load_state_dict(float_state)
        recipe = load_recipe(spec["recipe"])
        row = dict(spec)
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
    model.load_state_dict(float_state)
    result = {"model": args.model, "context": args.context, "calib_tokens": len(calib), "eval_tokens": args.eval_tokens,
              "corpus": "builtin (calib / eval splits)", "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
