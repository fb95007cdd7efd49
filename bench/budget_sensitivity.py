"""``--bits-per-weight`` against the recipe it must beat: quantize SmolLM2-135M with a recipe
(default 16a4w_mixed) and with ``--bits-per-weight`` at that recipe's own bits, both through
the quantize stage (``npuq quantize``: R1, the same calibration text), and score the float model
and both artifacts on two held-out domains (bench/accuracy.py's: the builtin corpus's eval
split and the prose eval split, the 1911 Britannica article on Shakespeare), as ``npuq eval
--artifact`` scores them (the scoring program, four windows per call). Writes JSON:

    .venv/bin/python bench/budget_sensitivity.py [--recipe 16a4w_mixed] [--calib-tokens 2048] [--eval-tokens 2048]
        [--seq-mse N --weight-rounding gptq] [--num-threads 1] [--out out/bench/budget.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from npuq.data import load_corpus
from npuq.eval.perplexity import evaluate_perplexity
from npuq.fsio import write_json
from npuq.models import load_model
from npuq.quant.recipe import load_recipe
from npuq.quant.size import model_weights, recipe_size
from npuq.quantize.artifact import load_artifact
from npuq.quantize.pt2e import SCORING_BATCH
from npuq.quantize.stage import QuantizeOptions, quantize_to_artifact
from npuq.records import to_json
from npuq.runtime.context import ExecutionContext
from npuq.runtime.runner import forward_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--recipe", default="16a4w_mixed")
    ap.add_argument("--bits", type=float, default=None, help="the budget (default: the recipe's own bits)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--seq-mse", type=int, default=None)
    ap.add_argument("--weight-rounding", default="nearest")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--out", default="out/bench/budget.json")
    args = ap.parse_args()

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    bits = args.bits or recipe_size(load_recipe(args.recipe), model_weights(loaded.model)).bits_per_weight
    domains = {"builtin": load_corpus("builtin", "eval"), "prose": load_corpus("prose", "eval")}
    rows: list[dict] = []

    def score(label: str, logits, batch: int, extra: dict) -> None:
        row = {"config": label, **extra, "domains": {}}
        for name, docs in domains.items():
            with torch.no_grad():
                r = evaluate_perplexity(logits, tok, docs, args.context, max_tokens=args.eval_tokens,
                                        batch_size=batch, mixed=batch > 1)
            m = {"word_perplexity": r.word_perplexity, "tokens": r.tokens}
            if rows:
                m["word_over_float"] = r.word_perplexity / rows[0]["domains"][name]["word_perplexity"]
            row["domains"][name] = m
        rows.append(row)
        print(json.dumps(row), flush=True)

    score("float", lambda t: forward_logits(loaded.model, t), 1, {})
    del loaded
    common = dict(model=args.model, recipe=args.recipe, calib_tokens=args.calib_tokens, context=args.context,
                  seq_mse=args.seq_mse, weight_rounding=args.weight_rounding)
    ctx = ExecutionContext.create("cpu", args.num_threads, progress=True)
    with tempfile.TemporaryDirectory(prefix="npuq-budget-") as tmp:
        for label, options in ((args.recipe, QuantizeOptions(**common)),
                               (f"--bits-per-weight {bits:g}", QuantizeOptions(**common, bits_per_weight=bits))):
            start = time.perf_counter()
            result = quantize_to_artifact(options, Path(tmp) / label.replace(" ", "_"), ctx)
            extra = {"options": to_json(options), "bits_per_weight": result.bits_per_weight,
                     "weight_bytes": result.weight_bytes, "quantize_seconds": time.perf_counter() - start,
                     "budget": to_json(result.budget) if result.budget else None}
            if result.budget:
                extra["recipe"] = json.loads((Path(result.artifact) / result.budget.recipe_file).read_text())
            score(label, load_artifact(result.artifact).logits, SCORING_BATCH, extra)
    result = {"model": args.model, "context": args.context, "calib_tokens": args.calib_tokens,
              "eval_tokens": args.eval_tokens, "budget_bits": bits,
              "domains": {"builtin": "builtin eval split", "prose": "prose eval split (the 1911 Britannica article on Shakespeare)"},
              "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
