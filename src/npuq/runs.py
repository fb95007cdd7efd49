"""The options and results of ``npuq run``, typed: what the run's stages read and return, and
what its report (npuq.report) is built from. Below ``report`` and ``pipeline`` in the layering,
so the report depends on these records, never on the job that made them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from npuq.errors import NpuqError
from npuq.eval.layers import LayersOptions, LayersResult
from npuq.eval.perplexity import EvalOptions, EvalResult
from npuq.lower.export import ExportOptions, ExportResult
from npuq.models import ModelDescription
from npuq.quantize.stage import QuantizeOptions, QuantizeResult
from npuq.runtime.generate import GenerationsOptions, GenerationsResult
from npuq.runtime.tuning import ThreadsOptions, ThreadsResult
from npuq.threads import ExecutionSummary

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
    def threads(self) -> ThreadsOptions:
        q = self.quantize
        return ThreadsOptions(q.model, context=q.context, prefill_len=q.prefill_len)

    @property
    def eval(self) -> EvalOptions:
        return EvalOptions(self.eval_corpus, "eval", self.quantize.context, max_tokens=self.eval_tokens,
                           batch_size=EVAL_BATCH)

    @property
    def layers(self) -> LayersOptions:
        return LayersOptions(self.eval_corpus, self.sqnr_tokens)

    @property
    def generations(self) -> GenerationsOptions:
        return GenerationsOptions(self.prompts, self.gen_tokens)


@dataclass(frozen=True)
class StageEntry:
    """One line of a run's stage log."""

    stage: str
    key: str
    cached: bool
    seconds: float


@dataclass(frozen=True)
class RunResults:
    """Every stage's result of one finished run, and where its files are."""

    options: RunOptions
    execution: ExecutionSummary  # npuq.runtime.context.ExecutionContext.describe()
    model: ModelDescription  # npuq.models.LoadedModel.info()
    threads: ThreadsResult
    quantize: QuantizeResult
    eval_float: EvalResult
    eval_quantized: EvalResult
    layers: LayersResult
    generations: GenerationsResult
    export: ExportResult
    eval_exported: EvalResult
    out: Path  # the run folder: artifact/ and onnx/ are published there
    stages: tuple[StageEntry, ...]
    seconds: float  # the whole run
