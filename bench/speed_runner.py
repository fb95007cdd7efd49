"""Float decode speed of npuq's static runner against transformers' eager generate, same weights.

Both sides read the same GGUF (transformers through ``gguf_file=``, float32) and greedily
continue the same prompt token ids for ``--new-tokens`` tokens. npuq runs
:func:`npuq.runtime.generate.generate` (prefill chunks, then AR-1 decode steps through the
static decoder, as ``npuq generate`` does); transformers runs ``model.generate(do_sample=False)``
with a streamer that timestamps every token, so its prefill is left out. ms/token is the decode
time per decode step (the first new token comes from the prefill on both sides). For each
thread count the two run interleaved (npuq, transformers, npuq, ...) in one process and the
medians are compared (of each side, and of the ratios of adjacent runs), so the ratio holds on
a noisy shared host. The greedy tokens must be identical.

With ``--eval-tokens`` > 0 it also times scoring throughput (tokens/s of
:func:`npuq.eval.perplexity.evaluate_model`, the calibrate-mode forward ``npuq eval`` runs).

    .venv/bin/python bench/speed_runner.py                       # threads 1 and 2, 64 tokens
    .venv/bin/python bench/speed_runner.py --repeats 5 --eval-tokens 2048

Writes JSON (default out/bench/speed_runner.json) and prints it. Exit status 1 when the tokens
differ or npuq is slower than transformers at any thread count.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPT = "The history of the printing press begins in"


class TokenClock:
    """A transformers streamer that records when each chunk of tokens arrives."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_transformers(source: str):
    from transformers import AutoModelForCausalLM

    path = Path(source)
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()


def hf_decode(model, prompt_ids: list[int], new_tokens: int, threads: int) -> tuple[float, list[int]]:
    """(seconds per decode step, generated ids) of transformers' greedy generate."""
    from npuq.threads import thread_scope

    ids = torch.tensor([prompt_ids])
    clock = TokenClock()
    with thread_scope(threads), torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
            streamer=clock, pad_token_id=model.config.eos_token_id,
        )
    generated = out[0, len(prompt_ids):].tolist()
    # times[0]: the prompt echoed before prefill; times[1]: first new token (after prefill)
    steps = len(clock.times) - 2
    return (clock.times[-1] - clock.times[1]) / steps, generated


def _field(result, name):
    """A field of a result that is a dict or a dataclass (npuq's API returns either, by version)."""
    return result[name] if isinstance(result, dict) else getattr(result, name)


def _threads_kwargs(fn, threads: int) -> dict:
    """``num_threads=`` or ``ctx=ExecutionContext`` (by version) for ``threads`` CPU threads."""
    params = inspect.signature(fn).parameters
    if "ctx" in params:
        from npuq.runtime.context import ExecutionContext

        return {"ctx": ExecutionContext.create("cpu", threads)}
    return {"num_threads": threads}


def npuq_decode(loaded, prompt: str, new_tokens: int, context: int, prefill_len: int, threads: int):
    from npuq.runtime.generate import generate

    result = generate(loaded, prompt, max_new_tokens=new_tokens, context=context, prefill_len=prefill_len,
                      **_threads_kwargs(generate, threads))
    ids = list(_field(result, "token_ids"))
    return _field(result, "decode_seconds") / (len(ids) - 1), ids


def eval_throughput(loaded, tokens: int, context: int, threads: int) -> float:
    from npuq.data import load_corpus
    from npuq.eval.perplexity import evaluate_model

    documents = load_corpus("builtin", "eval")
    result = evaluate_model(loaded, documents, context, batch_size=1, max_tokens=tokens,
                            **_threads_kwargs(evaluate_model, threads))
    return _field(result, "tokens") / _field(result, "seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a built-in name or .gguf file (default smollm2-135m)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per side and thread count")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--eval-tokens", type=int, default=0, help="also time evaluate_model on this many tokens")
    parser.add_argument("--json", default="out/bench/speed_runner.json")
    args = parser.parse_args(argv)

    from npuq.fsio import write_json
    from npuq.models import load_model

    start = time.perf_counter()
    loaded = load_model(args.model)
    if not loaded.source.endswith(".gguf"):
        parser.error(f"{args.model} is not a GGUF model: the reference loads the same GGUF through transformers")
    hf = load_transformers(loaded.source)
    load_seconds = time.perf_counter() - start
    prompt_ids = list(loaded.tokenizer(args.prompt)["input_ids"])

    rows, all_same = [], True
    for threads in args.threads:
        # untimed warm-up of both (first-call allocations, OpenMP pool start)
        npuq_decode(loaded, args.prompt, 4, args.context, args.prefill_len, threads)
        hf_decode(hf, prompt_ids, 4, threads)
        ours, theirs, same = [], [], True  # run i of each side ran next to the other's run i
        for rep in range(args.repeats):
            order = ("npuq", "hf") if rep % 2 == 0 else ("hf", "npuq")
            for side in order:
                if side == "npuq":
                    seconds, npuq_ids = npuq_decode(loaded, args.prompt, args.new_tokens, args.context,
                                                    args.prefill_len, threads)
                    ours.append(seconds)
                else:
                    seconds, hf_ids = hf_decode(hf, prompt_ids, args.new_tokens, threads)
                    theirs.append(seconds)
            same &= npuq_ids == hf_ids and len(npuq_ids) == args.new_tokens
        all_same &= same
        npuq_ms, hf_ms = 1000 * statistics.median(ours), 1000 * statistics.median(theirs)
        pairs = statistics.median(a / b for a, b in zip(ours, theirs))  # robust to the host's load drifting
        rows.append({
            "threads": threads,
            "npuq_ms_per_token": npuq_ms,
            "transformers_ms_per_token": hf_ms,
            "ratio_npuq_over_transformers": npuq_ms / hf_ms,
            "ratio_median_of_adjacent_pairs": pairs,
            "npuq_runs_ms": [1000 * s for s in ours],
            "transformers_runs_ms": [1000 * s for s in theirs],
            "same_tokens": same,
        })
        print(f"threads {threads}: npuq {npuq_ms:.1f} ms/token, transformers {hf_ms:.1f} ms/token, "
              f"ratio {npuq_ms / hf_ms:.2f} (of adjacent pairs {pairs:.2f}), same tokens {same}", file=sys.stderr)

    result = {
        "model": args.model, "source": loaded.source, "context": args.context, "prefill_len": args.prefill_len,
        "new_tokens": args.new_tokens, "prompt": args.prompt, "prompt_tokens": len(prompt_ids),
        "repeats": args.repeats, "load_seconds": load_seconds,
        "decode": rows,
        "same_tokens": all_same,
        # on the pairs' ratio: on a shared host the load moves between repeats, less within a pair
        "npuq_not_slower": all(r["ratio_median_of_adjacent_pairs"] <= 1.0 for r in rows),
        "torch": torch.__version__,
    }
    if args.eval_tokens:
        result["eval_tokens_per_second"] = {
            str(t): statistics.median(eval_throughput(loaded, args.eval_tokens, args.context, t)
                                      for _ in range(args.repeats))
            for t in args.threads
        }
    write_json(args.json, result)
    print(json.dumps(result, indent=2))
    return 0 if result["same_tokens"] and result["npuq_not_slower"] else 1


if __name__ == "__main__":
    sys.exit(main())
