"""``npuq run``: model → tuned threads → calibrated, recovered artifact → evaluated → exported
→ evaluated again → report, as cached stages of one run folder.

    DIR/artifact/       the quantized artifact ('npuq quantize --out')
    DIR/onnx/           the export ('npuq export --out'): decode.onnx, prefill.onnx, manifest.json
    DIR/report.html     self-contained report (images embedded)
    DIR/report.json     the same facts as data, with the stage log
    DIR/stages/NAME-KEY one folder per finished stage (npuq.pipeline.stages), reused while its key holds

``artifact/`` and ``onnx/`` hold hard links to the files of the current stages (copies where
links are impossible), so they are ordinary folders that can be copied to a device as they are.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from npuq.fsio import atomic_dir, write_json, write_text
from npuq.device import is_cpu
from npuq.errors import NpuqError
from npuq.pipeline.stages import RunDir

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "The three most important things to know about the Python programming language are",
)


@dataclass
class RunOptions:
    model: str = "smollm2-135m"
    scheme: str | None = None
    recipe: str | None = None
    context: int = 512
    prefill_len: int | None = None
    calib_corpus: str = "builtin"
    calib_tokens: int = 4096
    batch_size: int = 8
    seq_mse: int | None = None
    seq_mse_granularity: str = "channel"
    weight_rounding: str = "nearest"
    layer_inputs: str | None = None  # None for either: npuq.optimize.recovery.resolve_recovery's defaults
    act_order: bool | None = None
    eval_corpus: str = "builtin"
    eval_tokens: int = 4096
    qnn_version: str | None = None
    htp_arch: str | None = None
    soc: str | None = None
    embedding_pattern: str = "auto"
    embedding_storage: str = "u16"
    gen_tokens: int = 16
    prompts: tuple[str, ...] = PROMPTS
    num_threads: int = 0
    sqnr_tokens: int = 32  # one prefill chunk of the default length
    device: str = "auto"  # calibration, SeqMSE/GPTQ and the float / PT2E evaluations (npuq.device)

    def quantize_inputs(self) -> dict[str, Any]:
        keys = ("scheme", "recipe", "context", "prefill_len", "calib_corpus", "calib_tokens", "batch_size",
                "seq_mse", "seq_mse_granularity", "weight_rounding", "layer_inputs", "act_order")
        inputs = {k: getattr(self, k) for k in keys}
        if self.recipe and Path(self.recipe).is_file():  # a recipe file: its content, not its name
            inputs["recipe_text"] = Path(self.recipe).read_text(encoding="utf-8")
        return inputs


def model_identity(spec: str) -> dict[str, Any]:
    """What identifies the model's files without reading them: path, sizes and modification
    times (a changed file changes every stage key)."""
    from npuq.models.sources import resolve

    kind, path = resolve(spec)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return {"spec": spec, "kind": kind, "path": str(path.resolve()),
            "files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]}


def link_tree(source: Path, target: Path) -> None:
    """Publish ``source``'s files as ``target`` (replaced atomically): hard links, else copies."""
    with atomic_dir(target) as tmp:
        for src in source.rglob("*"):
            dst = tmp / src.relative_to(source)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)


@dataclass
class Job:
    options: RunOptions
    out: Path
    progress: bool = True

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.results: dict[str, Any] = {}
        self.folders: dict[str, Path] = {}
        self.keys: dict[str, str] = {}

    def say(self, text: str) -> None:
        if self.progress:
            print(text, file=sys.stderr, flush=True)

    @functools.cached_property
    def loaded(self) -> Any:
        """The float model, loaded once and only if a stage has to be built."""
        from npuq.models import load_model

        return load_model(self.options.model, max_context=max(self.options.context, 4096))

    def stage(self, name: str, inputs: dict[str, Any], build: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        self.say(f"[{STAGES.index(name) + 1}/{len(STAGES)}] {name}: {STAGE_TITLES[name]}")
        folder, result = self.run.stage(name, inputs, build)
        entry = self.run.log[-1]
        self.say(f"      {name}: reused from {folder.relative_to(self.out)}" if entry["cached"]
                 else f"      {name}: done in {entry['seconds']:.1f} s")
        self.results[name], self.folders[name], self.keys[name] = result, folder, entry["key"]
        return result

    # ------------------------------------------------------------------ stages
    def threads(self, base: dict[str, Any]) -> None:
        from npuq.quantize.pt2e import default_prefill_len
        from npuq.threads import cpu_limits, tune_cached
        from npuq.runtime.workloads import PHASES, phase_workload

        o = self.options
        prefill_len = o.prefill_len or default_prefill_len(o.context)

        def build(_folder: Path) -> dict[str, Any]:
            limits = cpu_limits()
            sweeps = []
            for phase in PHASES:
                workload = phase_workload(self.loaded.model, phase, o.context, prefill_len if phase == "prefill" else None)
                sweeps.append(tune_cached(phase, workload, ceiling=limits.ceiling).to_dict())
            return {"ceiling": limits.ceiling, "affinity_cpus": limits.affinity, "cgroup_quota_cpus": limits.quota,
                    "plan": {s["phase"]: s["best"] for s in sweeps}, "sweeps": sweeps}

        self.stage("threads", {**base, "context": o.context, "prefill_len": prefill_len,
                               "cpu": os.cpu_count()}, build)

    def quantize(self, base: dict[str, Any]) -> None:
        from npuq.quantize.stage import quantize_to_artifact

        o = self.options

        def build(folder: Path) -> dict[str, Any]:
            result, summary = quantize_to_artifact(
                o.model, str(folder / "artifact"), scheme=o.scheme, recipe=o.recipe, corpus=o.calib_corpus,
                calib_tokens=o.calib_tokens, context=o.context, prefill_len=o.prefill_len, batch_size=o.batch_size,
                num_threads=o.num_threads, progress=self.progress, seq_mse=o.seq_mse,
                seq_mse_granularity=o.seq_mse_granularity, weight_rounding=o.weight_rounding, device=str(self.device),
                layer_inputs=o.layer_inputs, act_order=o.act_order,
            )
            result["artifact"] = "artifact"  # relative to the stage folder
            return {**result, "recipe_summary": summary}

        self.stage("quantize", {**base, **o.quantize_inputs(), "device": str(self.device)}, build)

    def evaluate(self, name: str, of: str | None, base: dict[str, Any]) -> None:
        """Perplexity on the eval corpus of the float model (``of`` None) or of the graphs made
        by stage ``of`` ("quantize": PT2E programs, "export": ONNX on ONNX Runtime's CPU provider)."""
        from npuq.eval.perplexity import evaluate_model, evaluate_perplexity
        from npuq.threads import scope_or_keep

        o = self.options

        def build(_folder: Path) -> dict[str, Any]:
            documents = self.documents
            if of is None:  # whole windows: the calibrate phase's shape
                try:
                    return evaluate_model(self.loaded, documents, o.context, batch_size=4, max_tokens=o.eval_tokens,
                                          num_threads=self.phase_threads("calibrate"), progress=self.progress,
                                          device=self.device)
                finally:
                    self.loaded.model.to("cpu")  # the later stages run it on the CPU
            device = self.device if of == "quantize" else torch.device("cpu")  # ONNX Runtime takes CPU tensors
            programs = self.artifact_programs() if of == "quantize" else self.export_programs()
            with scope_or_keep(self.phase_threads("prefill")) as threads:  # prefill chunks
                result = evaluate_perplexity(programs.to(device).logits, self.loaded.tokenizer, documents, o.context,
                                             max_tokens=o.eval_tokens, progress=self.progress, device=device)
            return {**result, **programs.describe(), "threads": threads, "device": str(device)}

        inputs = {**base, "corpus": o.eval_corpus, "tokens": o.eval_tokens, "context": o.context,
                  "of": self.keys[of] if of else "float", "device": str(self.device) if of != "export" else "cpu"}
        self.stage(name, inputs, build)

    def phase_threads(self, phase: str) -> int:
        """--num-threads if given, else the count the threads stage measured for ``phase`` (on a
        GPU: 0, torch's count kept)."""
        if self.options.num_threads or not is_cpu(self.device):
            return self.options.num_threads
        return int(self.results["threads"]["plan"][phase])

    def artifact_programs(self) -> Any:
        from npuq.pipeline.programs import open_programs

        return open_programs(artifact=str(self.folders["quantize"] / "artifact"))

    def export_programs(self) -> Any:
        from npuq.pipeline.programs import open_programs

        return open_programs(onnx=str(self.folders["export"] / "onnx"), provider="cpu")

    def layers(self) -> None:
        from npuq.eval.layers import layer_errors
        from npuq.data.corpora import corpus_tokens
        from npuq.threads import scope_or_keep

        o = self.options

        def build(_folder: Path) -> dict[str, Any]:
            programs = self.artifact_programs()
            ids = corpus_tokens(self.loaded.tokenizer, o.eval_corpus, o.sqnr_tokens, split="eval")
            with scope_or_keep(self.phase_threads("prefill")):
                errors = layer_errors(self.loaded.model, programs.graphs, programs.config, programs.context, ids)
            return {"tokens": len(ids), "layers": [e.to_dict() for e in errors]}

        self.stage("layers", {"of": self.keys["quantize"], "corpus": o.eval_corpus, "tokens": o.sqnr_tokens}, build)

    def generate(self) -> None:
        from npuq.runtime.generate import generate

        o = self.options

        def build(_folder: Path) -> dict[str, Any]:
            programs = self.artifact_programs()
            rows = []
            for prompt in o.prompts:
                kwargs = {"max_new_tokens": o.gen_tokens, "context": programs.context,
                          "prefill_len": max(programs.graphs), "num_threads": o.num_threads}
                ref = generate(self.loaded, prompt, **kwargs)
                quant = generate(self.loaded, prompt, graphs=programs.graphs, **kwargs)
                same = common_prefix(ref["token_ids"], quant["token_ids"])
                rows.append({"prompt": prompt, "float": ref["text"], "quantized": quant["text"],
                             "same_tokens": same, "tokens": len(ref["token_ids"]),
                             "float_tokens_per_second": ref["tokens_per_second"],
                             "quantized_tokens_per_second": quant["tokens_per_second"]})
            return {"generations": rows}

        self.stage("generate", {"of": self.keys["quantize"], "prompts": list(o.prompts), "tokens": o.gen_tokens}, build)

    def export(self) -> None:
        from npuq.lower.export import export_artifact

        o, target = self.options, self.target

        def build(folder: Path) -> dict[str, Any]:
            result = export_artifact(self.folders["quantize"] / "artifact", folder / "onnx", target=target,
                                     embedding_pattern=o.embedding_pattern, embedding_storage=o.embedding_storage)
            result["files"] = {k: str(Path(v).relative_to(folder)) for k, v in result["files"].items()}
            return result

        inputs = {"of": self.keys["quantize"], "target": target.describe(),  # the environment's SDK counts "embedding_pattern": o.embedding_pattern,
                  "embedding_storage": o.embedding_storage}
        self.stage("export", inputs, build)

    # ------------------------------------------------------------------ the whole job
    def check(self) -> None:
        """Every option that can be checked without the model, before the first stage."""
        from npuq.data import load_corpus
        from npuq.device import resolve_device
        from npuq.eval.perplexity import check_context
        from npuq.lower.registry import LowerOptions
        from npuq.lower.target import resolve_target
        from npuq.quant.recipe import load_recipe
        from npuq.optimize.recovery import resolve_recovery

        o = self.options
        if o.eval_tokens < 2 or o.gen_tokens < 1 or o.sqnr_tokens < 1:
            raise NpuqError("--eval-tokens must be at least 2 and --gen-tokens at least 1")
        if o.calib_tokens < o.context:
            raise NpuqError(f"--calib-tokens {o.calib_tokens} is less than one window of --context {o.context}: "
                            "raise it or lower the context")
        resolve_recovery(o.seq_mse, o.weight_rounding, o.layer_inputs, o.act_order)
        check_context(o.context)
        load_recipe(o.recipe, o.scheme, o.model)
        LowerOptions(o.embedding_pattern, o.embedding_storage)
        self.target = resolve_target(o.qnn_version, o.htp_arch, o.soc)
        self.device = resolve_device(o.device)
        load_corpus(o.calib_corpus, "calib")
        self.documents = load_corpus(o.eval_corpus, "eval")
        model_identity(o.model)

    def execute(self) -> dict[str, Any]:
        from npuq import __version__

        start = time.perf_counter()
        self.check()
        self.run = RunDir(self.out)  # only once the options are known to be good
        if self.run.interrupted is not None:
            self.say(f"npuq run: the previous run in {self.out} was interrupted (stage "
                     f"{self.run.interrupted.get('stage') or 'between stages'}); finished stages are reused")
        base = {"npuq": __version__, "model": model_identity(self.options.model)}
        self.stage("model", base, lambda _folder: self.loaded.info())
        self.threads(base)
        self.quantize(base)
        self.evaluate("eval-float", None, base)
        self.evaluate("eval-quantized", "quantize", base)
        self.layers()
        self.generate()
        self.export()
        self.evaluate("eval-exported", "export", base)

        self.say(f"[{len(STAGES)}/{len(STAGES)}] report: {STAGE_TITLES['report']}")
        link_tree(self.folders["quantize"] / "artifact", self.out / "artifact")
        link_tree(self.folders["export"] / "onnx", self.out / "onnx")
        from npuq.report.build import build_report

        report, html = build_report(self, time.perf_counter() - start)
        write_text(self.out / "report.html", html)
        write_json(self.out / "report.json", report)
        self.prune()
        self.run.finish()
        return report

    def prune(self) -> None:
        """Delete stage folders this run did not use (older keys): they can be large."""
        current = {f"{e['stage']}-{e['key']}" for e in self.run.log}
        for folder in (self.out / "stages").iterdir():
            if folder.is_dir() and folder.name not in current and not folder.name.startswith("."):
                shutil.rmtree(folder, ignore_errors=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


STAGES = ("model", "threads", "quantize", "eval-float", "eval-quantized", "layers", "generate", "export", "eval-exported",
          "report")
STAGE_TITLES = {
    "model": "load the model and describe it",
    "threads": "fastest thread count per phase (decode, prefill, calibrate)",
    "quantize": "calibrate, recover accuracy, write the quantized programs",
    "eval-float": "perplexity of the float model",
    "eval-quantized": "perplexity of the quantized programs (prefill + decode, quantized KV cache)",
    "layers": "per-layer quantization error (SQNR against float)",
    "generate": "greedy generations, float and quantized",
    "export": "lower to QDQ ONNX for the target SDK and HTP",
    "eval-exported": "perplexity of the exported graphs on ONNX Runtime (CPU, exact QDQ)",
    "report": "report.html and report.json",
}


def run_job(options: RunOptions, out: str | os.PathLike, progress: bool = True) -> dict[str, Any]:
    """Run every stage into ``out`` (reusing finished ones) and return report.json's content."""
    return Job(options, Path(out), progress).execute()
