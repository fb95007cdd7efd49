"""onnxruntime-genai against npuq's runner on one folder, logits call by call.

Generates greedily with onnxruntime-genai 0.18 on an ``npuq export --genai shared`` folder,
then feeds npuq's runner (what ``npuq generate --onnx`` runs: the folder's prefill and decode
graphs, npuq's cache layout) the same token sequence: the prompt, then each token the runtime
generated. For every call it reports the largest absolute difference of the next-token logits
and each side's top token and top-two margin, and then npuq's own greedy tokens. This is the
measurement behind docs/design.md §11 ("Before this layout ..."): run it on a folder exported
by this npuq (all differences 0) and on one exported by an npuq before issue 27, e.g.

    git archive 03c8660 src | tar -x -C /tmp/npuq-before
    PYTHONPATH=/tmp/npuq-before/src .venv/bin/npuq export --artifact art --out before --soc SM8650 --genai shared
    .venv/bin/python bench/genai_logits.py before "The capital of France is" --json out/bench/before.json

Reports and never asserts; JSON to --json (atomically) and stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from npuq.fsio import write_json


def measure(folder: Path, prompt: str, n: int) -> dict:
    import onnxruntime_genai as og
    from transformers import AutoTokenizer

    from npuq.lower.ort import load_export
    from npuq.runtime.runner import StaticRunner

    model_config = json.loads((folder / "genai_config.json").read_text())["model"]
    logits_name = model_config["decoder"]["outputs"]["logits"]  # "logits" before issue 27, "genai_logits" after
    ids = list(AutoTokenizer.from_pretrained(folder)(prompt)["input_ids"])
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=model_config["context_length"], do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    og_logits = [np.asarray(generator.get_output(logits_name))[0, -1].copy()]  # the append's last token
    tokens = []
    for i in range(n):
        generator.generate_next_token()  # the first samples the append's logits; later ones feed the last token
        tokens.append(int(generator.get_next_tokens()[0]))
        if i:
            og_logits.append(np.asarray(generator.get_output(logits_name))[0, -1].copy())
    manifest, graphs = load_export(folder)
    runner = StaticRunner(manifest.cfg, graphs, manifest.context)
    npuq_logits = [runner.feed(ids)[0, -1].numpy()] + [runner.feed([t])[0, -1].numpy() for t in tokens[:-1]]
    calls = []
    for call, (a, b) in enumerate(zip(og_logits, npuq_logits)):
        top_a, top_b = np.argsort(a)[::-1][:2], np.argsort(b)[::-1][:2]
        calls.append({"call": call, "max_abs_diff": float(np.abs(a - b).max()), "og_top": int(top_a[0]),
                      "npuq_top": int(top_b[0]), "og_margin": float(a[top_a[0]] - a[top_a[1]]),
                      "npuq_margin": float(b[top_b[0]] - b[top_b[1]])})
    runner = StaticRunner(manifest.cfg, graphs, manifest.context)
    mine = [int(runner.feed(ids)[0, -1].argmax())]
    while len(mine) < n:
        mine.append(int(runner.feed([mine[-1]])[0, -1].argmax()))
    return {"folder": str(folder), "prompt": prompt, "prompt_tokens": len(ids), "og_tokens": tokens,
            "npuq_tokens": mine, "tokens_equal": tokens == mine, "calls": calls}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="an npuq export --genai shared folder")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens (default 16)")
    p.add_argument("--json", default="out/bench/genai_logits.json", help="report (default out/bench/genai_logits.json)")
    args = p.parse_args(argv)
    report = measure(Path(args.folder), args.prompt, args.new_tokens)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, report)
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
