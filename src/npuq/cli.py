"""The ``npuq`` command line: thin subcommands over typed functions.

Each subcommand parses its flags, calls one function of the library, prints a human summary
and returns a JSON-able dict; ``--json FILE`` (or ``--json -`` for stdout) writes that dict.
User errors (:class:`npuq.errors.NpuqError`) print one line and exit with status 2;
``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from npuq.errors import NpuqError


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _pos_int(text: str) -> int:
    value = _nonneg_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be at least 1, got 0")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE ('-' for stdout)")
    p.add_argument("--debug", action="store_true", help="show the Python traceback on errors")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="smollm2-135m", metavar="M",
        help="a built-in name (smollm2-135m, gemma3-270m), a Hugging Face folder "
             "(config.json + *.safetensors + tokenizer) or a .gguf file (default: smollm2-135m)",
    )


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-threads", type=_nonneg_int, default=0, metavar="N",
        help="CPU threads for torch (0 = automatic, the default)",
    )


# --------------------------------------------------------------------------- info
def cmd_info(args: argparse.Namespace) -> dict[str, Any]:
    from npuq.models import load_model

    loaded = load_model(args.model)
    result = loaded.info()
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    return result


# --------------------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    from npuq.models import load_model
    from npuq.runtime.generate import generate

    graphs, context = None, args.context
    if args.artifact or args.onnx:
        from npuq.runtime.programs import open_programs

        programs = open_programs(artifact=args.artifact, onnx=args.onnx, provider=args.provider)
        graphs, context = programs.graphs, programs.context  # the graphs' shapes fix the context
        loaded = load_model(programs.model_source)
    else:
        loaded = load_model(args.model)
    result = generate(
        loaded, args.prompt, max_new_tokens=args.max_new_tokens, context=context,
        prefill_len=args.prefill_len, num_threads=args.num_threads, graphs=graphs,
    )
    print(args.prompt + result["text"])
    print(
        f"[{len(result['token_ids'])} tokens, prefill {result['prefill_seconds']:.2f} s, "
        f"{result['tokens_per_second']:.1f} tokens/s decode, {result['threads']} threads]",
        file=sys.stderr,
    )
    return result


# --------------------------------------------------------------------------- eval
def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    from npuq.data import load_corpus
    from npuq.eval.perplexity import check_context, evaluate_model
    from npuq.models import DEFAULT_MAX_CONTEXT, load_model

    check_context(args.context)  # cheap checks before the model loads
    documents = load_corpus(args.corpus, args.split)
    if args.artifact or args.onnx:
        result = _eval_quantized(args, documents)
    else:
        loaded = load_model(args.model, max_context=args.context if args.context > DEFAULT_MAX_CONTEXT else None)
        check_context(args.context, loaded.config.max_position_embeddings)
        result = evaluate_model(
            loaded, documents, args.context, batch_size=args.batch_size, max_docs=args.max_docs,
            max_tokens=args.max_tokens, num_threads=args.num_threads, progress=True,
        )
    result["corpus"] = args.corpus
    result["split"] = None if args.corpus.startswith("file:") else args.split
    print(
        f"word perplexity {result['word_perplexity']:.4f}, byte perplexity {result['byte_perplexity']:.4f}, "
        f"bits per byte {result['bits_per_byte']:.4f}"
    )
    print(
        f"[{result['tokens']} tokens, {result['words']} words, {result['bytes']} bytes in {result['documents']} "
        f"documents, context {result['context']}, {result['seconds']:.1f} s, {result['threads']} threads]",
        file=sys.stderr,
    )
    return result


def _eval_quantized(args: argparse.Namespace, documents: Any) -> dict[str, Any]:
    """Perplexity of a quantized artifact (PT2E QDQ programs) or an exported ONNX folder, run
    through prefill and decode graphs from an empty cache, as on the device."""
    from npuq.eval.perplexity import evaluate_perplexity
    from npuq.models import load_model
    from npuq.runtime.programs import open_programs
    from npuq.threads import scope_or_keep

    programs = open_programs(artifact=args.artifact, onnx=args.onnx, provider=args.provider)
    if args.context > programs.context:
        raise NpuqError(f"--context {args.context} exceeds the {programs.context} tokens the graphs were built for: "
                        f"use --context {programs.context} or less")
    tokenizer = load_model(programs.model_source).tokenizer
    with scope_or_keep(args.num_threads) as threads:
        result = evaluate_perplexity(programs.logits, tokenizer, documents, args.context, max_docs=args.max_docs,
                                     max_tokens=args.max_tokens, progress=True)
    return {**result, **programs.describe(), "threads": threads}


# --------------------------------------------------------------------------- tune-threads
def cmd_tune_threads(args: argparse.Namespace) -> dict[str, Any]:
    from npuq.models import load_model
    from npuq.threads import cpu_limits, tune_cached
    from npuq.threads.workloads import PHASES, phase_workload

    phases = list(PHASES) if "all" in args.phase else list(dict.fromkeys(args.phase))
    loaded = load_model(args.model)
    limits = cpu_limits()
    print(f"ceiling {limits.ceiling} threads (affinity {limits.affinity} CPUs, cgroup quota "
          f"{limits.quota or 'none'})", file=sys.stderr)
    results = []
    for phase in phases:
        workload = phase_workload(loaded.model, phase, args.context, args.prefill_len if phase == "prefill" else None)

        def progress(n: int, seconds: float | None, phase: str = phase) -> None:
            shown = "failed" if seconds is None else f"{seconds * 1e3:.1f} ms"
            print(f"  {phase:<9} {n:>3} threads  {shown}", file=sys.stderr)

        results.append(tune_cached(phase, workload, ceiling=limits.ceiling, retune=args.retune, on_candidate=progress))
    print(f"{'phase':<10}{'best':>5}{'ms/step':>10}{'default':>9}{'speedup':>9}{'tuning s':>10}  cached")
    for r in results:
        ms = "-" if r.best_seconds is None else f"{r.best_seconds * 1e3:.1f}"
        speedup = "-" if r.speedup_vs_default is None else f"{r.speedup_vs_default:.2f}x"
        print(f"{r.phase:<10}{r.best:>5}{ms:>10}{r.default_threads:>9}{speedup:>9}{r.tuning_seconds:>10.1f}  {r.cached}")
    if args.plot:
        from npuq.threads.plot import plot_results

        plot_results(results, args.plot, title=f"{args.model}, context {args.context}, ceiling {limits.ceiling}")
    return {
        "model": args.model,
        "context": args.context,
        "prefill_len": args.prefill_len,
        "affinity_cpus": limits.affinity,
        "cgroup_quota_cpus": limits.quota,
        "ceiling": limits.ceiling,
        "plan": {r.phase: r.best for r in results},
        "results": [r.to_dict() for r in results],
    }


# --------------------------------------------------------------------------- quantize
def cmd_quantize(args: argparse.Namespace) -> dict[str, Any]:
    from npuq.quant.run import quantize_to_artifact

    result, summary = quantize_to_artifact(
        args.model, args.out, scheme=args.scheme, recipe=args.recipe, corpus=args.calib_corpus,
        calib_tokens=args.calib_tokens, context=args.context, calibration_mode=args.calibration_mode,
        prefill_len=args.prefill_len, batch_size=args.batch_size, num_threads=args.num_threads,
        force=args.force, progress=True, seq_mse=args.seq_mse, seq_mse_granularity=args.seq_mse_granularity,
        weight_rounding=args.weight_rounding,
    )
    if args.recipe_summary:
        print(summary)
    print(
        f"{result['artifact']}: {result['scheme']} ({result['recipe']}), {result['calibration_mode']} calibration on "
        f"{result['calibration_tokens']} tokens in {result['calibration_seconds']:.1f} s "
        f"(prepare {result['prepare_seconds']:.1f} s, convert {result['convert_seconds']:.1f} s, "
        f"total {result['total_seconds']:.1f} s, {result['threads']} threads)"
    )
    return result


# --------------------------------------------------------------------------- export
def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    from npuq.lower.export import export_artifact

    result = export_artifact(
        args.artifact, args.out, qnn_version=args.qnn_version, htp_arch=args.htp_arch, soc=args.soc,
        embedding_pattern=args.embedding_pattern, embedding_storage=args.embedding_storage, force=args.force,
    )
    qnn = f"QNN {result['qnn_version']} ({result['qnn_version_source']})" if result["qnn_version"] else "QNN version unknown"
    arch = f"HTP v{result['htp_arch']}" if result["htp_arch"] else "HTP arch unknown"
    print(f"{args.out}: decode.onnx, prefill.onnx, manifest.json for {qnn}, {arch}; "
          f"embedding pattern {result['embedding_pattern']} [{result['seconds']:.1f} s]")
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npuq",
        description="Quantize Hugging Face decoder LLMs for Qualcomm HTP-class NPUs: calibrate, "
                    "recover accuracy, evaluate, lower and export QDQ ONNX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="describe a model: architecture, sizes, context, tied embeddings",
                       description="Load a model and print its architecture facts.")
    _add_model(p)
    _add_common(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="greedy text generation through the static prefill/decode graphs",
                       description="Run the static graphs the way a device runner does: prefill in "
                                   "AR-N chunks, then AR-1 decode steps writing the KV cache.")
    _add_model(p)
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=_pos_int, default=32, metavar="N", help="tokens to generate (default 32)")
    p.add_argument("--context", type=_pos_int, default=512, metavar="L",
                   help="context length of the static graphs: prompt + new tokens must fit (default 512)")
    p.add_argument("--prefill-len", type=_pos_int, default=32, metavar="N",
                   help="tokens per prefill (AR-N) call (default 32)")
    quantized = p.add_mutually_exclusive_group()
    quantized.add_argument("--artifact", metavar="DIR", help="generate with a quantized artifact's QDQ programs "
                           "(their context and prefill length apply)")
    quantized.add_argument("--onnx", metavar="DIR", help="generate with an exported folder's ONNX graphs")
    p.add_argument("--provider", choices=("cpu", "htp"), default="cpu",
                   help="with --onnx: ONNX Runtime's CPU provider or the QNN HTP backend (default: cpu)")
    _add_threads(p)
    _add_common(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="perplexity on a corpus, as lm-evaluation-harness's wikitext task reports it",
                       description="Score every token of each document once in disjoint rolling windows "
                                   "and report word perplexity, byte perplexity and bits per byte.")
    _add_model(p)
    p.add_argument("--corpus", default="builtin", metavar="C",
                   help="builtin (Python's own documentation, offline), file:PATH (.txt = one document, "
                        ".jsonl = {\"text\": ...} per line) or wikitext2 (needs the datasets library) "
                        "(default: builtin)")
    p.add_argument("--split", choices=("eval", "calib"), default="eval",
                   help="which half of builtin / wikitext2 (test / train) to score; files have no split (default: eval)")
    p.add_argument("--context", type=_nonneg_int, default=512, metavar="L",
                   help="tokens per window, 2 to the model's limit (default 512)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-docs", type=_pos_int, metavar="N", help="score only the first N documents")
    budget.add_argument("--max-tokens", type=_pos_int, metavar="N",
                        help="score only the first N tokens (whole documents, the last one cut)")
    p.add_argument("--batch-size", type=_pos_int, default=4, metavar="N",
                   help="windows of equal length per forward of the float model (default 4)")
    quantized = p.add_mutually_exclusive_group()
    quantized.add_argument("--artifact", metavar="DIR",
                           help="evaluate a quantized artifact ('npuq quantize --out'): its QDQ prefill and decode "
                                "programs, run from an empty cache as on the device (instead of --model)")
    quantized.add_argument("--onnx", metavar="DIR", help="evaluate an exported folder ('npuq export --out') with ONNX Runtime")
    p.add_argument("--provider", choices=("cpu", "htp"), default="cpu",
                   help="with --onnx: cpu (exact QDQ reference, graph optimizations off) or htp (the QNN HTP "
                        "backend of onnxruntime-qnn, emulated on the CPU, fallback disabled) (default: cpu)")
    _add_threads(p)
    _add_common(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("tune-threads", help="measure the fastest CPU thread count of each phase and cache it",
                       description="Time one float forward of each phase at a few thread counts up to the "
                                   "CPUs this process may use (affinity mask and cgroup quota) and keep the "
                                   "fastest; results are cached per CPU model, ceiling, torch version and "
                                   "workload, so later runs and --num-threads 0 reuse them.")
    _add_model(p)
    p.add_argument("--phase", action="append", required=True, choices=("decode", "prefill", "calibrate", "all"),
                   help="phase to tune, repeatable: decode (AR-1 step), prefill (AR-N chunk), calibrate "
                        "(a whole context at once) or all")
    p.add_argument("--context", type=_pos_int, default=512, metavar="L",
                   help="context length of the static graphs (default 512)")
    p.add_argument("--prefill-len", type=_pos_int, default=32, metavar="N",
                   help="tokens per prefill (AR-N) call (default 32)")
    p.add_argument("--retune", action="store_true", help="measure again even if the cache has a result")
    p.add_argument("--plot", metavar="PNG", help="also draw time per step against thread count to PNG")
    _add_common(p)
    p.set_defaults(func=cmd_tune_threads)

    from npuq.quant.recipe import RECIPES
    from npuq.quant.schemes import SCHEMES

    p = sub.add_parser("quantize", help="post-training quantization for the HTP: calibrate, write decode + prefill programs",
                       description="Quantize a model the HTP way (PT2E, uint16/uint8 activations, per-channel "
                                   "weights), calibrate it on corpus text and write an artifact folder: decode.pt2 "
                                   "and prefill.pt2 with identical encodings, encodings.json and config.json.")
    _add_model(p)
    p.add_argument("--scheme", choices=list(SCHEMES), metavar="S",
                   help=f"default scheme, one of {', '.join(SCHEMES)} (default: the recipe's; smollm2-135m: 16a8w)")
    p.add_argument("--recipe", metavar="R",
                   help=f"built-in recipe ({', '.join(RECIPES)}) or a JSON file of rules; --scheme replaces its "
                        "default (default: the model's built-in recipe)")
    p.add_argument("--calib-corpus", default="builtin", metavar="C",
                   help="corpus whose calib split is the calibration text: builtin, file:PATH or wikitext2 (default: builtin)")
    p.add_argument("--calib-tokens", type=_pos_int, default=4096, metavar="N",
                   help="calibration tokens (whole windows of --context, plus one shorter tail) (default 4096)")
    p.add_argument("--context", type=_pos_int, default=512, metavar="L",
                   help="context length of the programs and calibration window (default 512)")
    p.add_argument("--prefill-len", type=_pos_int, default=None, metavar="N",
                   help="ar_len of the prefill program (default: 32, at most half the context)")
    p.add_argument("--calibration-mode", choices=("onepass", "sequential"), default="onepass",
                   help="onepass: whole windows through the calibrate graph, encodings copied to decode and "
                        "prefill (fast); sequential: the decode graph token by token (the published reference, slow)")
    p.add_argument("--batch-size", type=_pos_int, default=8, metavar="N",
                   help="windows per one-pass calibration forward (default 8)")
    p.add_argument("--seq-mse", type=int, default=None, metavar="N",
                   help="search N candidate scales per weight (coarse grid, then a fine grid around the best) "
                        "minimising the layer's output error on the calibration text; the published default is 50 "
                        "(default: off, min/max scales)")
    p.add_argument("--seq-mse-granularity", choices=("channel", "layer"), default="channel",
                   help="one scale multiplier per output channel (default) or one per layer (the published method)")
    p.add_argument("--weight-rounding", choices=("nearest", "gptq"), default="nearest",
                   help="round weights to the nearest code, or with GPTQ's error compensation (same int format)")
    p.add_argument("--recipe-summary", action="store_true", help="print which rule and scheme each layer got")
    p.add_argument("--out", required=True, metavar="DIR", help="artifact folder to write (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder (only once the new one is complete)")
    _add_threads(p)
    _add_common(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("export", help="lower a quantized artifact to QDQ ONNX for the QNN HTP (decode + prefill + manifest)",
                       description="Lower the artifact's decode and prefill programs to opset-21 QDQ ONNX graphs "
                                   "with static shapes and quantized KV-cache I/O, choosing patterns by the target "
                                   "QNN SDK version and HTP architecture; write manifest.json beside them.")
    p.add_argument("--artifact", required=True, metavar="DIR", help="folder written by 'npuq quantize --out'")
    p.add_argument("--out", required=True, metavar="DIR", help="export folder to write (must not exist unless --force)")
    p.add_argument("--qnn-version", metavar="X.Y[.Z]",
                   help="target QNN SDK version (default: the build id of $QNN_SDK_ROOT/lib/x86_64-linux-clang/"
                        "libQnnHtp.so, else the QNN bundled with onnxruntime-qnn, else unknown: patterns valid "
                        "on every version)")
    chip = p.add_mutually_exclusive_group()
    chip.add_argument("--htp-arch", metavar="A", help="HTP architecture: 68, 69, 73, 75, 79 or 81 "
                                                      "(16-bit x int16 attention MatMul needs 73+; default unknown: 8-bit)")
    chip.add_argument("--soc", metavar="NAME", help="target chip, e.g. SM8650 (sets --htp-arch from a table of known chips)")
    p.add_argument("--embedding-pattern", choices=("auto", "legacy", "optimized"), default="auto",
                   help="per-channel embedding lowering: legacy (any SDK; rows re-rounded at the largest row "
                        "scale), optimized (SDK >= 2.48; every row keeps its scale), auto = optimized when the SDK "
                        "is known to be >= 2.48 (default: auto)")
    p.add_argument("--embedding-storage", choices=("u16", "int8-rowscale"), default="u16",
                   help="how the optimized pattern stores the table: u16 (re-encoded to the output encoding, "
                        "2 bytes per element) or int8-rowscale (int8 codes + a gathered uint16 row-scale vector) "
                        "(default: u16)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder (only once the new one is complete)")
    _add_common(p)
    p.set_defaults(func=cmd_export)

    return parser


def _quiet_third_party_imports() -> None:
    """torchao warns at import about its CUDA-only kernels, torch about a deprecated Enum
    registration inside torchao: noise on a CPU machine, shown again with --debug."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.debug:
        _quiet_third_party_imports()
    func: Callable[[argparse.Namespace], dict[str, Any]] = args.func
    try:
        result = func(args)
        if args.json:
            from npuq.artifact import write_json

            write_json(args.json, result)
    except NpuqError as exc:
        if args.debug:
            raise
        print(f"npuq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("npuq: interrupted; nothing half-written was left behind", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
