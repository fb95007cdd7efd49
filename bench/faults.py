"""Malformed input never escapes as an unexpected exception: per reader, how many malformed
inputs were tried and how many gave a result, npuq's own error (NpuqError) or anything else.

The seeds are files written for a tiny Llama by npuq itself (artifact, export) or as llama.cpp
and transformers lay them out (GGUF, safetensors folder); each trial mutates one of them:
bytes overwritten (often in the header, where parsing happens), the file cut short, random
bytes, or, for JSON, a value anywhere replaced by another JSON value or a key dropped. An
escape is any exception other than NpuqError; the first few of each reader are recorded with
their type, message and the input that caused them. Target: 0 escapes.

    .venv/bin/python bench/faults.py                     # writes out/bench/faults.json and prints it
    .venv/bin/python bench/faults.py --trials 50 --seed 1

The report holds a dict of sections, each built by a function of SECTIONS; "readers" is the
one above. "resume" runs ``npuq run`` on a tiny model, interrupts it with SIGINT inside each of
several stages, resumes it, and checks that the result (encodings.json byte for byte, every
perplexity) equals an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from npuq.fsio import write_json
from npuq.errors import NpuqError

Mutation = Callable[[random.Random], bytes]


# --------------------------------------------------------------------------- mutations
def edit_bytes(seed: bytes, rng: random.Random, header: int | None = None) -> bytes:
    """Up to 8 bytes overwritten (within the first ``header`` bytes if given), then, half the
    time, the file cut at a random length."""
    buf = bytearray(seed)
    span = min(len(buf), header or len(buf))
    for _ in range(rng.randint(1, 8)):
        buf[rng.randrange(span)] = rng.randrange(256)
    if rng.random() < 0.5:
        del buf[rng.randrange(len(buf) + 1):]
    return bytes(buf)


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 16, 2**31, -(2**63), 10**30, rng.randint(-1000, 1000)])
    if kind == 3:
        return rng.choice([0.5, -0.0, 1e-300, 1e308, float("nan"), float("inf"), -float("inf"), rng.random()])
    if kind in (4, 5, 6):
        return rng.choice(["", "..", "../x.onnx", "/etc/passwd", "decode.pt2", "\x00", "full", "16a8w", "a" * 300,
                           "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(8)))])
    if kind == 7:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["file", "name", "scale", "ar_len", "inputs", "x", ""]): random_json(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def edit_json(seed: Any, rng: random.Random) -> Any:
    """A deep copy of ``seed`` with 1 to 4 edits: walk down to a random node below the root,
    replace it by a random JSON value or drop it."""
    value = json.loads(json.dumps(seed))
    for _ in range(rng.randint(1, 4)):
        parent, key, node = None, None, value
        while isinstance(node, (dict, list)) and node and (parent is None or rng.random() < 0.8):
            parent, key = node, rng.choice(sorted(node) if isinstance(node, dict) else range(len(node)))
            node = parent[key]
        if parent is None:
            value = random_json(rng)
        elif rng.random() < 0.25:
            del parent[key]
        else:
            parent[key] = random_json(rng)
    return value


def json_mutations(seed: Any) -> list[Mutation]:
    text = json.dumps(seed).encode()
    return [
        lambda rng: json.dumps(edit_json(seed, rng)).encode(),
        lambda rng: json.dumps(edit_json(seed, rng)).encode(),  # structure-aware edits: half the trials
        lambda rng: edit_bytes(text, rng, header=4096),
        lambda rng: json.dumps(random_json(rng)).encode(),
    ]


# --------------------------------------------------------------------------- readers
@dataclass
class Reader:
    name: str
    mutations: list[Mutation]
    read: Callable[[bytes, Path], Any]  # feeds the input to the reader (in a fresh folder)
    share: float = 1.0  # of --trials: loading a whole model or program costs more


def build_readers(root: Path) -> list[Reader]:
    """The readers and their seeds (a tiny Llama quantized and exported once, here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "models"))  # the tests' GGUF
    import torch  # writer, which lays a file out as llama.cpp's converter does
    from gguf_writer import write_tiny_llama_gguf

    from npuq.calibrate.encodings import read_encodings
    from npuq.data import load_corpus
    from npuq.lower.export import ExportOptions, export_artifact
    from npuq.lower.manifest import read_manifest
    from npuq.models import load_model
    from npuq.testing.tiny import tiny_decoder, tiny_hf_model
    from npuq.quantize.artifact import load_program, read_artifact, save_artifact
    from npuq.quantize.pt2e import quantize_model
    from npuq.quant.recipe import load_recipe
    from npuq.lower.ort import load_export

    hf = tiny_hf_model("llama")
    write_tiny_llama_gguf(root / "tiny.gguf", hf)
    hf.save_pretrained(root / "hf", safe_serialization=True)
    _, model = tiny_decoder("llama", max_context=16)
    tokens = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    artifact = save_artifact(quantize_model(model, load_recipe(None, "16a8w"), tokens, context=16, prefill_len=4),
                             root / "artifact")
    export_artifact(artifact, root / "onnx", ExportOptions(qnn_version="2.51", htp_arch=73))

    gguf_seed = (root / "tiny.gguf").read_bytes()
    st_seed = (root / "hf" / "model.safetensors").read_bytes()
    hf_config = json.loads((root / "hf" / "config.json").read_text())
    config = json.loads((artifact / "config.json").read_text())
    encodings = json.loads((artifact / "encodings.json").read_text())
    manifest = json.loads((root / "onnx" / "manifest.json").read_text())
    program = (artifact / "decode.json").read_bytes()
    weights = (artifact / "weights.safetensors").read_bytes()
    graph = (root / "onnx" / "decode.onnx").read_bytes()
    export_files = {p.name: p.read_bytes() for p in (root / "onnx").iterdir() if p.name != "decode.onnx"}
    recipe = {"default": "16a4w", "kv_bits": 8, "embedding": "pcq8", "lm_head": "16a8w",
              "rules": [{"op": "linear", "path": "layers\\.\\d+\\.mlp\\.down_proj", "scheme": "16a8w", "priority": 1}]}
    text = ("The quick brown fox jumps over the lazy dog. Caf\u00e9, na\u00efve, \u2028 \ufffd.\n" * 4).encode()
    jsonl = b"".join(json.dumps({"text": t}, ensure_ascii=False).encode() + b"\n"
                     for t in ["first page", "zweite Seite \u00fc", "", "third \u2028 line"])

    def in_folder(name: str, placeholders: tuple[str, ...] = (), extra: dict[str, bytes] | None = None):
        def write(data: bytes, folder: Path) -> Path:
            for p in placeholders:  # files the readers only check for
                (folder / p).write_bytes(b"")
            for p, content in (extra or {}).items():
                (folder / p).write_bytes(content)
            (folder / name).write_bytes(data)
            return folder
        return write

    def with_file(name, write, read):
        return lambda data, folder: read(write(data, folder) if name is None else write(data, folder) / name)

    hf_files = {"config.json": (root / "hf" / "config.json").read_bytes()}
    return [
        Reader("gguf", [lambda rng: edit_bytes(gguf_seed, rng, header=4096), lambda rng: edit_bytes(gguf_seed, rng),
                        lambda rng: b"GGUF" + rng.randbytes(rng.randrange(512))],
               with_file("tiny.gguf", in_folder("tiny.gguf"), lambda p: load_model(str(p))), share=0.25),
        Reader("safetensors", [lambda rng: edit_bytes(st_seed, rng, header=2048), lambda rng: edit_bytes(st_seed, rng)],
               with_file(None, in_folder("model.safetensors", extra=hf_files), lambda p: load_model(str(p))),
               share=0.25),
        Reader("hf_config.json", json_mutations(hf_config),
               with_file(None, in_folder("config.json", extra={"model.safetensors": st_seed}),
                         lambda p: load_model(str(p))), share=0.25),
        Reader("encodings.json", json_mutations(encodings),
               with_file("encodings.json", in_folder("encodings.json"), read_encodings)),
        Reader("artifact config.json", json_mutations(config),
               with_file(None, in_folder("config.json", ("decode.json", "prefill.json", "weights.safetensors")), read_artifact)),
        Reader("export manifest.json", json_mutations(manifest),
               with_file(None, in_folder("manifest.json", ("decode.onnx", "prefill.onnx")), read_manifest)),
        Reader("program graph", [lambda rng: edit_bytes(program, rng), lambda rng: edit_bytes(program, rng, header=4096)],
               with_file("decode.json", in_folder("decode.json", extra={"weights.safetensors": weights}), load_program), share=0.1),
        Reader("onnx graph", [lambda rng: edit_bytes(graph, rng), lambda rng: edit_bytes(graph, rng, header=4096)],
               with_file(None, in_folder("decode.onnx", extra=export_files), load_export), share=0.25),
        Reader("recipe .json", json_mutations(recipe),
               with_file("r.json", in_folder("r.json"), lambda p: load_recipe(str(p)))),
        Reader("corpus .txt", [lambda rng: edit_bytes(text, rng), lambda rng: rng.randbytes(rng.randrange(256))],
               with_file("c.txt", in_folder("c.txt"), lambda p: load_corpus(f"file:{p}"))),
        Reader("corpus .jsonl", [lambda rng: edit_bytes(jsonl, rng), lambda rng: rng.randbytes(rng.randrange(256)),
                                 lambda rng: b"\n".join(json.dumps(random_json(rng)).encode() for _ in range(3))],
               with_file("c.jsonl", in_folder("c.jsonl"), lambda p: load_corpus(f"file:{p}"))),
    ]


def fuzz(reader: Reader, trials: int, rng: random.Random, work: Path, keep: int = 3) -> dict[str, Any]:
    counts = {"tried": 0, "result": 0, "npuq_error": 0, "escaped": 0}
    escapes: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i in range(trials):
        data = rng.choice(reader.mutations)(rng)
        folder = work / f"{i}"
        folder.mkdir()
        counts["tried"] += 1
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # ONNX Runtime prints its fallbacks
                reader.read(data, folder)
            counts["result"] += 1
        except NpuqError:
            counts["npuq_error"] += 1
        except Exception as exc:  # noqa: BLE001  (an escape: what this benchmark counts)
            counts["escaped"] += 1
            if len(escapes) < keep:
                escapes.append({"type": type(exc).__name__, "message": str(exc)[:300],
                                "where": traceback.extract_tb(exc.__traceback__)[-1].filename.split("site-packages/")[-1],
                                "input_head": data[:200].decode("latin-1")})
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return {**counts, "seconds": time.perf_counter() - start, "escapes": escapes}


def readers_section(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="npuq-faults-") as tmp:
        root = Path(tmp)
        readers = build_readers(root)
        results = {}
        for reader in readers:
            work = root / "trials" / reader.name.replace(" ", "_")
            work.mkdir(parents=True)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # replaced bytes in corpora warn by design
                results[reader.name] = fuzz(reader, max(1, round(args.trials * reader.share)), rng, work)
            r = results[reader.name]
            print(f"{reader.name:<22}{r['tried']:>6} tried {r['result']:>6} results {r['npuq_error']:>6} NpuqError "
                  f"{r['escaped']:>4} escaped  [{r.seconds:.1f} s]", file=sys.stderr)
    return {
        "seed": args.seed,
        "readers": results,
        "tried": sum(r["tried"] for r in results.values()),
        "escaped": sum(r["escaped"] for r in results.values()),
        "ok": all(r["escaped"] == 0 for r in results.values()),
    }


def _run_argv(model: Path, text: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "npuq.cli", "run", "--model", str(model), "--calib-corpus", f"file:{text}",
            "--eval-corpus", f"file:{text}", "--context", "32", "--calib-tokens", "64", "--eval-tokens", "64",
            "--gen-tokens", "4", "--qnn-version", "2.51", "--htp-arch", "73", "--num-threads", "1", "--out", str(out)]


def _scores(report: dict[str, Any]) -> dict[str, Any]:
    """Every perplexity of a run report, without the timings."""
    return {k: (v["word_perplexity"], v["byte_perplexity"], v["tokens"]) for k, v in report["perplexity"].items()}


def resume_section(args: argparse.Namespace) -> dict[str, Any]:
    """``npuq run`` on a tiny model, interrupted (SIGINT) once per stage it can be caught in, then
    resumed; every resumed run must end with the encodings and perplexities of an uninterrupted one."""
    import os
    import signal
    import subprocess

    import torch

    from npuq.testing.tiny import save_tiny_hf_folder

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory(prefix="npuq-resume-") as tmp:
        root = Path(tmp)
        model = save_tiny_hf_folder(root / "model")
        text = root / "text.txt"
        g = torch.Generator().manual_seed(args.seed)
        text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 200, (400,), generator=g)))
        start = time.perf_counter()
        subprocess.run(_run_argv(model, text, root / "clean"), env=env, capture_output=True, check=True)
        clean_seconds = time.perf_counter() - start
        reference = _scores(json.loads((root / "clean" / "report.json").read_text()))
        encodings = (root / "clean" / "artifact" / "encodings.json").read_bytes()
        trials = []
        for stage in ("quantize", "eval-quantized", "layers", "export"):
            out = root / f"cut-{stage}"
            proc = subprocess.Popen(_run_argv(model, text, out), env=env, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True)
            caught = None
            while proc.poll() is None:
                with contextlib.suppress(OSError, ValueError):
                    caught = json.loads((out / "RUNNING").read_text()).get("stage")
                if caught == stage:
                    time.sleep(0.5)
                    proc.send_signal(signal.SIGINT)
                    break
                time.sleep(0.1)
            _, err = proc.communicate()
            leftovers = sorted(p.name for p in (out / "stages").iterdir() if p.name.startswith(".")) \
                if (out / "stages").is_dir() else []
            resumed = subprocess.run(_run_argv(model, text, out), env=env, capture_output=True, text=True)
            report = json.loads((out / "report.json").read_text()) if resumed.returncode == 0 else {}
            same = (resumed.returncode == 0 and _scores(report) == reference
                    and (out / "artifact" / "encodings.json").read_bytes() == encodings)
            trials.append({
                "interrupted_in": caught, "exit_status": proc.returncode, "temporary_leftovers": leftovers,
                "resume_reported": "was interrupted" in resumed.stderr,
                "reused_on_resume": [s["stage"] for s in report.get("stages", []) if s["cached"]],
                "same_encodings_and_perplexity": same,
            })
            print(f"SIGINT in {caught}: exit {proc.returncode}, resumed reusing "
                  f"{trials[-1]['reused_on_resume']}, same result: {same}", file=sys.stderr)
    return {
        "uninterrupted_seconds": clean_seconds,
        "trials": trials,
        "ok": all(t["exit_status"] == 130 and not t["temporary_leftovers"] and t["resume_reported"]
                  and t["same_encodings_and_perplexity"] for t in trials),
    }


# name → function(args) → JSON-able dict with "ok" (the target met)
SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {"readers": readers_section,
                                                                        "resume": resume_section}


def main(argv: list[str] | None = None) -> int:
    import logging

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=400, help="malformed inputs per reader (model and program "
                   "loads take a quarter and a tenth of it) (default 400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--section", action="append", choices=list(SECTIONS), help="repeatable (default: all)")
    p.add_argument("--json", default="out/bench/faults.json", metavar="FILE", help="'-' for stdout only")
    args = p.parse_args(argv)
    for name in ("torchao", "torch", "transformers", "npuq"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # rejected inputs log warnings by the thousand

    start = time.perf_counter()
    report: dict[str, Any] = {"sections": {}}
    for name in args.section or list(SECTIONS):
        report["sections"][name] = SECTIONS[name](args)
    report["seconds"] = time.perf_counter() - start
    if args.json != "-":
        write_json(args.json, report)
    print(json.dumps(report, indent=2))
    return 0 if all(section.get("ok", True) for section in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
