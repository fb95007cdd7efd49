"""Export benchmark: lower a quantized artifact to QDQ ONNX and run it like a device would.

For a given artifact (``npuq quantize --out DIR``; default: a tiny Llama quantized here at
16a8w) it exports the artifact once per ``--embedding-pattern`` and measures:

- **the export's time**, in total and split into its phases (``export_phases_seconds``):
  load (reading the artifact's programs), lower (PT2E graph → ONNX model), serialize (encoding the
  models) and write (files, sha256, manifest); ``--export-only`` stops there;

- **perplexity on real text** (``--corpus``, eval split, at most ``--max-tokens`` tokens, the
  windows of ``npuq eval``): the artifact's PT2E QDQ programs and every export on the exact
  ORT CPU provider score the *same* windows, and the logits of each window are compared
  element by element (max/mean difference, share within one step of the logits' output
  encoding, argmax agreement). As a noise floor the PT2E programs also run with a
  re-associated softmax (same maths, other float rounding): in a deep 16-bit model one
  flipped code compounds, so that is the agreement to expect from any faithful
  re-implementation, in logits and in perplexity;
- **random tokens** (``--tokens``): the same comparison on random ids through prefill and
  decode (the original check; off by default for an artifact);
- **the QNN HTP backend** (emulated, CPU fallback disabled; when onnxruntime-qnn is installed):
  the decode graph alone, one call per token for the first ``--htp-tokens`` tokens of the
  first text window, against ORT CPU and the PT2E decode program on the same calls (the HTP
  runs the first ``--embedding-pattern``'s export).

The tiny model has a 256-token vocabulary, so it reads the text as UTF-8 bytes.

    .venv/bin/python bench/export.py                                  # tiny model, < 1 minute
    .venv/bin/python bench/export.py --artifact out/bench/smollm2-16a8w --tokens 256 \
        --out out/bench/export-smollm2-16a8w.json                     # ~9 minutes on 2 vCPUs
    .venv/bin/python bench/export.py --artifact out/bench/smollm2-16a8w-pcq8 \
        --embedding-pattern optimized legacy --htp-tokens 4 --no-noise-floor \
        --out out/bench/export-smollm2-16a8w-pcq8.json
    .venv/bin/python bench/export.py --artifact out/bench/smollm2-16a8w --export-only \
        --out out/bench/export-time-smollm2-16a8w.json                # the export's time alone

Writes JSON (default out/bench/export.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch


def tiny_artifact(folder: Path, context: int, prefill_len: int) -> Path:
    from npuq.testing.tiny import tiny_decoder
    from npuq.quantize.artifact import save_artifact
    from npuq.quantize.pt2e import quantize_model
    from npuq.quant.recipe import load_recipe

    _, model = tiny_decoder("llama", max_context=context)
    tokens = torch.randint(0, model.config.vocab_size, (4 * context,), generator=torch.Generator().manual_seed(0))
    qm = quantize_model(model, load_recipe(None, "16a8w"), tokens.tolist(), context=context, prefill_len=prefill_len)
    return save_artifact(qm, folder / "tiny-llama-16a8w")


class ByteTokenizer:
    """UTF-8 bytes as token ids, for the tiny models' 256-token vocabulary (BOS 1 starts a document)."""

    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


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


@contextmanager
def export_phases():
    """{phase: seconds} of the export_artifact call made inside the block (load, lower,
    serialize, write: what npuq.lower.export logs at DEBUG level when it finishes)."""
    import logging

    from npuq.lower.export import PHASES

    phases = dict.fromkeys(PHASES, 0.0)

    class Collect(logging.Handler):
        def emit(self, record):
            phases.update(getattr(record, "npuq_export_phases", {}))

    logger, handler = logging.getLogger("npuq.lower.export"), Collect(logging.DEBUG)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield phases
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def per_call_ms(log: dict[int, list[float]]) -> dict[str, float]:
    return {f"ar{k}_ms": round(1000 * sum(v) / len(v), 3) for k, v in sorted(log.items())}


def run(graphs, cfg, context, ids, prompt, log=None):
    """``ids`` through prefill chunks for the first ``prompt`` tokens, then one call per
    remaining token (the runner also uses the decode graph once a prefill chunk no longer
    fits the context). Returns logits (1, len(ids), V)."""
    from npuq.runtime.runner import StaticRunner

    log = {} if log is None else log
    runner = StaticRunner(cfg, {k: Timed(g, log) for k, g in graphs.items()}, context)
    logits = [runner.feed(ids[:prompt])] if prompt else []
    logits += [runner.feed([t]) for t in ids[prompt:]]
    return torch.cat(logits, dim=1)


def logits_step(gm) -> float | None:
    """The scale of the logits' output encoding: the dequantize that produces output 0."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    node = out[0] if isinstance(out, (list, tuple)) else out
    if "dequantize" not in str(node.target) or len(node.args) < 2:
        return None
    scale = node.args[1]
    if isinstance(scale, torch.fx.Node):
        obj = gm
        for part in scale.target.split("."):
            obj = getattr(obj, part)
        scale = obj
    return float(torch.as_tensor(scale).reshape(-1)[0])


class Agreement:
    """Streaming element-wise comparison of logits against a reference."""

    def __init__(self, step: float | None):
        self.step = step
        self.max_abs = self.sum_abs = self.ref_max = 0.0
        self.elements = self.within_step = self.rows = self.argmax_same = 0

    def add(self, logits: torch.Tensor, ref: torch.Tensor) -> None:
        err = (logits.float() - ref.float()).abs()
        self.max_abs = max(self.max_abs, float(err.max()))
        self.sum_abs += float(err.double().sum())
        self.ref_max = max(self.ref_max, float(ref.abs().max()))
        self.elements += err.numel()
        if self.step:
            self.within_step += int((err <= 1.001 * self.step).sum())
        a, b = logits.reshape(-1, logits.shape[-1]).argmax(-1), ref.reshape(-1, ref.shape[-1]).argmax(-1)
        self.rows += a.numel()
        self.argmax_same += int((a == b).sum())

    def to_dict(self) -> dict[str, float]:
        out = {
            "max_abs_logit_diff": self.max_abs,
            "max_rel_logit_diff": self.max_abs / self.ref_max if self.ref_max else 0.0,
            "mean_abs_logit_diff": self.sum_abs / max(self.elements, 1),
            "argmax_agreement": self.argmax_same / max(self.rows, 1),
        }
        if self.step:
            out["within_one_logit_step"] = self.within_step / max(self.elements, 1)
        return out


def pcq_embedding_error(artifact: Path, config) -> dict | None:
    """The legacy pattern's loss, exactly: every row of a per-channel-quantized embedding table
    through both patterns (npuq.lower.pcq), in codes of the embedding's output encoding.
    None when the table is not PCQ."""
    import numpy as np

    from npuq.lower import pcq
    from npuq.lower.qparams import Encoding, storage_type
    from npuq.quantize.artifact import load_program

    gm = load_program(artifact / config.programs["decode"].file)
    node = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.embedding.default),
                None)
    dq = node.args[0] if node is not None else None
    if dq is None or "dequantize_per_channel" not in str(getattr(dq, "target", "")):
        return None
    quant = next(u for u in node.users if "quantize_per_tensor" in str(u.target))

    def attr(a):
        obj = gm
        for part in a.target.split("."):
            obj = getattr(obj, part)
        return obj.detach().cpu().numpy()

    codes, scales, zps = attr(dq.args[0]), attr(dq.args[1]), attr(dq.args[2])
    qmin, qmax = dq.args[4], dq.args[5]
    enc = Encoding(scales, zps, qmin, qmax, storage_type(qmin, qmax, static=True), axis=0)
    out = Encoding.per_tensor(float(quant.args[1]), int(quant.args[2]), quant.args[3], quant.args[4])
    ids = np.arange(codes.shape[0])
    exact = pcq.reference_gather(codes, enc, ids, out).astype(np.int64)
    optimized = pcq.u16_gather(codes, enc, ids, out).astype(np.int64)
    legacy = pcq.legacy_gather(codes, enc, ids, out).astype(np.int64)
    d = np.abs(legacy - exact)
    return {
        "rows": int(codes.shape[0]), "bits": enc.bits,
        "row_scale_min": float(scales.min()), "row_scale_median": float(np.median(scales)),
        "row_scale_max": float(scales.max()),
        "optimized_entries_changed": float((optimized != exact).mean()),
        "optimized_max_code_error": int(np.abs(optimized - exact).max()),
        "legacy_entries_changed": float((d > 0).mean()),
        "legacy_rows_changed": float((d > 0).any(axis=1).mean()),
        "legacy_mean_code_error": float(d.mean()),
        "legacy_max_code_error": int(d.max()),
        "legacy_rel_rms_error": float(np.sqrt(((legacy - exact) ** 2).mean() / ((exact - int(out.zero_point)) ** 2).mean())),
    }


def text_windows(tokenizer, corpus: str, max_tokens: int, context: int):
    from npuq.data import load_corpus
    from npuq.data.windows import document_windows
    from npuq.eval.perplexity import prefix_token_id, tokenize_documents

    docs = tokenize_documents(tokenizer, load_corpus(corpus, "eval"), max_tokens=max_tokens)
    return docs, document_windows([d.tokens for d in docs], prefix_token_id(tokenizer), context)


def perplexity(scorers: dict, reference: str, cfg, graph_context: int, window: int, docs, windows,
               step: float | None) -> dict:
    """Score the same windows (at most ``window`` tokens) with every scorer (name → graphs built
    for ``graph_context``); compare logits to ``reference``'s."""
    from npuq.eval.metrics import PerplexityTotals, document_totals, perplexity_metrics
    from npuq.eval.perplexity import window_loglikelihood

    lls = {name: [0.0] * len(docs) for name in scorers}
    logs = {name: {} for name in scorers}
    seconds = dict.fromkeys(scorers, 0.0)
    agree = {name: Agreement(step) for name in scorers if name != reference}
    for i, w in enumerate(windows):
        logits = {}
        for name, graphs in scorers.items():
            start = time.perf_counter()
            logits[name] = run(graphs, cfg, graph_context, list(w.inputs), len(w.inputs), logs[name])[0]
            seconds[name] += time.perf_counter() - start
            lls[name][w.doc] += window_loglikelihood(logits[name], w.targets)
        n = len(w.targets)
        for name, a in agree.items():
            a.add(logits[name][-n:], logits[reference][-n:])
        print(f"  window {i + 1}/{len(windows)}: " + ", ".join(f"{k} {sum(v):.2f}" for k, v in lls.items()),
              file=sys.stderr)
    result = {}
    for name in scorers:
        totals = sum((document_totals(d.page, ll, len(d.tokens)) for d, ll in zip(docs, lls[name])),
                     PerplexityTotals(0.0, 0, 0, 0, 0))
        entry = {**perplexity_metrics(totals), "loglikelihood": totals.loglikelihood,
                 "seconds": round(seconds[name], 1), **per_call_ms(logs[name])}
        result[name] = entry
    ref = result[reference]
    for name, a in agree.items():
        result[name]["rel_diff_word_perplexity"] = result[name]["word_perplexity"] / ref["word_perplexity"] - 1
        result[name]["mean_token_nll_diff"] = (ref["loglikelihood"] - result[name]["loglikelihood"]) / \
            sum(len(d.tokens) for d in docs)
        result[name]["logits_vs_" + reference] = a.to_dict()
    patterns = {name.removeprefix("ort_cpu_"): r["word_perplexity"] for name, r in result.items()
                if name.startswith("ort_cpu_")}
    extra = {}
    if "legacy" in patterns and "optimized" in patterns:
        extra["legacy_vs_optimized_rel_diff_word_perplexity"] = patterns["legacy"] / patterns["optimized"] - 1
    rel = {name: r["rel_diff_word_perplexity"] for name, r in result.items() if name != reference}
    return {"tokens": sum(len(d.tokens) for d in docs), "words": totals.words, "bytes": totals.bytes,
            "documents": len(docs), "windows": len(windows), "context": window,
            "reference": reference, "word_perplexity_" + reference: ref["word_perplexity"],
            **{f"rel_diff_word_perplexity_{k}": v for k, v in rel.items()}, **extra, "scorers": result}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", help="artifact folder (default: quantize a tiny Llama here)")
    p.add_argument("--qnn-version", default="2.51")
    p.add_argument("--htp-arch", type=int, default=73)
    p.add_argument("--embedding-pattern", nargs="+", default=["auto"], choices=("auto", "legacy", "optimized"),
                   help="export once per pattern; each is scored on the text (default: auto)")
    p.add_argument("--embedding-storage", default="u16", choices=("u16", "int8-rowscale"))
    p.add_argument("--corpus", default="builtin", help="text for the perplexity comparison (eval split)")
    p.add_argument("--context", type=int, default=0, help="perplexity window (default: the artifact's context)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="text tokens scored (default: 4096 for an artifact, 256 bytes for the tiny model); 0 skips")
    p.add_argument("--tokens", type=int, default=None, help="random tokens fed for the logit check (default: the "
                   "whole context for the tiny model, 0 = skip for an artifact); the prompt leaves room for 8 decode steps")
    p.add_argument("--htp-tokens", type=int, default=8, help="decode calls on the QNN HTP backend (0 skips)")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads for the PT2E programs (default 1: "
                   "on a shared 2-vCPU machine 2 threads made a SmolLM2 prefill call 3-70x slower; 0 keeps torch's)")
    p.add_argument("--no-noise-floor", dest="noise_floor", action="store_false",
                   help="skip the PT2E-vs-PT2E (re-associated softmax) reference runs")
    p.add_argument("--export-only", action="store_true",
                   help="only time the export (split into load, lower, serialize, write): no perplexity, "
                   "random-token or HTP runs")
    p.add_argument("--out", default="out/bench/export.json")
    args = p.parse_args(argv)
    if args.export_only:
        args.max_tokens, args.tokens, args.htp_tokens = 0, 0, 0

    from npuq.eval.perplexity import window_loglikelihood
    from npuq.lower.export import ExportOptions, export_artifact
    from npuq.lower.manifest import read_manifest
    from npuq.models.config import ModelConfig
    from npuq.quantize.artifact import load_artifact, read_artifact
    from npuq.lower import ort
    from npuq.threads import scope_or_keep

    tiny = not args.artifact
    max_tokens = args.max_tokens if args.max_tokens is not None else (256 if tiny else 4096)
    random_tokens = args.tokens if args.tokens is not None else (-1 if tiny else 0)
    with tempfile.TemporaryDirectory(prefix="npuq-bench-export-") as tmp, scope_or_keep(args.num_threads) as threads:
        work = Path(tmp)
        report = {"torch_threads": threads}
        artifact = tiny_artifact(work, 32, 8) if tiny else Path(args.artifact)
        config = read_artifact(artifact)
        exports, export_dirs = {}, {}
        for pattern in dict.fromkeys(args.embedding_pattern):
            out = work / f"export-{pattern}"
            with export_phases() as phases:
                r = export_artifact(artifact, out, ExportOptions(qnn_version=args.qnn_version, htp_arch=args.htp_arch,
                                                                 embedding_pattern=pattern,
                                                                 embedding_storage=args.embedding_storage))
            manifest = json.loads((out / "manifest.json").read_text())
            export_dirs[pattern] = out
            exports[pattern] = {
                "export_seconds": round(r.seconds, 2),
                "export_phases_seconds": {k: round(v, 2) for k, v in phases.items()},
                "embedding_pattern": r.embedding_pattern,
                "embeddings": manifest["embeddings"],
                "onnx_bytes": {k: (out / g["file"]).stat().st_size for k, g in manifest["graphs"].items()},
            }
            split = ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
            print(f"exported {pattern}: {r.embedding_pattern} in {r.seconds:.1f} s ({split})", file=sys.stderr)
        first = next(iter(export_dirs))
        manifest = json.loads((export_dirs[first] / "manifest.json").read_text())
        cfg = ModelConfig.from_dict(manifest["model_config"])
        context = manifest["context"]
        prefill_len = max(g["ar_len"] for g in manifest["graphs"].values())
        qm = None if args.export_only else load_artifact(artifact)  # the PT2E reference for the comparisons
        pt2e = qm.graphs() if qm is not None else {}
        step = logits_step(qm.decode) if qm is not None else None
        report.update({
            "artifact": str(artifact) if not tiny else "tiny-llama-16a8w (quantized here)",
            "recipe": config.recipe,
            "context": context,
            "prefill_len": prefill_len,
            "qnn_version": manifest["target"]["qnn_version"],
            "htp_arch": manifest["target"]["htp_arch"],
            "embedding_storage": args.embedding_storage,
            "logits_step": step,
            "exports": exports,
        })
        table = None if args.export_only else pcq_embedding_error(Path(artifact), config)
        if table is not None:
            report["pcq_embedding_table"] = table
        cpu = {} if args.export_only else {pattern: ort.load_export(d, "cpu")[1] for pattern, d in export_dirs.items()}

        # ---- perplexity on real text, the same windows for every scorer
        if max_tokens:
            if tiny:
                tokenizer = ByteTokenizer()
            else:
                from npuq.models import load_model
                from npuq.pipeline.programs import _model_source

                model = config.model
                tokenizer = load_model(_model_source(model.name if model else None, model.source if model else None,
                                                     str(artifact))).tokenizer
            ctx = args.context or context
            if not 2 <= ctx <= context:
                p.error(f"--context {ctx}: the graphs hold {context} tokens; use 2..{context}")
            docs, windows = text_windows(tokenizer, args.corpus, max_tokens, ctx)
            scorers = {"pt2e": pt2e, **{f"ort_cpu_{k}": g for k, g in cpu.items()}}
            if args.noise_floor:
                scorers["pt2e_reassociated_softmax"] = {k: Reassociated(g) for k, g in pt2e.items()}
            print(f"perplexity: {len(windows)} windows of at most {ctx} tokens, {', '.join(scorers)}", file=sys.stderr)
            report["perplexity"] = {"corpus": args.corpus, "split": "eval", "max_tokens": max_tokens,
                                    **perplexity(scorers, "pt2e", cfg, context, ctx, docs, windows, step)}
        else:
            windows = None

        # ---- random tokens through prefill and decode (the original check)
        if random_tokens:
            n = context if random_tokens < 0 else min(random_tokens, context)
            prompt = max(1, min(n - 1, context - prefill_len + 1, n - 8))
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
            log: dict = {}
            ref = run(pt2e, cfg, context, ids, prompt, log)
            section = {"tokens": n, "prompt_tokens": prompt, "pt2e": per_call_ms(log)}
            scored = {f"ort_cpu_{k}": g for k, g in cpu.items()}
            if args.noise_floor:
                scored["pt2e_reassociated_softmax"] = {k: Reassociated(g) for k, g in pt2e.items()}
            for name, graphs in scored.items():
                log = {}
                logits = run(graphs, cfg, context, ids, prompt, log)
                a = Agreement(step)
                a.add(logits, ref)
                section[name] = {**per_call_ms(log), **a.to_dict()}
            report["random_tokens"] = section

        # ---- the decode graph on the QNN HTP backend (emulated), fallback disabled
        if args.htp_tokens:
            reason = ort.qnn_available()
            if reason:
                report["htp"] = {"skipped": reason}
            else:
                if windows:
                    ids = list(windows[0].inputs[: args.htp_tokens])
                else:
                    ids = torch.randint(0, cfg.vocab_size, (args.htp_tokens,),
                                        generator=torch.Generator().manual_seed(2)).tolist()
                entry = read_manifest(export_dirs[first]).graphs["decode"]
                path = export_dirs[first] / entry.file
                start = time.perf_counter()
                htp = ort.OrtGraph(ort.htp_session(path, manifest["target"]["htp_arch"]), entry)
                session_s = time.perf_counter() - start
                cpu_decode = ort.OrtGraph(ort.cpu_session(path), entry)
                logs: dict[str, dict] = {"htp": {}, "cpu": {}, "pt2e": {}}
                out = {name: run({1: g}, cfg, context, ids, 0, logs[name])
                       for name, g in (("htp", htp), ("cpu", cpu_decode), ("pt2e", pt2e[1]))}
                vs_cpu, vs_pt2e, cpu_vs_pt2e = Agreement(step), Agreement(step), Agreement(step)
                vs_cpu.add(out["htp"], out["cpu"])
                vs_pt2e.add(out["htp"], out["pt2e"])
                cpu_vs_pt2e.add(out["cpu"], out["pt2e"])
                nll = {name: -window_loglikelihood(o[0, :-1], ids[1:]) / (len(ids) - 1) for name, o in out.items()}
                report["htp"] = {
                    "export": first, "graph": "decode", "tokens": len(ids), "text": bool(windows),
                    "fallback": "disabled", "session_seconds": round(session_s, 2),
                    "htp_decode_ms": per_call_ms(logs["htp"])["ar1_ms"],
                    "ort_cpu_decode_ms": per_call_ms(logs["cpu"])["ar1_ms"],
                    "pt2e_decode_ms": per_call_ms(logs["pt2e"])["ar1_ms"],
                    "htp_vs_ort_cpu": vs_cpu.to_dict(), "htp_vs_pt2e": vs_pt2e.to_dict(),
                    "ort_cpu_vs_pt2e": cpu_vs_pt2e.to_dict(),
                    "mean_token_nll": nll,
                }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    out.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
