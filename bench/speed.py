"""How fast ``npuq quantize`` is, how fast its artifact scores text, and (``--with-peers``) how
fast ExecuTorch's own QNN quantization flow is on the same model and tokens.

One run measures, each as a subprocess so imports and the model load are counted:

- ``npuq quantize --scheme 16a8w --rotate none --calib-tokens 1024`` (SmolLM2-135M by default;
  no rotation by default, as ExecuTorch's flow has none: ``--rotate r1`` times npuq's default): wall time,
  and the stage split the command reports (model graph trace, prepare, calibration, convert,
  saving; the rest is Python start-up, imports, the model load, tokenizing and the thread plan);
- ``npuq eval`` of the float model and of that artifact (its QDQ programs, four windows per
  call through the scoring program) on the same ``--eval-tokens`` tokens: ms per token each and
  their ratio;
- ``npuq generate`` at ``--num-threads`` 0 (the tuned plan), 1 and 2: decode ms per token;
- ``npuq quantize`` at each ``--scaling`` calibration token count (1k, 4k, 16k): how the cost grows;
- with ``--with-peers``: ExecuTorch 1.5.1 in its own virtual environment (out/peers/executorch,
  made when missing: a CPU torch first, of the version ExecuTorch works with, then ExecuTorch),
  running torch.export + ``QnnQuantizer`` 16a8w prepare_pt2e + calibration on the same 1024
  tokens (2 × 512, the tokens npuq calibrated on) + convert_pt2e on the same GGUF, loaded through
  transformers (``gguf_file=``); the report gives npuq's wall time over ExecuTorch's four steps.
  When ExecuTorch cannot be installed or run here, the JSON says why.

Timings on a shared machine are noisy: compare the ratios of one run.

    .venv/bin/python bench/speed.py
    .venv/bin/python bench/speed.py --with-peers

Writes JSON (default out/bench/speed.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXECUTORCH = "executorch==1.5.1"
TARGET_QUANTIZE_RATIO = 0.5  # npuq quantize wall time / ExecuTorch export + prepare + calibrate + convert
TARGET_EVAL_RATIO = 2.0  # QDQ programs' ms/token / the float model's


def run(argv: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> tuple[float, str]:
    """(wall seconds, stderr tail) of a command that must succeed."""
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc.stderr[-2000:]


def npuq(*args: str) -> list[str]:
    return [sys.executable, "-m", "npuq.cli", *args]


def quantize(args: argparse.Namespace, work: Path) -> dict:
    """Quantize twice: the first run on a host also tunes the thread count of the calibration
    forwards once (then cached); the second is what every later run costs, the figure compared."""
    first = _quantize_once(args, work)
    warm = _quantize_once(args, work)
    warm["first_run_on_this_host_wall_seconds"] = first["wall_seconds"]
    return warm


def scaling(args: argparse.Namespace, work: Path) -> dict:
    """Quantize wall time and its calibration seconds at each of ``--scaling`` calibration token
    counts (thread plan cached): the calibration should grow with the tokens, the rest stay put."""
    out = {}
    for n in args.scaling:
        r = _quantize_once(args, work, n)
        out[str(n)] = {"wall_seconds": r["wall_seconds"], "calibrate_seconds": r["stages_seconds"]["calibrate"],
                       "other_seconds": round(r["wall_seconds"] - r["stages_seconds"]["calibrate"], 2)}
    return out


def _quantize_once(args: argparse.Namespace, work: Path, calib_tokens: int | None = None) -> dict:
    artifact, result = work / "artifact", work / "quantize.json"
    wall, _ = run(npuq("quantize", "--model", args.model, "--scheme", args.scheme, "--rotate", args.rotate, "--calib-tokens",
                       str(calib_tokens or args.calib_tokens), "--out", str(artifact), "--force", "--json", str(result)))
    r = json.loads(result.read_text())
    export = r.get("export_seconds") or 0.0
    stages = {
        "trace": export,
        "prepare": r["prepare_seconds"] - export,
        "calibrate": r["calibration_seconds"],
        "convert": r["convert_seconds"],
        "save": r.get("save_seconds") or 0.0,
    }
    stages["load, tokens, thread plan"] = r["total_seconds"] - sum(stages.values())
    stages["start-up (python, imports)"] = wall - r["total_seconds"]
    files = {p.name: p.stat().st_size for p in sorted(artifact.iterdir())}
    return {"wall_seconds": round(wall, 2), "stages_seconds": {k: round(v, 2) for k, v in stages.items()},
            "threads": r["threads"], "artifact": str(artifact), "artifact_bytes": sum(files.values()), "files": files}


def evaluate(args: argparse.Namespace, work: Path, artifact: str) -> dict:
    out = {}
    for name, source in (("float", ["--model", args.model]), ("artifact", ["--artifact", artifact])):
        result = work / f"eval-{name}.json"
        wall, _ = run(npuq("eval", *source, "--max-tokens", str(args.eval_tokens), "--json", str(result)))
        r = json.loads(result.read_text())
        out[name] = {"ms_per_token": round(1000 * r["seconds"] / r["tokens"], 3), "tokens": r["tokens"],
                     "seconds": round(r["seconds"], 2), "wall_seconds": round(wall, 2), "threads": r.get("threads"),
                     "word_perplexity": r.get("word_perplexity")}
    out["ratio"] = round(out["artifact"]["ms_per_token"] / out["float"]["ms_per_token"], 3)
    out["target_ratio"] = TARGET_EVAL_RATIO
    return out


def threads(args: argparse.Namespace, work: Path) -> dict:
    """``npuq generate`` of ``--gen-tokens`` tokens at ``--num-threads`` 0 (the tuned plan), 1
    and 2, interleaved ``--repeats`` times; decode ms/token, best of the repeats. The automatic
    plan should never be slower than the better fixed count (issue #14's check)."""
    counts = (0, 1, 2)
    seen: dict[int, list[float]] = {n: [] for n in counts}
    chosen = None
    for _ in range(args.repeats):
        for n in counts:
            result = work / f"generate-{n}.json"
            run(npuq("generate", "--model", args.model, "--prompt", "The history of the printing press begins in",
                     "--max-new-tokens", str(args.gen_tokens), "--num-threads", str(n), "--json", str(result)))
            r = json.loads(result.read_text())
            seen[n].append(1000 / r["tokens_per_second"])
            if n == 0:
                chosen = r["threads"]
    best = {n: round(min(v), 2) for n, v in seen.items()}
    return {"decode_ms_per_token": {("auto" if n == 0 else str(n)): best[n] for n in counts},
            "auto_chose": chosen, "tokens": args.gen_tokens, "repeats": args.repeats,
            "auto_over_best_fixed": round(best[0] / min(best[1], best[2]), 3)}


# --------------------------------------------------------------------------- ExecuTorch
PEER_SCRIPT = r'''
import json, sys, time
import torch
spec = json.loads(sys.argv[1])
from transformers import AutoModelForCausalLM
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
torch.set_num_threads(spec["threads"])
gguf = spec["gguf"]
model = AutoModelForCausalLM.from_pretrained(gguf.rsplit("/", 1)[0], gguf_file=gguf.rsplit("/", 1)[1],
                                             dtype=torch.float32, local_files_only=True).eval()

class Logits(torch.nn.Module):
    def __init__(self, m):
        super().__init__()
        self.m = m
    def forward(self, input_ids):
        return self.m(input_ids=input_ids, use_cache=False).logits

window = spec["window"]
ids = torch.tensor(spec["tokens"], dtype=torch.long).view(-1, window)
times = {}
with torch.no_grad():
    t = time.perf_counter()
    graph = torch.export.export(Logits(model), (ids[:1],)).module()
    times["export"] = time.perf_counter() - t
    t = time.perf_counter()
    quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(QuantDtype.use_16a8w, is_linear_per_channel=True)
    prepared = prepare_pt2e(graph, quantizer)
    times["prepare"] = time.perf_counter() - t
    t = time.perf_counter()
    for row in ids:
        prepared(row[None])
    times["calibrate"] = time.perf_counter() - t
    t = time.perf_counter()
    convert_pt2e(prepared)
    times["convert"] = time.perf_counter() - t
import executorch
print(json.dumps({"seconds": times, "torch": torch.__version__, "executorch": getattr(executorch, "__version__", "?")}))
'''


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _executorch_torch_pin(python: Path, work: Path) -> str | None:
    """The torch version ExecuTorch's metadata requires (None when it names none)."""
    from email.parser import Parser
    import zipfile

    run([str(python), "-m", "pip", "download", "--no-deps", EXECUTORCH, "-d", str(work / "dl")], timeout=900)
    wheel = next((work / "dl").glob("executorch-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    pins = [r for r in requires if r.replace(" ", "").startswith("torch") and not r.startswith(("torchao", "torchvision"))]
    return pins[0].split(";")[0].strip() if pins else None


def prepare_peer(venv: Path, work: Path) -> dict:
    """Make the ExecuTorch virtual environment if missing; returns what was installed (or why not)."""
    python = _venv_python(venv)
    info: dict = {"venv": str(venv)}
    if python.exists():
        check = subprocess.run([str(python), "-c", "import executorch, torch; print(torch.__version__, torch.version.cuda)"],
                               capture_output=True, text=True)
        if check.returncode == 0:
            info["torch"] = check.stdout.strip()
            return info
    venv.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", str(venv)])
    pin = _executorch_torch_pin(python, work)
    import torch

    # ExecuTorch 1.5.1 names no torch version; it is built against torch 2.13, the one npuq's own
    # environment runs, so that version (its CPU build) goes in first.
    wanted = pin or f"torch=={torch.__version__.split('+')[0]}"
    info["torch_requirement"] = pin or f"none in ExecuTorch's metadata; installing {wanted} (npuq's)"
    run([str(python), "-m", "pip", "install", wanted, "--only-binary", ":all:"], timeout=1800)
    cuda = subprocess.run([str(python), "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                          capture_output=True, text=True).stdout.strip()
    info["torch"] = cuda
    if not cuda.endswith("None"):
        raise RuntimeError(f"only a CUDA build of torch was installable ({cuda}); ExecuTorch needs a CPU torch here")
    run([str(python), "-m", "pip", "install", EXECUTORCH, "transformers", "gguf", "accelerate"], timeout=1800)
    return info


def peer(args: argparse.Namespace, work: Path, npuq_wall: float) -> dict:
    out: dict = {"requested": EXECUTORCH}
    venv = ROOT / "out" / "peers" / "executorch"
    try:
        out.update(prepare_peer(venv, work))
    except Exception as exc:  # record why, keep the npuq figures
        out["error"] = f"cannot install ExecuTorch here: {exc}"[:4000]
        return out
    from npuq.data.corpora import corpus_tokens, load_corpus
    from npuq.models import load_model

    loaded = load_model(args.model)
    if not str(loaded.source).endswith(".gguf"):
        out["error"] = f"{args.model} is not a GGUF model: the peer loads the same GGUF through transformers"
        return out
    tokens = corpus_tokens(loaded.tokenizer, load_corpus("builtin", "calib"), args.calib_tokens)
    window = 512
    tokens = list(tokens)[: (len(tokens) // window) * window]
    spec = {"gguf": str(loaded.source), "tokens": tokens, "window": window, "threads": os.cpu_count() or 1}
    try:
        proc = subprocess.run([str(_venv_python(venv)), "-c", PEER_SCRIPT, json.dumps(spec)], capture_output=True,
                              text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception as exc:
        out["error"] = f"ExecuTorch's flow failed: {exc}"[:4000]
        return out
    seconds = result["seconds"]
    total = sum(seconds.values())
    out.update(seconds={k: round(v, 2) for k, v in seconds.items()}, total_seconds=round(total, 2),
               torch=result["torch"], executorch=result["executorch"], calibration_tokens=len(tokens),
               npuq_over_executorch=round(npuq_wall / total, 3), target_ratio=TARGET_QUANTIZE_RATIO)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--scheme", default="16a8w")
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--rotate", default="none", help="npuq quantize --rotate (default none: ExecuTorch's flow has no rotation)")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--gen-tokens", type=int, default=96, help="tokens generated per run of the thread check")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats of the thread check")
    p.add_argument("--scaling", type=int, nargs="*", default=[1024, 4096, 16384],
                   help="calibration token counts for the scaling check (none: skip it)")
    p.add_argument("--with-peers", action="store_true", help="also time ExecuTorch 1.5.1's QnnQuantizer flow")
    p.add_argument("--out", default=str(ROOT / "out" / "bench" / "speed.json"))
    args = p.parse_args()
    report: dict = {"model": args.model, "scheme": args.scheme, "rotate": args.rotate, "calibration_tokens": args.calib_tokens,
                    "host_cpus": os.cpu_count(), "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="npuq-speed-") as tmp:
        work = Path(tmp)
        report["quantize"] = quantize(args, work)
        report["eval"] = evaluate(args, work, report["quantize"]["artifact"])
        report["threads"] = threads(args, work)
        if args.scaling:
            report["scaling"] = scaling(args, work)
        if args.with_peers:
            report["executorch"] = peer(args, work, report["quantize"]["wall_seconds"])
    report["quantize"].pop("artifact")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
