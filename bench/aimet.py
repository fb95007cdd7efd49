"""AIMET's own readers on every export kind (docs/design.md §11).

    python bench/aimet.py [--model smollm2-135m] [--kinds 16a8w,16a4w,16a4w_block,kv8]
                          [--context 256] [--calib-tokens 1024] [--work out/bench/aimet]
                          [--json out/bench/aimet.json] [--setup-only]

Makes (once) a venv of its own with aimet-onnx 2.42.0 at out/aimet-venv: AIMET's dependencies
would otherwise pull a CUDA build of torch, so a constraints file pins the CPU torch 2.13.0
(which pip takes from this machine's wheel cache). Then for each kind it quantizes the model
(``npuq quantize``: 16a8w, 16a4w, 16a4w_block, and kv8 = 16a4w_block with an 8-bit KV cache),
exports it (``npuq export --soc SM8650``), writes each graph as AIMET's importer takes it
(``npuq.lower.aimet.aimet_import_graph``) and runs ``bench/aimet_check.py`` in AIMET's venv:
``from_onnx_qdq`` on both graphs, AIMET's parse of every LPBQ entry against the graph, and
``load_encodings_to_sim`` of each graph's file on that graph's sim. Artifacts already under
--work are reused. The JSON holds per kind the seconds of each step and the checker's report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / "out" / "aimet-venv"
CONSTRAINTS = REPO / "out" / "aimet-constraints.txt"
AIMET_ONNX = "aimet-onnx==2.42.0"
TORCH = "torch==2.13.0"  # the CPU build; any other release would be a CUDA download of several GB
KINDS = {"16a8w": {"default": "16a8w"}, "16a4w": {"default": "16a4w"},
         "16a4w_block": {"default": "16a4w_block"}, "kv8": {"default": "16a4w_block", "kv_bits": 8}}


def setup() -> Path:
    """AIMET's venv (made when missing); returns its python."""
    python = VENV / "bin" / "python"
    if python.is_file() and subprocess.run([str(python), "-c", "import aimet_onnx"], capture_output=True).returncode == 0:
        return python
    CONSTRAINTS.parent.mkdir(parents=True, exist_ok=True)
    CONSTRAINTS.write_text(TORCH + "\n")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-c", str(CONSTRAINTS), TORCH, AIMET_ONNX], check=True)
    return python


def _npuq(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", "npuq.cli", *args], check=True, env=env)


def run_kind(kind: str, args: argparse.Namespace, python: Path) -> dict:
    sys.path.insert(0, str(REPO / "src"))
    import onnx

    from npuq.lower.aimet import aimet_import_graph

    work = args.work / kind
    work.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    art, out, folder = work / "artifact", work / "export", work / "aimet"
    if not (art / "config.json").is_file():
        recipe = work / "recipe.json"
        recipe.write_text(json.dumps(KINDS[kind]))
        start = time.perf_counter()
        _npuq("quantize", "--model", args.model, "--recipe", str(recipe), "--context", str(args.context),
              "--calib-tokens", str(args.calib_tokens), "--out", str(art), "--force")
        seconds["quantize"] = time.perf_counter() - start
    start = time.perf_counter()
    _npuq("export", "--artifact", str(art), "--out", str(out), "--soc", "SM8650", "--force")
    seconds["export"] = time.perf_counter() - start
    start = time.perf_counter()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for graph in ("decode", "prefill"):
        shutil.copy(out / f"{graph}.onnx", folder / f"{graph}.onnx")
        shutil.copy(out / f"{graph}.encodings.json", folder / f"{graph}.encodings.json")
        onnx.save(aimet_import_graph(onnx.load(str(out / f"{graph}.onnx"))), str(folder / f"{graph}.aimet.onnx"))
    seconds["import_graphs"] = time.perf_counter() - start
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(python), str(REPO / "bench" / "aimet_check.py"), str(folder), "--json", str(folder / "aimet.json")],
                   check=True, env=env)
    seconds["aimet"] = time.perf_counter() - start
    report = json.loads((folder / "aimet.json").read_text())
    return {"recipe": KINDS[kind], "seconds": {k: round(v, 1) for k, v in seconds.items()}, **report}


def passed(result: dict) -> bool:
    """Every graph imported and loaded, every LPBQ entry AIMET parses equal to the graph, every
    entry written back as given, and agreeing with what AIMET read from the graph itself."""
    return all(r.get("imported") and r.get("loaded") and not r["lpbq"]["wrong"]
               and r["lpbq"]["entries"] == r["lpbq"]["equal_to_graph"] and not r["written_back_differ"]
               and not r["disagree_with_graph"] and not r["graph_only"]
               for r in result["graphs"].values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--work", type=Path, default=REPO / "out" / "bench" / "aimet")
    p.add_argument("--json", type=Path, default=REPO / "out" / "bench" / "aimet.json")
    p.add_argument("--setup-only", action="store_true", help="make AIMET's venv and stop")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown kinds {unknown}: choose from {', '.join(KINDS)}")
    python = setup()
    if args.setup_only:
        print(python)
        return 0
    results = {}
    for kind in kinds:
        results[kind] = run_kind(kind, args, python)
        results[kind]["passed"] = passed(results[kind])
        print(kind, "passed" if results[kind]["passed"] else "FAILED", results[kind]["seconds"], flush=True)
    report = {"model": args.model, "context": args.context, "calib_tokens": args.calib_tokens,
              "aimet_onnx": AIMET_ONNX, "torch": TORCH, "kinds": results,
              "passed": all(r["passed"] for r in results.values())}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, args.json)
    print(f"{args.json}: {'all passed' if report['passed'] else 'FAILED'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
