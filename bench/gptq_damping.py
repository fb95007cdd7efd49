"""How GPTQ's rounding holds on text it was not fitted to, layer by layer, at each damping.

For a few blocks of a model (R1 folded in, as npuq's 4-bit recipes do), the input Gram matrix
H = XᵀX of the q, o, up and down projections is collected on the float model over three texts
(the recovery's own walk, npuq.optimize.driver.sequential_groups with float inputs):
the builtin calib split (what ``npuq quantize`` calibrates on by default), and the eval splits
of ``prose`` and ``code``. Each layer's weight is put on its LPBQ grid (16a4w_block's, as
npuq.optimize.recovery.linear_weight_specs reads it from the recipe: 4-bit codes, blocks of 32,
min/max block scales by the backend's rule) with nearest rounding and with GPTQ fitted to
the calib H at each damping, and scored on each text by its relative output error
tr(ΔW H ΔWᵀ) / tr(W H Wᵀ). On the calib text GPTQ always wins; the other two texts show whether
the win holds (docs/design.md §5: on Qwen2.5-Coder-0.5B's down projections GPTQ at damping 0.1
did no better than nearest rounding there, at 1.0 a fifth better). The inputs are the float
model's (no layer rounded before), so this isolates each layer; end-to-end numbers come from
``npuq eval --kl-divergence`` or bench/accuracy.py.

    .venv/bin/python bench/gptq_damping.py --model M [--layers 1,3,6,10,14,18,21,23] [--damps 0.01,0.1,0.3,1,3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from npuq.data.corpora import corpus_tokens
from npuq.fsio import write_json
from npuq.models import load_model, load_tokenizer
from npuq.optimize.driver import sequential_groups
from npuq.optimize.gptq import gptq_codes
from npuq.optimize.recovery import linear_weight_specs
from npuq.optimize.rotate import rotate_model
from npuq.optimize.seqmse import dequantize, fake_quantize, lpbq_scale
from npuq.quant.recipe import load_recipe
from npuq.quantize.stage import ROTATION_SEED

KINDS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")
TEXTS = {"calib": ("builtin", "calib"), "prose": ("prose", "eval"), "code": ("code", "eval")}


def relative_error(weight: torch.Tensor, quantized: torch.Tensor, gram: torch.Tensor) -> float:
    d = weight - quantized
    return float(torch.einsum("oi,ij,oj->", d, gram, d) / torch.einsum("oi,ij,oj->", weight, gram, weight))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a built-in name or a path, as npuq quantize --model")
    ap.add_argument("--layers", default="1,3,6,10,14,18,21,23", help="blocks to measure (comma-separated)")
    ap.add_argument("--damps", default="0.01,0.1,0.3,1,3", help="GPTQ dampings (fractions of H's mean diagonal)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens of each text")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default="out/bench/gptq_damping.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    start = time.perf_counter()
    model = load_model(args.model, args.context).model
    rotate_model(model, seed=ROTATION_SEED, r1=True)
    tokenizer = load_tokenizer(args.model)
    layers = [int(i) for i in args.layers.split(",")]
    damps = [float(d) for d in args.damps.split(",")]
    names = [f"layers.{i}.{kind}" for kind in KINDS for i in layers]
    texts = {}  # text → layer → XᵀX of its input: the float model's walk, as the recovery sums it
    for key, (corpus, split) in TEXTS.items():
        ids = corpus_tokens(tokenizer, corpus, args.tokens, split)
        n = len(ids) // args.context * args.context
        windows = list(torch.as_tensor(ids[:n]).view(-1, 1, args.context))
        texts[key] = {layer: gram.double() for group, gram, _ in sequential_groups(model, windows, names, "float")
                      for layer in group}
        print(f"{key}: {n} tokens", flush=True)
    modules = dict(model.named_modules())
    specs = linear_weight_specs(model, load_recipe("16a4w_block"))
    rows = {}
    for name in names:
        weight = modules[name].weight.detach().float()
        spec = specs[name]
        scale = lpbq_scale(weight, spec.bits, spec.block_size, spec.scale_bits, spec.eps)
        methods = {"nearest": fake_quantize(weight, scale, spec.bits)}
        for damp in damps:
            methods[f"gptq {damp:g}"] = dequantize(gptq_codes(weight, texts["calib"][name].float(), scale, spec.bits,
                                                              damp=damp, act_order=True), scale)
        w = weight.double()
        rows[name] = {m: {t: relative_error(w, q.double(), texts[t][name]) for t in TEXTS} for m, q in methods.items()}
        print(name, json.dumps({m: [round(v, 5) for v in e.values()] for m, e in rows[name].items()}), flush=True)
    totals = {kind: {m: {t: sum(rows[n][m][t] for n in names if n.endswith(kind)) for t in TEXTS}
                     for m in rows[names[0]]} for kind in KINDS}
    for kind, by_method in totals.items():
        print(f"{kind}, summed over blocks {args.layers} [calib, prose, code]:")
        for m, e in by_method.items():
            print(f"  {m:12s} " + " ".join(f"{v:.4f}" for v in e.values()))
    write_json(args.out, {"model": args.model, "rotate": "r1", "recipe": "16a4w_block", "layers": layers,
                          "damps": damps, "tokens": args.tokens, "context": args.context,
                          "texts": {k: f"{c} {s} split" for k, (c, s) in TEXTS.items()},
                          "totals": totals, "rows": rows, "seconds": time.perf_counter() - start,
                          "python": platform.python_version()})


if __name__ == "__main__":
    main()
