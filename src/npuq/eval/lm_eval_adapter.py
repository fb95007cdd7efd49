"""Task scores through lm-evaluation-harness: an ``lm_eval`` model that runs npuq's graphs
(docs/design.md §14).

:class:`NpuqLM` is a ``lm_eval.api.model.TemplateLM``: the harness tokenizes requests as it does
for its Hugging Face model (context and continuation encoded together, the trailing spaces of a
context moved to its continuation, an empty context replaced by the prefix token), and npuq
scores the tokens:

- ``loglikelihood``: Σ log p(continuation | context) and whether greedy decoding gives the
  continuation, from the last len(continuation) rows of one forward over the context and the
  continuation (the context cut on the left to fit the context length, as the harness does);
  several requests per call, right-padded with token 0 (a causal forward's logits of a token do
  not depend on later tokens), through any :data:`npuq.eval.perplexity.LogitsFn`: the float
  model's whole-window forward, or the quantized programs from an empty cache (prefill chunks,
  then decode steps with the quantized KV cache, as a device runs them).
- ``loglikelihood_rolling``: the rolling disjoint windows of ``npuq eval`` (docs/design.md §7),
  the harness's own scheme.
- ``generate_until``: greedy continuation through a :class:`npuq.runtime.runner.StaticRunner`
  over the graphs (the prompt in prefill chunks, then one decode step per token, the device
  flow), stopped at EOS, at ``max_gen_toks`` or as soon as the text holds one of ``until``, and
  cut before it. Sampling is refused: the device flow is greedy.

lm-eval is an optional dependency (``pip install 'npuq[tasks]'``); this module imports it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import lm_eval
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.tasks import TaskManager
from lm_eval.utils import make_table

from npuq.data.windows import Window, document_windows, length_batches
from npuq.errors import NpuqError
from npuq.eval.perplexity import LogitsFn, prefix_token_id, score_windows, window_logits, window_loglikelihood
from npuq.records import to_json
from npuq.runtime.runner import StaticRunner

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for generate_until


class NpuqLM(TemplateLM):
    """An lm-eval model over npuq graphs.

    ``tokenizer``: the model's Hugging Face tokenizer. ``config``: its ModelConfig (EOS, the
    runner's cache shapes). ``graphs``: ar_len → callable for generation (decode at 1 and one
    prefill length; the float model itself under both keys works). ``logits_fn``: tokens (B, T)
    → logits (B, T, V) from an empty cache, for scoring; ``batch``: rows worth giving it per
    call. ``context``: the longest sequence the graphs take. ``device``: where tokens go.
    """

    def __init__(self, tokenizer: Any, config: Any, graphs: dict[int, Any], logits_fn: LogitsFn, context: int,
                 batch: int = 1, device: str | torch.device = "cpu", name: str = "npuq") -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.config = config
        self.graphs = graphs
        self.logits_fn = logits_fn
        self.context = context
        self.batch = batch
        self._device = torch.device(device)
        self.name = name
        self._prefix = prefix_token_id(tokenizer)

    # ------------------------------------------------------------------ what the harness asks
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return self._prefix if eos is None else int(eos)

    @property
    def prefix_token_id(self) -> int:
        return self._prefix  # BOS if the tokenizer has one, else EOS: the harness's Hugging Face choice

    @property
    def max_length(self) -> int:
        return self.context

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", None) or self.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return list(self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens)))

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)

    # ------------------------------------------------------------------ scoring
    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str], list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """(Σ log p(continuation), greedy) of each (key, context tokens, continuation tokens)."""
        windows = []
        for i, (_key, context_enc, continuation_enc) in enumerate(requests):
            n = len(continuation_enc)
            if not 0 < n <= self.context:
                raise NpuqError(f"a continuation of {n} tokens cannot be scored in a context of {self.context} tokens: "
                                "raise --context, or choose a task with shorter answers")
            inputs = (list(context_enc) + list(continuation_enc))[-(self.context + 1):][:-1]  # (T,) T <= context
            windows.append(Window(i, tuple(inputs), tuple(continuation_enc)))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(windows)
        for batch in length_batches(windows, self.batch, mixed=True):
            logits = window_logits(self.logits_fn, windows, batch, self._device)  # (B, T, V)
            for row, i in enumerate(batch):
                w = windows[i]
                rows = logits[row, len(w.inputs) - len(w.targets): len(w.inputs)]  # (n, V): predict the targets
                greedy = bool((rows.argmax(dim=-1).cpu() == torch.tensor(w.targets)).all())
                results[i] = (window_loglikelihood(logits[row, : len(w.inputs)], w.targets), greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
            del logits
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Σ log p of each string's tokens, every token scored once in rolling windows."""
        token_lists = [self.tok_encode(req.args[0]) for req in requests]
        windows = document_windows(token_lists, self.prefix_token_id, self.context)
        totals = [0.0] * len(requests)
        for w, score in zip(windows, score_windows(self.logits_fn, windows, self.batch, device=self._device,
                                                   mixed=True)):
            totals[w.doc] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(copy.deepcopy(gen_kwargs or {}), DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
                raise NpuqError(f"the task asks to sample ({gen_kwargs}); npuq generates greedily, as the device "
                                "flow does: choose a task with greedy generation (do_sample false)")
            until = handle_stop_sequences(kwargs.get("until"), eos=self.tok_decode([self.eot_token_id]) or None)
            text = self.greedy(self.tok_encode(context), int(kwargs["max_gen_toks"]), until)
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return out

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, until: Sequence[str] = ()) -> str:
        """Greedy continuation of the token ids ``prompt`` (cut on the left so that the new tokens
        fit the context), cut before the first stop string of ``until``."""
        if max_new_tokens >= self.context:
            raise NpuqError(f"the task asks for {max_new_tokens} new tokens, which leaves no room for a prompt in a "
                            f"context of {self.context}: raise --context")
        prompt = list(prompt)[-(self.context - max_new_tokens):] or [self.prefix_token_id]
        runner = StaticRunner(self.config, self.graphs, self.context, device=self._device)
        eos = self.config.eos_token_id
        generated: list[int] = []
        logits = runner.feed(prompt)  # (1, T, V)
        while True:
            generated.append(int(logits[0, -1].argmax()))
            text = self.tok_decode(generated)
            if generated[-1] == eos or len(generated) >= max_new_tokens or any(s and s in text for s in until):
                break
            logits = runner.feed([generated[-1]])
        for stop in until:
            if stop:
                text = text.split(stop)[0]
        return text


def task_manager(tasks: Sequence[str], include_path: str | None = None) -> Any:
    """lm-eval's TaskManager that knows every name of ``tasks``; NpuqError naming the unknown ones.
    Only the YAML under ``include_path`` is indexed when it has them all (indexing the harness's
    own thousands of task files takes ~20 s)."""
    def missing(manager: Any) -> list[str]:
        return [t for t in tasks if not manager.match_tasks([t])]

    if include_path is not None:
        manager = TaskManager(include_path=include_path, include_defaults=False)
        if not missing(manager):
            return manager
    manager = TaskManager(include_path=include_path)
    unknown = missing(manager)
    if unknown:
        where = f" nor under --include-path {include_path}" if include_path else ""
        raise NpuqError(f"--tasks: {', '.join(unknown)} is not a task of lm-eval {lm_eval.__version__}{where}: "
                        "see 'lm_eval ls tasks', or give the folder of your task's YAML with --include-path")
    return manager


def run_tasks(lm: NpuqLM, tasks: Sequence[str], manager: Any, limit: float | None = None,
              num_fewshot: int | None = None) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of ``tasks`` (names ``manager`` knows: :func:`task_manager`)
    on ``lm``: {"results", "versions", "n-shot", "n-samples", "higher_is_better"} as the harness
    reports them, "lm_eval_version" and "table" (the harness's markdown table)."""
    results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                      task_manager=manager, log_samples=False)
    return {
        **{key: results.get(key, {}) for key in ("results", "versions", "n-shot", "n-samples", "higher_is_better")},
        "lm_eval_version": lm_eval.__version__,
        "table": make_table(results),
    }


@dataclass(frozen=True)
class TasksResult:
    """``npuq eval --tasks``: lm-eval's report as the harness gives it (its own keys, such as
    "n-shot") and what npuq ran the tasks on. :meth:`to_dict` writes the harness's keys first."""

    harness: dict[str, Any]  # :func:`run_tasks` without its table
    tasks: tuple[str, ...]
    graphs: dict[str, Any]  # what ran: the float model's name, or the graphs opened (Programs.describe)
    context: int
    limit: int | None  # --limit: documents scored per task; None: all
    num_fewshot: int | None  # --num-fewshot; None: each task's own
    seconds: float
    threads: int
    device: str

    def to_dict(self) -> dict[str, Any]:
        return {**self.harness, **{k: v for k, v in to_json(self).items() if k != "harness"}}
