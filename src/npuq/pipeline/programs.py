"""Open quantized graphs for running: an artifact's PT2E programs or an export's ONNX files.

Both give the same thing: the prefill and decode graphs keyed by ar_len, the model config
they were built from, their context and a LogitsFn that runs tokens (B, T) through them from
an empty cache (prefill chunks, then decode steps, as the device runner does). An artifact's
scoring program runs ``batch`` rows' prefill chunks per call (:func:`npuq.runtime.runner.run_programs`);
ONNX graphs take one row at a time. PT2E programs can move to a GPU (:meth:`Programs.to`);
ONNX sessions run on their provider and take CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from npuq.device import is_cpu, move_graph
from npuq.errors import NpuqError
from npuq.eval.perplexity import EvalResult, evaluate_perplexity
from npuq.models.config import ModelConfig
from npuq.runtime.runner import PartChain, run_programs, tokens_shape


@dataclass
class Programs:
    config: ModelConfig
    context: int
    graphs: dict[int, Any]  # ar_len → callable(*inputs) → (logits, *k_new, *v_new)
    model_source: str  # where the tokenizer comes from
    source: dict[str, Any]  # what was opened, for results
    scoring: Any = None  # an artifact's prefill program at a batch of several rows

    @property
    def batch(self) -> int:
        """Rows per call worth giving :meth:`logits` (the scoring program's batch, else 1)."""
        return 1 if self.scoring is None else tokens_shape(self.scoring)[0]

    def to(self, device: str | torch.device) -> Programs:
        """Move the PT2E programs to ``device`` in place; ONNX graphs accept only the CPU."""
        if is_cpu(device):
            return self  # saved programs and ONNX sessions are CPU already
        if "onnx" in self.source:
            raise NpuqError(f"--device {device}: ONNX graphs run where --provider places them and take CPU tensors; "
                            "use --device cpu with --onnx")
        for graph in {*self.graphs.values(), *([self.scoring] if self.scoring is not None else [])}:
            move_graph(graph, device)
        return self

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return run_programs(self.config, self.graphs, self.context, tokens, self.scoring)

    def evaluate(self, tokenizer: Any, documents: Any, context: int, **options: Any) -> EvalResult:
        """:func:`npuq.eval.perplexity.evaluate_perplexity` of these graphs, :attr:`batch` windows
        of any length per call, the result naming what was scored; ``options``: that function's."""
        result = evaluate_perplexity(self.logits, tokenizer, documents, context, batch_size=self.batch, mixed=True,
                                     **options)
        return replace(result, graphs=self.describe())

    def describe(self) -> dict[str, Any]:
        return {**self.source, "batch": self.batch}


def open_programs(artifact: str | None = None, onnx: str | None = None, provider: str = "cpu") -> Programs:
    if artifact:
        # torchao (1.4 s) loads only when an artifact is opened
        from npuq.quantize.artifact import load_artifact, read_artifact

        qm = load_artifact(artifact)
        model = read_artifact(artifact).model
        return Programs(qm.config, qm.context, qm.graphs(),
                        _model_source(model.name if model else None, model.source if model else None, artifact),
                        {"artifact": str(artifact), "scheme": qm.recipe.default, "recipe": qm.recipe.name},
                        qm.scoring)
    if onnx:
        # onnx (0.7 s) loads only when an export is opened
        from npuq.lower.ort import context_use, load_export

        manifest, graphs = load_export(onnx, provider)
        used, why = context_use(manifest, provider)
        return Programs(manifest.cfg, manifest.context, graphs,
                        _model_source(manifest.tokenizer.model, manifest.tokenizer.source, onnx),
                        {"onnx": str(onnx), "provider": provider, "qnn_version": manifest.target.qnn_version,
                         "files": sorted({p.file for g in graphs.values()
                                          for p in (g.programs if isinstance(g, PartChain) else (g,))}), "compiled_contexts": used,
                         "contexts": why})
    raise ValueError("give an artifact or an onnx folder")


def _model_source(name: str | None, source: str | None, where: str) -> str:
    """The model whose tokenizer to load: the recorded source when it is still there, else the name."""
    for value, is_source in ((source, True), (name, False)):
        if value and "\x00" not in value and (not is_source or Path(value).exists()):
            return value
    raise NpuqError(f"{where}: cannot tell which model's tokenizer to use (no model source recorded)")
