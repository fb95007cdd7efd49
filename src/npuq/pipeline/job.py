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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from npuq import __version__
from npuq.data import load_corpus
from npuq.eval.layers import LayersInputs, LayersResult, run_layers
from npuq.eval.perplexity import EvalResult
from npuq.eval.stage import EvalInputs, run_eval
from npuq.fsio import atomic_dir, write_json, write_text
from npuq.lower.export import ExportResult, export_artifact
from npuq.models import ModelDescription, model_config, model_fits, open_model
from npuq.models.sources import resolve
from npuq.pipeline.programs import Programs, open_programs
from npuq.pipeline.stages import RunDir
from npuq.quantize.stage import QuantizeResult, check_quantize, quantize_to_artifact
from npuq.records import from_json, record_key, to_json
from npuq.report.build import build_report
from npuq.runs import RunOptions, RunResults
from npuq.runtime.context import ExecutionContext
from npuq.runtime.generate import GenerationsInputs, GenerationsResult, run_generations
from npuq.runtime.tuning import ThreadsResult, run_threads
from npuq.threads import cpu_limits, cpu_model


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


@dataclass(frozen=True)
class Stage:
    """One stage of a run: ``plan(job)`` returns (key, build, record type) of a cached stage,
    ``build(folder)`` making the result; or None for the report, which is always made."""

    name: str
    title: str
    plan: Callable[[Job], tuple[str, Callable[[Path], Any], type | None] | None]


@dataclass
class Job:
    options: RunOptions
    out: Path
    ctx: ExecutionContext

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.results: dict[str, Any] = {}  # stage → its result record (the model stage: its description)
        self.folders: dict[str, Path] = {}
        self.keys: dict[str, str] = {}
        self._tokenizer: Any = None

    def say(self, text: str) -> None:
        if self.ctx.progress:
            print(text, file=sys.stderr, flush=True)

    @functools.cached_property
    def loaded(self) -> Any:
        """The float model as loaded, once and only if a stage has to be built; no stage changes it.
        Streamed where it does not fit memory (one block resident at a time): then the threads
        are not timed and the layers stage is not measured (docs/design.md §13)."""
        return open_model(self.options.model, max_context=self.max_context, stream=self.streamed)

    @property
    def max_context(self) -> int:
        return max(self.options.quantize.context, 4096)

    @functools.cached_property
    def streamed(self) -> bool:
        """Whether the float model is streamed (it does not fit memory): from its config alone,
        so the stages that measure it differently say so in their keys before it loads."""
        return not model_fits(model_config(self.options.model, self.max_context))

    @property
    def streamed_tag(self) -> tuple[str, ...]:
        """What the keys of the stages that measure a streamed model differently add (nothing for
        a resident one, so its keys are those of runs before streaming)."""
        return ("streamed",) if self.streamed else ()

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
            release_memory()

    def run_stage(self, number: int, stage: Stage) -> None:
        """Stage ``stage`` under its key: reused when its folder is complete, else built; its
        result (a record, stored as JSON and read back typed) goes to ``self.results``."""
        self.say(f"[{number}/{len(STAGES)}] {stage.name}: {stage.title}")
        planned = stage.plan(self)
        if planned is None:
            return
        key, build, record = planned
        # a record type may reject its stored result (ThreadsResult: timed beside other work)
        folder, data = self.run.stage(stage.name, key, lambda tmp: _plain(build(tmp)), getattr(record, "stale", None))
        release_memory()  # the stage's programs and sessions, before the next stage allocates its own
        entry = self.run.log[-1]
        self.say(f"      {stage.name}: reused from {folder.relative_to(self.out)}" if entry.cached
                 else f"      {stage.name}: done in {entry.seconds:.1f} s")
        result = from_json(record, data, f"{folder / 'result.json'}") if record else data
        self.results[stage.name], self.folders[stage.name], self.keys[stage.name] = result, folder, key
        if isinstance(result, ThreadsResult):  # the later stages run at the measured counts
            self.ctx.adopt(result.plan)

    # ------------------------------------------------------------------ stages
    def model(self) -> tuple[str, Callable[[Path], ModelDescription], type]:
        return (record_key(__version__, model_identity(self.options.model)), lambda _folder: self.loaded.info(),
                ModelDescription)

    def threads(self) -> tuple[str, Callable[[Path], ThreadsResult], type]:
        options = self.options.threads
        limits = cpu_limits()  # the CPUs this process may use now: a new taskset or quota is a new plan
        cpus = {"ceiling": limits.ceiling, "affinity": limits.affinity, "quota": limits.quota, "model": cpu_model()}
        key = record_key(options, self.keys["model"], cpus, torch.__version__, *self.streamed_tag)
        return key, lambda _folder: run_threads(options, self.loaded.model, self.ctx), ThreadsResult

    def quantize(self) -> tuple[str, Callable[[Path], QuantizeResult], type]:
        q = self.options.quantize

        def build(folder: Path) -> QuantizeResult:
            self.release_float()  # the stage loads (and rotates, rounds) its own copy
            result = quantize_to_artifact(q, folder / "artifact", self.ctx)
            return replace(result, artifact="artifact")  # relative to the stage folder

        # the recipe as resolved (a file's content, a built-in's current rules and rotation), not its name
        key = record_key(q, self.recipe.to_dict(), str(self.ctx.device), self.keys["model"])
        return key, build, QuantizeResult

    def evaluate(self, of: str | None) -> tuple[str, Callable[[Path], EvalResult], type]:
        """Perplexity on the eval corpus of the float model (``of`` None) or of the graphs made
        by stage ``of`` ("quantize": PT2E programs, "export": ONNX on ONNX Runtime's CPU provider),
        with their divergence from the float model (docs/design.md §14)."""
        options = self.options.eval
        ctx = self.ctx if of != "export" else self.ctx.on("cpu")  # ONNX Runtime takes CPU tensors

        def build(_folder: Path) -> EvalResult:
            if of is None:  # whole windows: the calibrate phase's shape
                return run_eval(options, EvalInputs(self.documents, self.loaded), ctx)
            programs = self.artifact_programs() if of == "quantize" else self.export_programs()
            inputs = EvalInputs(self.documents, self.loaded, programs.to(ctx.device), self.tokenizer)
            return run_eval(options, inputs, ctx)

        upstream = self.keys[of] if of else self.keys["model"]
        return record_key(options, of or "float", upstream, str(ctx.device)), build, EvalResult

    def artifact_programs(self) -> Programs:
        return open_programs(artifact=str(self.folders["quantize"] / "artifact"))

    def export_programs(self) -> Programs:
        return open_programs(onnx=str(self.folders["export"] / "onnx"), provider="cpu")

    def layers(self) -> tuple[str, Callable[[Path], LayersResult], type]:
        options, ctx = self.options.layers, self.ctx.on("cpu")

        def build(_folder: Path) -> LayersResult:
            if self.streamed:  # no resident float layers to hook
                return LayersResult(0, ())
            programs = self.artifact_programs()
            inputs = LayersInputs(self.tokenizer, self.loaded.model, self.results["quantize"].rotation,
                                  programs.graphs, programs.config, programs.context)
            return run_layers(options, inputs, ctx)

        return record_key(options, self.keys["quantize"], *self.streamed_tag), build, LayersResult

    def generations(self) -> tuple[str, Callable[[Path], GenerationsResult], type]:
        options, ctx = self.options.generations, self.ctx.on("cpu")

        def build(_folder: Path) -> GenerationsResult:
            programs = self.artifact_programs()
            return run_generations(options, GenerationsInputs(self.loaded, programs.graphs, programs.context), ctx)

        return record_key(options, self.keys["quantize"]), build, GenerationsResult

    def export(self) -> tuple[str, Callable[[Path], ExportResult], type]:
        x = self.options.export

        def build(folder: Path) -> ExportResult:
            self.release_float()  # neither export nor the exported graphs' evaluation needs it
            result = export_artifact(self.folders["quantize"] / "artifact", folder / "onnx", x, target=self.target)
            return replace(result, files={k: str(Path(v).relative_to(folder)) for k, v in result.files.items()})

        # the resolved target too: a different SDK found in the environment is a new export
        return record_key(x, self.keys["quantize"], self.target.describe()), build, ExportResult

    def report(self) -> None:
        link_tree(self.folders["quantize"] / "artifact", self.out / "artifact")
        link_tree(self.folders["export"] / "onnx", self.out / "onnx")
        r = self.results
        results = RunResults(
            options=self.options, execution=self.ctx.describe(), model=r["model"], threads=r["threads"],
            quantize=r["quantize"], eval_float=r["eval-float"], eval_quantized=r["eval-quantized"],
            layers=r["layers"], generations=r["generate"], export=r["export"], eval_exported=r["eval-exported"],
            out=self.out, stages=tuple(self.run.log), seconds=time.perf_counter() - self.start)
        self.report_json, html = build_report(results)
        write_text(self.out / "report.html", html)
        write_json(self.out / "report.json", self.report_json)

    # ------------------------------------------------------------------ the whole job
    def check(self) -> None:
        """What the records cannot check alone (files, corpora, the environment), before the first stage."""
        self.recipe = check_quantize(self.options.quantize)[0]
        self.target = self.options.export.target()
        self.documents = load_corpus(self.options.eval_corpus, "eval")
        model_identity(self.options.model)

    def execute(self) -> dict[str, Any]:
        self.start = time.perf_counter()
        self.check()
        with RunDir(self.out) as self.run:  # only once the options are known to be good; locked until the end
            return self._execute()

    def _execute(self) -> dict[str, Any]:
        if self.run.interrupted is not None:
            self.say(f"npuq run: the previous run in {self.out} was interrupted (stage "
                     f"{self.run.interrupted.get('stage') or 'between stages'}); finished stages are reused")
        if self.options.export.htp_arch is None and self.options.export.soc is None:
            self.say("npuq run: no target chip (--soc / --htp-arch): the export will lower the attention MatMuls' "
                     "second inputs at 8 bits, which every HTP accepts, so the exported graphs will not have the "
                     "quantized model's numerics (Qwen2.5-Coder-0.5B: 1.07x its perplexity); pass --soc of your "
                     "chip (e.g. --soc SM8650) to export what you measured")
        for number, stage in enumerate(STAGES, 1):
            self.run_stage(number, stage)
        self.prune()
        self.run.finish()
        return self.report_json

    def prune(self) -> None:
        """Delete stage folders this run did not use (older keys): they can be large."""
        current = {f"{e.stage}-{e.key}" for e in self.run.log}
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


# The stages of a run, in order: declared once (name, title, the Job method that plans it).
STAGES = (
    Stage("model", "load the model and describe it", Job.model),
    Stage("threads", "fastest thread count per phase (decode, prefill, calibrate)", Job.threads),
    Stage("quantize", "calibrate, recover accuracy, write the quantized programs", Job.quantize),
    Stage("eval-float", "perplexity of the float model", lambda job: job.evaluate(None)),
    Stage("eval-quantized", "perplexity of the quantized programs (prefill + decode, quantized KV cache)",
          lambda job: job.evaluate("quantize")),
    Stage("layers", "per-layer quantization error (SQNR against float)", Job.layers),
    Stage("generate", "greedy generations, float and quantized", Job.generations),
    Stage("export", "lower to QDQ ONNX for the target SDK and HTP", Job.export),
    Stage("eval-exported", "perplexity of the exported graphs on ONNX Runtime (CPU, exact QDQ)",
          lambda job: job.evaluate("export")),
    Stage("report", "report.html and report.json", Job.report),
)


def run_job(options: RunOptions, out: str | os.PathLike, ctx: ExecutionContext | None = None) -> dict[str, Any]:
    """Run every stage into ``out`` (reusing finished ones) and return report.json's content.
    ``ctx``: where the work runs (default: automatic device and threads, with progress)."""
    return Job(options, Path(out), ctx or ExecutionContext.create(progress=True)).execute()
