"""npuq's float perplexity against an independent computation through Hugging Face transformers.

Both sides read the same GGUF and score the same documents in the same windows
(lm-evaluation-harness's rolling windows). The reference side rebuilds the token budget, the
windows, the log-likelihoods and the metric arithmetic with its own code and runs transformers'
own model, so a mismatch in npuq's decoder, windowing or metrics shows as a relative
difference of word perplexity above the target (0.5%).

    .venv/bin/python bench/perplexity_reference.py                   # bounded: 4096 tokens
    .venv/bin/python bench/perplexity_reference.py --max-tokens 0    # the whole builtin eval split

Writes JSON (default out/bench/perplexity_reference.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

TARGET_REL_DIFF = 0.005


def reference_windows(ids: list[int], prefix: int, context: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, scored ids) per window, built from the scored spans [0, C), [C, 2C), ...

    Span 0 is read from [prefix] + ids; a later span ending at e from the C tokens
    ids[e-1-C : e-1]. The scored ids are predicted by the last len(span) input positions.
    """
    out = []
    for start in range(0, len(ids), context):
        end = min(start + context, len(ids))
        inputs = [prefix] + ids[: end - 1] if start == 0 else ids[end - 1 - context : end - 1]
        out.append((inputs, ids[start:end]))
    return out


def transformers_perplexity(source: str, texts: list[str], context: int, max_tokens: int | None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(source)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    load_seconds = time.perf_counter() - start
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

    start = time.perf_counter()
    ll, words, nbytes, ntokens, ndocs, nwindows = 0.0, 0, 0, 0, 0, 0
    for text in texts:
        if max_tokens is not None and ntokens >= max_tokens:
            break
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            continue
        if max_tokens is not None and ntokens + len(ids) > max_tokens:
            ids = ids[: max_tokens - ntokens]
            text = tokenizer.decode(ids)  # the words and bytes of what was scored
        for inputs, targets in reference_windows(ids, prefix, context):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([inputs])).logits[0, -len(targets):].double()  # (n, V)
            logp = torch.log_softmax(logits, dim=-1)
            ll += logp[torch.arange(len(targets)), torch.tensor(targets)].sum().item()
            nwindows += 1
        ntokens += len(ids)
        words += len(re.split(r"\s+", text))
        nbytes += len(text.encode("utf-8"))
        ndocs += 1
    return {
        "word_perplexity": math.exp(-ll / words),
        "byte_perplexity": math.exp(-ll / nbytes),
        "bits_per_byte": -ll / (nbytes * math.log(2)),
        "loglikelihood": ll,
        "tokens": ntokens, "words": words, "bytes": nbytes, "documents": ndocs, "windows": nwindows,
        "load_seconds": load_seconds,
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a built-in name or .gguf file (default smollm2-135m)")
    parser.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument("--max-tokens", type=int, default=4096,
                        help="token budget, whole documents with the last one cut; 0 = the whole split (default 4096)")
    parser.add_argument("--batch-size", type=int, default=4, help="npuq's windows per forward (default 4)")
    parser.add_argument("--json", default="out/bench/perplexity_reference.json", help="where to write the result")
    args = parser.parse_args(argv)
    max_tokens = args.max_tokens or None

    from npuq.fsio import write_json
    from npuq.records import to_json
    from npuq.data import load_corpus
    from npuq.eval.perplexity import evaluate_model
    from npuq.models import load_model

    documents = load_corpus("builtin", "eval")
    start = time.perf_counter()
    loaded = load_model(args.model)
    if not loaded.source.endswith(".gguf"):
        parser.error(f"{args.model} is not a GGUF model: the reference loads the same GGUF through transformers")
    load_seconds = time.perf_counter() - start
    ours = to_json(evaluate_model(loaded, documents, args.context, batch_size=args.batch_size, max_tokens=max_tokens,
                                  progress=True))
    ours["load_seconds"] = load_seconds
    source = loaded.source
    del loaded  # free its memory before the transformers model loads

    ref = transformers_perplexity(source, [d.target for d in documents], args.context, max_tokens)
    rel = abs(ours["word_perplexity"] - ref["word_perplexity"]) / ref["word_perplexity"]
    result = {
        "model": args.model, "source": source, "corpus": "builtin", "split": "eval", "context": args.context,
        "max_tokens": max_tokens,
        "npuq": {k: ours[k] for k in ("word_perplexity", "byte_perplexity", "bits_per_byte", "loglikelihood", "tokens",
                                      "words", "bytes", "documents", "windows", "load_seconds", "seconds", "threads")},
        "transformers": ref,
        "word_perplexity_rel_diff": rel,
        "target_rel_diff": TARGET_REL_DIFF,
        "within_target": rel <= TARGET_REL_DIFF,
        "same_counts": all(ours[k] == ref[k] for k in ("tokens", "words", "bytes", "documents", "windows")),
        "torch_threads": torch.get_num_threads(),
    }
    write_json(args.json, result)
    print(json.dumps(result, indent=2))
    return 0 if result.within_target and result.same_counts else 1


if __name__ == "__main__":
    sys.exit(main())
