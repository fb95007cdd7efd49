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

    loaded = load_model(args.model)
    result = generate(
        loaded, args.prompt, max_new_tokens=args.max_new_tokens, context=args.context,
        prefill_len=args.prefill_len, num_threads=args.num_threads,
    )
    print(args.prompt + result["text"])
    print(
        f"[{len(result['token_ids'])} tokens, prefill {result['prefill_seconds']:.2f} s, "
        f"{result['tokens_per_second']:.1f} tokens/s decode, {result['threads']} threads]",
        file=sys.stderr,
    )
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
    _add_threads(p)
    _add_common(p)
    p.set_defaults(func=cmd_generate)

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
