"""Export benchmark: lower a quantized artifact to QDQ ONNX and run it like a device would.

For a given artifact (``npuq quantize --out DIR``; default: a tiny Llama quantized here at
16a8w) it measures the export time and file sizes, then feeds the same prompt through the
artifact's PT2E programs and through the exported graphs (exact ORT CPU, and the QNN HTP
backend in emulation when onnxruntime-qnn is installed) with the KV cache held as quantized
codes, and reports latency per call and the logit agreement. As a noise floor it also runs
the PT2E programs with a re-associated softmax (same maths, other float rounding): in a deep
16-bit model one flipped code compounds, so that is the agreement to expect from any
faithful re-implementation.

    .venv/bin/python bench/export.py                                  # tiny model, ~1 minute
    .venv/bin/python bench/export.py --artifact out/smollm2-16a8w --tokens 48 --htp-arch 73

Writes JSON (default out/bench/export.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def tiny_artifact(folder: Path, context: int, prefill_len: int) -> Path:
    from npuq.models.tiny import tiny_decoder
    from npuq.quant.artifact import save_artifact
    from npuq.quant.pipeline import quantize_model
    from npuq.quant.recipe import load_recipe

    _, model = tiny_decoder("llama", max_context=context)
    tokens = torch.randint(0, model.config.vocab_size, (4 * context,), generator=torch.Generator().manual_seed(0))
    qm = quantize_model(model, load_recipe(None, "16a8w"), tokens.tolist(), context=context, prefill_len=prefill_len)
    return save_artifact(qm, folder / "tiny-llama-16a8w")


class Reassociated:
    """A PT2E program whose softmax is computed as exp(x - max) / sum: the same function with
    a different float rounding. Its distance to the original is the noise floor any other
    implementation (ONNX Runtime, the HTP) must be judged against."""

    def __init__(self, gm):
        import torch.fx

        class Interp(torch.fx.Interpreter):
            def call_function(self, target, args, kwargs):
                if target in (torch.ops.aten.softmax.int, torch.ops.aten._softmax.default):
                    x = args[0]
                    e = torch.exp(x - x.amax(args[1], keepdim=True))
                    return e / e.sum(args[1], keepdim=True)
                return super().call_function(target, args, kwargs)

        self.interp = Interp(gm)

    def __call__(self, *args):
        with torch.no_grad():
            return self.interp.run(*args)


class Timed:
    """Wraps a graph callable and records the seconds of each call by ar_len."""

    def __init__(self, graph, log):
        self.graph, self.log = graph, log

    def __call__(self, *args):
        start = time.perf_counter()
        out = self.graph(*args)
        self.log.setdefault(int(args[0].shape[1]), []).append(time.perf_counter() - start)
        return out


def run(graphs, cfg, context, tokens, prompt):
    """``prompt`` tokens through prefill chunks, then one call per remaining token (the runner
    uses the decode graph once a prefill chunk no longer fits the context)."""
    from npuq.runtime.runner import StaticRunner

    log: dict[int, list[float]] = {}
    runner = StaticRunner(cfg, {k: Timed(g, log) for k, g in graphs.items()}, context)
    ids = tokens[0].tolist()
    logits = [runner.feed(ids[:prompt])] + [runner.feed([t]) for t in ids[prompt:]]
    return torch.cat(logits, dim=1), {f"ar{k}_ms": 1000 * sum(v) / len(v) for k, v in sorted(log.items())}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", help="artifact folder (default: quantize a tiny Llama here)")
    p.add_argument("--qnn-version", default="2.51")
    p.add_argument("--htp-arch", type=int, default=73)
    p.add_argument("--tokens", type=int, default=0, help="tokens fed (default: the whole context); the "
                   "prompt leaves room for 8 decode steps")
    p.add_argument("--no-noise-floor", dest="noise_floor", action="store_false",
                   help="skip the PT2E-vs-PT2E (re-associated softmax) reference run")
    p.add_argument("--out", default="out/bench/export.json")
    args = p.parse_args(argv)

    from npuq.lower.export import export_artifact
    from npuq.models.config import ModelConfig
    from npuq.quant.artifact import load_artifact
    from npuq.runtime.ort import load_export, qnn_available

    work = Path(tempfile.mkdtemp(prefix="npuq-bench-export-"))
    artifact = Path(args.artifact) if args.artifact else tiny_artifact(work, 32, 8)
    export_dir = work / "export"
    result = export_artifact(artifact, export_dir, qnn_version=args.qnn_version, htp_arch=args.htp_arch)
    manifest = json.loads((export_dir / "manifest.json").read_text())
    cfg = ModelConfig.from_dict(manifest["model_config"])
    context = manifest["context"]
    n = min(args.tokens or context, context)
    prefill_len = max(g["ar_len"] for g in manifest["graphs"].values())
    prompt = max(1, min(n - 1, context - prefill_len + 1, n - 8))
    tokens = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(1))

    qm = load_artifact(artifact)
    ref, ref_times = run(qm.graphs(), cfg, context, tokens, prompt)
    report = {
        "artifact": str(artifact),
        "context": context,
        "tokens": n,
        "prompt_tokens": prompt,
        "export_seconds": round(result["seconds"], 2),
        "qnn_version": result["qnn_version"],
        "htp_arch": result["htp_arch"],
        "embedding_pattern": result["embedding_pattern"],
        "onnx_bytes": {k: (export_dir / g["file"]).stat().st_size for k, g in manifest["graphs"].items()},
        "pt2e": ref_times,
        "providers": {},
    }
    scale = float(ref.abs().max())

    def agreement(logits):
        err = (logits - ref).abs()
        return {"max_abs_logit_diff": float(err.max()), "max_rel_logit_diff": float(err.max()) / scale,
                "argmax_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean())}

    if args.noise_floor:
        floor, _ = run({k: Reassociated(g) for k, g in qm.graphs().items()}, cfg, context, tokens, prompt)
        report["noise_floor_pt2e_reassociated_softmax"] = agreement(floor)
    for provider in ("cpu", "htp"):
        if provider == "htp" and qnn_available():
            report["providers"]["htp"] = {"skipped": qnn_available()}
            continue
        start = time.perf_counter()
        _, graphs = load_export(export_dir, provider)
        setup = time.perf_counter() - start
        logits, times = run(graphs, cfg, context, tokens, prompt)
        report["providers"][provider] = {
            "session_seconds": round(setup, 3), **{k: round(v, 3) for k, v in times.items()}, **agreement(logits),
        }
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
