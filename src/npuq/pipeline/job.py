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

import ctypes
import functools
import gc
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from npuq import __version__
from npuq.data import load_corpus
from npuq.data.corpora import corpus_tokens
from npuq.errors import NpuqError
from npuq.eval.layers import layer_errors
from npuq.eval.perplexity import EvalOptions, EvalResult, evaluate_model
from npuq.fsio import atomic_dir, write_json, write_text
from npuq.lower.export import ExportOptions, ExportResult, export_artifact
from npuq.models import load_model
from npuq.models.sources import resolve
from npuq.optimize.rotate import rotate_as
from npuq.pipeline.programs import Programs, open_programs
from npuq.pipeline.stages import RunDir
from npuq.quantize.artifact import read_artifact
from npuq.quantize.stage import QuantizeOptions, QuantizeResult, check_quantize, quantize_to_artifact
from npuq.records import from_json, to_json
from npuq.report.build import build_report
from npuq.runtime.context import ExecutionContext
from npuq.runtime.generate import generate
from npuq.runtime.runner import forward_logits
from npuq.runtime.workloads import PHASES, phase_workload
from npuq.threads import cpu_limits, cpu_model, tune_cached

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "The three most important things to know about the Python programming language are",
)
EVAL_BATCH = 4  # windows per forward of the float model


@dataclass(frozen=True)
class RunOptions:
    """Everything that decides a run's results: the quantize and export records of the single
    commands, plus what the run evaluates and generates. Each stage is keyed on the records it
    reads, hashed whole; where the work runs (device, threads) is the ExecutionContext's."""

    quantize: QuantizeOptions = field(default_factory=QuantizeOptions)
    export: ExportOptions = field(default_factory=ExportOptions)
    eval_corpus: str = "builtin"  # its eval split, disjoint from the calib split
    eval_tokens: int = 4096
    gen_tokens: int = 16
    prompts: tuple[str, ...] = PROMPTS
    sqnr_tokens: int = 32  # one prefill chunk of the default length

    def __post_init__(self) -> None:
        if self.eval_tokens < 2:
            raise NpuqError(f"--eval-tokens {self.eval_tokens}: scoring needs at least 2 tokens")
        if self.gen_tokens < 1 or self.sqnr_tokens < 1:
            raise NpuqError("--gen-tokens must be at least 1")
        if not self.prompts or not all(p.strip() for p in self.prompts):
            raise NpuqError("--prompt needs some text")
        if self.gen_tokens >= self.quantize.context:
            raise NpuqError(f"--gen-tokens {self.gen_tokens} leaves no room for a prompt in --context "
                            f"{self.quantize.context}: use at most {self.quantize.context - 1}")

    @property
    def model(self) -> str:
        return self.quantize.model

    @property
    def eval(self) -> EvalOptions:
        return EvalOptions(self.eval_corpus, "eval", self.quantize.context, max_tokens=self.eval_tokens,
                           batch_size=EVAL_BATCH)


@dataclass(frozen=True)
class ThreadsResult:
    ceiling: int
    affinity_cpus: int
    cgroup_quota_cpus: float | None
    plan: dict[str, Any]  # phase → threads
    sweeps: tuple[dict[str, Any], ...]  # npuq.threads.TuneResult.to_dict() per phase


def model_identity(spec: str) -> dict[str, Any]:
    """What identifies the model's files without reading them: path, sizes and modification
    times (a changed file changes every stage key)."""
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
    ctx: ExecutionContext

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.results: dict[str, Any] = {}  # stage → its result (a record, or JSON for model/layers/generate)
        self.folders: dict[str, Path] = {}
        self.keys: dict[str, str] = {}
        self._rotated = False  # float_in_artifact_basis has rotated self.loaded.model
        self._tokenizer: Any = None

    def say(self, text: str) -> None:
        if self.ctx.progress:
            print(text, file=sys.stderr, flush=True)

    @functools.cached_property
    def loaded(self) -> Any:
        """The float model, loaded once and only if a stage has to be built."""
        return load_model(self.options.model, max_context=max(self.options.quantize.context, 4096))

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, kept when the float model is released."""
        if self._tokenizer is None:
            self._tokenizer = self.loaded.tokenizer
        return self._tokenizer

    def release_float(self) -> None:
        """Drop the float model before a stage that loads its own copy (quantize) or needs none
        (export), so two copies never live at once; the next use loads it again (from the GGUF
        cache or the safetensors files: seconds, against one fp32 copy of the weights held)."""
        if "loaded" in self.__dict__:
            self.tokenizer  # noqa: B018  (kept for the stages that need only the tokenizer)
            del self.__dict__["loaded"]
            self._rotated = False
            release_memory()

    def stage(self, name: str, inputs: dict[str, Any], build: Callable[[Path], Any], record: type | None = None) -> Any:
        """Stage ``name`` keyed on ``inputs`` (records as their whole JSON, upstream keys, the
        environment). ``build(folder)`` returns a ``record`` (stored as JSON, read back typed)
        or a JSON-able dict."""
        self.say(f"[{STAGES.index(name) + 1}/{len(STAGES)}] {name}: {STAGE_TITLES[name]}")
        folder, data = self.run.stage(name, inputs, lambda tmp: _plain(build(tmp)))
        release_memory()  # the stage's programs and sessions, before the next stage allocates its own
        entry = self.run.log[-1]
        self.say(f"      {name}: reused from {folder.relative_to(self.out)}" if entry["cached"]
                 else f"      {name}: done in {entry['seconds']:.1f} s")
        result = from_json(record, data, f"{folder / 'result.json'}") if record else data
        self.results[name], self.folders[name], self.keys[name] = result, folder, entry["key"]
        return result

    # ------------------------------------------------------------------ stages
    def threads(self, base: dict[str, Any]) -> None:
        q = self.options.quantize

        def build(_folder: Path) -> ThreadsResult:
            limits = cpu_limits()
            sweeps = []
            for phase in PHASES:
                workload = phase_workload(self.loaded.model, phase, q.context, q.prefill_len if phase == "prefill" else None)
                sweeps.append(tune_cached(phase, workload, ceiling=limits.ceiling).to_dict())
            return ThreadsResult(limits.ceiling, limits.affinity, limits.quota,
                                 {s["phase"]: s["best"] for s in sweeps}, tuple(sweeps))

        limits = cpu_limits()  # the CPUs this process may use now: a new taskset or quota is a new plan
        cpus = {"ceiling": limits.ceiling, "affinity": limits.affinity, "quota": limits.quota, "model": cpu_model()}
        result = self.stage("threads", {**base, "context": q.context, "prefill_len": q.prefill_len,
                                        "cpus": cpus, "torch": torch.__version__},
                            build, ThreadsResult)
        self.ctx.adopt(result.plan)

    def quantize(self, base: dict[str, Any]) -> None:
        q = self.options.quantize

        def build(folder: Path) -> QuantizeResult:
            self.release_float()  # the stage loads (and rotates, rounds) its own copy
            result = quantize_to_artifact(q, folder / "artifact", self.ctx)
            return replace(result, artifact="artifact")  # relative to the stage folder

        # the recipe as resolved (a file's content, a built-in's current rules and rotation), not its name
        inputs = {**base, "options": to_json(q), "recipe": self.recipe.to_dict(), "device": str(self.ctx.device)}
        self.stage("quantize", inputs, build, QuantizeResult)

    def evaluate(self, name: str, of: str | None, base: dict[str, Any]) -> None:
        """Perplexity on the eval corpus of the float model (``of`` None) or of the graphs made
        by stage ``of`` ("quantize": PT2E programs, "export": ONNX on ONNX Runtime's CPU provider)."""
        e = self.options.eval
        ctx = self.ctx if of != "export" else self.ctx.on("cpu")  # ONNX Runtime takes CPU tensors

        def build(_folder: Path) -> EvalResult:
            if of is None:  # whole windows: the calibrate phase's shape
                try:
                    with ctx.scope("calibrate") as threads:
                        return evaluate_model(self.loaded, self.documents, e.context, batch_size=e.batch_size,
                                              max_tokens=e.max_tokens, num_threads=threads, progress=ctx.progress,
                                              device=ctx.device)
                finally:
                    self.loaded.model.to("cpu")  # the later stages run it on the CPU
            programs = self.artifact_programs() if of == "quantize" else self.export_programs()
            loaded = self.unrotated_float()
            model = loaded.model.to(ctx.device)  # the reference: scored on each batch of windows right after the graphs
            try:
                with ctx.scope("prefill"):  # prefill chunks
                    result = programs.to(ctx.device).evaluate(self.tokenizer, self.documents, e.context,
                                                              max_tokens=e.max_tokens, progress=ctx.progress,
                                                              device=ctx.device,
                                                              reference_fn=lambda tokens: forward_logits(model, tokens))
            finally:
                model.to("cpu")  # the later stages run it on the CPU
            return replace(result, reference={"model": loaded.name, **result.reference})

        inputs = {**base, "options": to_json(e), "of": self.keys[of] if of else "float", "device": str(ctx.device)}
        if of is not None:  # kld_mean, kld_p99, top1_agreement against the float model (docs/design.md §14)
            inputs["kl_divergence"] = True
        self.stage(name, inputs, build, EvalResult)

    def unrotated_float(self) -> Any:
        """The float model as loaded: the reference of the divergence from float. A copy that
        :meth:`float_in_artifact_basis` rotated computes the same function only to float rounding,
        so it is dropped and loaded again (seconds)."""
        if self._rotated:
            self.release_float()
        return self.loaded

    def artifact_programs(self) -> Programs:
        return open_programs(artifact=str(self.folders["quantize"] / "artifact"))

    def export_programs(self) -> Programs:
        return open_programs(onnx=str(self.folders["export"] / "onnx"), provider="cpu")

    def float_in_artifact_basis(self) -> torch.nn.Module:
        """The float model with the rotations the quantize stage folded into the artifact's
        weights (same seed, so the same matrices): layer outputs are then compared in one basis.
        Rotated in place (no second copy of the weights); the model computes the same function
        to float rounding (npuq.optimize.rotate), so the stages after this one may use it."""
        rotation = read_artifact(self.folders["quantize"] / "artifact").rotation
        if rotation and not self._rotated:
            rotate_as(self.loaded.model, rotation)
            self._rotated = True
        return self.loaded.model

    def layers(self) -> None:
        o, ctx = self.options, self.ctx.on("cpu")

        def build(_folder: Path) -> dict[str, Any]:
            programs = self.artifact_programs()
            ids = corpus_tokens(self.tokenizer, o.eval_corpus, o.sqnr_tokens, split="eval")
            model = self.float_in_artifact_basis()
            with ctx.scope("prefill"):
                errors = layer_errors(model, programs.graphs, programs.config, programs.context, ids)
            return {"tokens": len(ids), "layers": [e.to_dict() for e in errors]}

        self.stage("layers", {"of": self.keys["quantize"], "corpus": o.eval_corpus, "tokens": o.sqnr_tokens}, build)

    def generate(self) -> None:
        o, ctx = self.options, self.ctx.on("cpu")

        def build(_folder: Path) -> dict[str, Any]:
            programs = self.artifact_programs()
            rows = []
            for prompt in o.prompts:
                kwargs = {"max_new_tokens": o.gen_tokens, "context": programs.context,
                          "prefill_len": max(programs.graphs), "ctx": ctx}
                ref = generate(self.loaded, prompt, **kwargs)
                quant = generate(self.loaded, prompt, graphs=programs.graphs, **kwargs)
                rows.append({"prompt": prompt, "float": ref.text, "quantized": quant.text,
                             "same_tokens": common_prefix(ref.token_ids, quant.token_ids), "tokens": len(ref.token_ids),
                             "float_tokens_per_second": ref.tokens_per_second,
                             "quantized_tokens_per_second": quant.tokens_per_second})
            return {"generations": rows}

        self.stage("generate", {"of": self.keys["quantize"], "prompts": list(o.prompts), "tokens": o.gen_tokens}, build)

    def export(self) -> None:
        x = self.options.export

        def build(folder: Path) -> ExportResult:
            self.release_float()  # neither export nor the exported graphs' evaluation needs it
            result = export_artifact(self.folders["quantize"] / "artifact", folder / "onnx", x, target=self.target)
            return replace(result, files={k: str(Path(v).relative_to(folder)) for k, v in result.files.items()})

        # the resolved target too: a different SDK found in the environment is a new export
        inputs = {"of": self.keys["quantize"], "options": to_json(x), "target": self.target.describe()}
        self.stage("export", inputs, build, ExportResult)

    # ------------------------------------------------------------------ the whole job
    def check(self) -> None:
        """What the records cannot check alone (files, corpora, the environment), before the first stage."""
        self.recipe = check_quantize(self.options.quantize)[0]
        self.target = self.options.export.target()
        self.documents = load_corpus(self.options.eval_corpus, "eval")
        model_identity(self.options.model)

    def execute(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.check()
        with RunDir(self.out) as self.run:  # only once the options are known to be good; locked until the end
            return self._execute(start)

    def _execute(self, start: float) -> dict[str, Any]:
        if self.run.interrupted is not None:
            self.say(f"npuq run: the previous run in {self.out} was interrupted (stage "
                     f"{self.run.interrupted.get('stage') or 'between stages'}); finished stages are reused")
        if self.options.export.htp_arch is None and self.options.export.soc is None:
            self.say("npuq run: no target chip (--soc / --htp-arch): the export will lower the attention MatMuls' "
                     "second inputs at 8 bits, which every HTP accepts, so the exported graphs will not have the "
                     "quantized model's numerics (Qwen2.5-Coder-0.5B: 1.07x its perplexity); pass --soc of your "
                     "chip (e.g. --soc SM8650) to export what you measured")
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


def release_memory() -> None:
    """Free what the last stage dropped, now: FX graph modules hold reference cycles, so their
    weights wait for the cycle collector; and glibc keeps freed heap pages (tensors under its
    mmap threshold, up to 32 MB) unless asked to return them. Measured on Qwen2.5-Coder-0.5B
    (bench/run_memory.py): the stages from eval-float to eval-exported peaked at 15.1 GB without
    this and at 8.6 GB with it."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to ask
            pass


def _plain(result: Any) -> Any:
    return result if isinstance(result, dict) else to_json(result)


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


def run_job(options: RunOptions, out: str | os.PathLike, ctx: ExecutionContext | None = None) -> dict[str, Any]:
    """Run every stage into ``out`` (reusing finished ones) and return report.json's content.
    ``ctx``: where the work runs (default: automatic device and threads, with progress)."""
    return Job(options, Path(out), ctx or ExecutionContext.create(progress=True)).execute()
