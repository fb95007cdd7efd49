"""Drive the static graphs the way a device runner does.

The runner owns the KV cache: one K store (B, KV, D, ctx) and one V store (B, KV, ctx, D) per
layer (views of one tensor for all layers), filled left to right (slot j holds position j). A
graph of ar_len T sees the first C = ctx - T slots; after each call the runner copies the
graph's new K/V entries into the slots of the real (not padded) tokens. Graphs are plain
callables taking and returning torch tensors, so the same runner drives the eager module, an
exported program or an ONNX session. Every tensor the runner builds (mask, positions, caches,
token ids) lives on the device of the tokens it is given or the ``device`` it is created for,
never implicitly on the CPU.

A prompt goes through prefill chunks (the last one padded); a single token, every step of
generation, goes through the decode graph: padding it to a prefill chunk costs N tokens of
compute for one (with N = 32 that made float generation ~3x slower than transformers).

The eager float decoder (a :class:`StaticDecoder` itself, not an exported program) runs a
fast path: it takes any cache length, so it is given only the n_past filled slots and a mask
over just those keys and the new tokens, instead of all C (a step attends to the filled prefix
as transformers does), and its attention runs as one fused kernel per layer
(``fused_attention``: at two threads on a busy host the graph's three OpenMP regions per layer
doubled a decode step). The slots it skips are masked in the static layout (weight
exp(MASK_VALUE + score - max), which underflows to exactly 0 in fp32), so the logits are the
static layout's within fp32 rounding (tests/runtime/test_runner_decode_path.py). Exported
programs and ONNX sessions always get the fixed device layout and run their own ops.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from npuq.errors import NpuqError
from npuq.models.config import ModelConfig
from npuq.models.decoder import MASK_VALUE, StaticDecoder
from npuq.resources import USABLE_FRACTION, available_memory, release_freed_memory

# A graph takes (tokens, mask, positions, K caches, V caches) and returns (logits, K news, V news).
# A graph whose caches hold quantized codes (an exported ONNX graph) says what an empty slot
# holds with an attribute ``empty_cache``: one value per cache input, K layers then V layers
# (the zero point: the code of 0.0). Without it an empty slot holds 0.0.
Graph = Callable[..., Sequence[torch.Tensor]]

MODES = ("calibrate", "prefill", "decode")


def build_mask(
    key_positions: torch.Tensor, key_valid: torch.Tensor, query_positions: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Additive mask (T, S): 0 where query t may attend key s, MASK_VALUE elsewhere.

    A key is visible when it holds a real token, is not in the future and, for sliding-window
    layers, lies less than ``window`` positions back (the query itself included).
    """
    q = query_positions[:, None]  # (T, 1)
    k = key_positions[None, :]  # (1, S)
    allowed = key_valid[None, :] & (k <= q)
    if window is not None:
        allowed &= (q - k) < window
    return torch.where(allowed, 0.0, MASK_VALUE).to(torch.float32)


def graph_mask(cfg: ModelConfig, key_positions, key_valid, query_positions, batch: int) -> torch.Tensor:
    """Mask input (B, M, T, S): channel 0 full attention, channel 1 (if any) the sliding window."""
    masks = [build_mask(key_positions, key_valid, query_positions)]
    if cfg.has_sliding_layers:
        masks.append(build_mask(key_positions, key_valid, query_positions, cfg.sliding_window))
    return torch.stack(masks).unsqueeze(0).expand(batch, -1, -1, -1).contiguous()


def step_inputs(
    cfg: ModelConfig, tokens: torch.Tensor, n_past: int, context: int, n_real: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, mask and positions for one call of a graph with ar_len T = tokens.shape[1].

    The cache holds ``n_past`` real entries in its first slots; the call's tokens take positions
    n_past .. n_past + T - 1 of which the first ``n_real`` are real (the rest padding). Mask and
    positions are built on the tokens' device.
    """
    batch, T = tokens.shape
    C = context - T
    if n_past > C:
        raise ValueError(f"{n_past} cached tokens do not fit a cache of {C} slots")
    n_real = T if n_real is None else n_real
    device = tokens.device
    query_pos = torch.arange(n_past, n_past + T, device=device)
    cache_pos = torch.arange(C, device=device)
    key_pos = torch.cat([cache_pos, query_pos])
    key_valid = torch.cat([cache_pos < n_past, torch.arange(T, device=device) < n_real])
    mask = graph_mask(cfg, key_pos, key_valid, query_pos, batch)
    positions = query_pos.to(torch.int32).unsqueeze(0).expand(batch, -1).contiguous()
    return tokens, mask, positions


def example_inputs(
    cfg: ModelConfig, mode: str, context: int, ar_len: int | None = None, batch: int = 1
) -> tuple[torch.Tensor, ...]:
    """Example inputs of a graph (for torch.export and benchmarks), empty cache.

    calibrate: T = context, no cache inputs; prefill: T = ar_len (default 32); decode: T = 1.
    """
    if mode not in MODES:
        raise NpuqError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    T = {"calibrate": context, "prefill": ar_len or 32, "decode": 1}[mode]
    if T > context:
        raise NpuqError(f"ar_len {T} exceeds the context {context}")
    tokens = torch.zeros(batch, T, dtype=torch.long)
    inputs = step_inputs(cfg, tokens, 0, context)
    C = context - T
    if mode == "calibrate":
        return inputs
    KV, D, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    k_caches = tuple(torch.zeros(batch, KV, D, C) for _ in range(L))
    v_caches = tuple(torch.zeros(batch, KV, C, D) for _ in range(L))
    return (*inputs, *k_caches, *v_caches)


def forward_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) of a full causal forward with an empty cache (the calibrate graph)."""
    batch, T = tokens.shape
    if T > model.max_context:
        raise NpuqError(f"{T} tokens exceed the model's prepared context of {model.max_context}")
    with torch.no_grad():
        inputs = step_inputs(model.config, tokens, 0, T)
        return model(*inputs)[0]


class StaticRunner:
    """Runs a prompt through prefill (AR-N) chunks and then AR-1 decode steps.

    ``graphs`` maps ar_len → callable: decode (ar_len 1) and at most one prefill length N,
    each taking ``batch`` rows. A feed of a single token, and tokens that do not fill a whole
    prefill chunk near the end of the context, go through decode steps; longer feeds go through
    prefill chunks, the last one padded even when it holds one token (:func:`feed_schedule`). A runner without a decode
    graph takes only feeds that need none. The KV cache, token ids, mask and positions live on
    ``device``, where the graphs' weights must be (an ONNX session takes and returns CPU
    tensors: keep the CPU).

    ``fast_path`` (module docstring: only the filled cache slots, fused attention): None
    (default) for the graphs that are the eager :class:`StaticDecoder`; False: every graph gets
    the static device layout and runs the exported graph's ops, as a device would.
    """

    def __init__(self, cfg: ModelConfig, graphs: dict[int, Graph], context: int, batch: int = 1,
                 device: str | torch.device = "cpu", fast_path: bool | None = None):
        if not graphs or len(set(graphs) - {1}) > 1:
            raise ValueError(f"the runner takes a decode graph and at most one prefill graph, got ar_lens {sorted(graphs)}")
        self.cfg, self.graphs, self.context, self.batch = cfg, graphs, context, batch
        self.device = torch.device(device)
        self.prefill_len = max(graphs)
        self.fast_path = {T: isinstance(g, StaticDecoder) and fast_path is not False for T, g in graphs.items()}
        KV, D, L = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
        # One store per kind for all layers, so a call's cache views and writes are one op each
        # rather than one per layer; self.k[i] / self.v[i] are layer i's views of it.
        self._k_store = torch.zeros(L, batch, KV, D, context, device=self.device)  # (L, B, KV, D, ctx)
        self._v_store = torch.zeros(L, batch, KV, context, D, device=self.device)  # (L, B, KV, ctx, D)
        # (indexing, not unbind: torch's lazy backend, the device tests' stand-in, breaks on unbind views)
        self.k = [self._k_store[i] for i in range(L)]  # (B, KV, D, ctx) per layer
        self.v = [self._v_store[i] for i in range(L)]  # (B, KV, ctx, D) per layer
        # Empty slots are masked, but the mask is a finite number (docs/design.md §9): a slot
        # holding code 0 dequantizes to -zero_point·scale (-145 for a Qwen2.5 K cache), and
        # q·k of such keys outweighs the mask. So a code-fed graph's empty slots hold its zero
        # point, which is 0.0 as the float programs see it.
        fill = getattr(graphs[min(graphs)], "empty_cache", None)
        if fill is not None:
            if len(fill) != 2 * L:
                raise ValueError(f"empty_cache has {len(fill)} values for {2 * L} cache inputs")
            for i in range(L):
                self.k[i].fill_(fill[i])
                self.v[i].fill_(fill[L + i])
        self.n_past = 0

    def _call(self, tokens: torch.Tensor, n_real: int) -> torch.Tensor:
        T = tokens.shape[1]
        if self.n_past + T > self.context:
            raise ValueError(f"{self.n_past} cached tokens do not fit a cache of {self.context - T} slots")
        # The static layout: C = ctx - T slots, of which the first n_past are filled. Fast path:
        # the same call as if the context were n_past + T (the first n_past slots, all filled).
        fast = self.fast_path[T]
        C = self.n_past if fast else self.context - T
        inputs = step_inputs(self.cfg, tokens, self.n_past, C + T, n_real)
        caches = [k[..., :C] for k in self.k] + [v[:, :, :C] for v in self.v]
        with torch.no_grad():
            out = self.graphs[T](*inputs, *caches, fused_attention=True) if fast else self.graphs[T](*inputs, *caches)
        L = self.cfg.num_layers
        start, end = self.n_past, self.n_past + n_real
        self._k_store[..., start:end] = torch.stack(out[1 : 1 + L])[..., :n_real]  # (L, B, KV, D, n_real)
        self._v_store[:, :, :, start:end] = torch.stack(out[1 + L : 1 + 2 * L])[:, :, :, :n_real]
        self.n_past = end
        return out[0][:, :n_real]  # (B, n_real, V)

    def feed(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append tokens to the cache of every row; returns the logits (B, len, V) of those tokens."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        return self.feed_rows(ids.unsqueeze(0).expand(self.batch, -1))

    def feed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Append tokens (B, T), one sequence per row, to the cache; returns their logits (B, T, V)."""
        if ids.shape[0] != self.batch:
            raise ValueError(f"{ids.shape[0]} rows for a runner of batch {self.batch}")
        if self.n_past + ids.shape[1] > self.context:
            raise NpuqError(
                f"{self.n_past + ids.shape[1]} tokens do not fit the context of {self.context}: "
                "raise --context or shorten the input"
            )
        logits, i = [], 0
        for ar_len, n_real in feed_schedule(self.n_past, ids.shape[1], self.prefill_len, self.context):
            if ar_len not in self.graphs:
                raise ValueError(f"this feed needs the graph of ar_len {ar_len}, which the runner was not given")
            chunk = ids[:, i : i + n_real]
            if n_real < ar_len:  # pad the last chunk; padded entries never reach the cache
                chunk = torch.cat([chunk, chunk.new_zeros(self.batch, ar_len - n_real)], dim=1)
            logits.append(self._call(chunk, n_real))
            i += n_real
        return logits[0] if len(logits) == 1 else torch.cat(logits, dim=1)


def feed_schedule(n_past: int, n_tokens: int, prefill_len: int, context: int) -> list[tuple[int, int]]:
    """(ar_len, real tokens) of each call that appends ``n_tokens`` to a cache holding ``n_past``:
    a single token (a generation step) is one decode step (ar_len 1); more go through prefill
    chunks of ``prefill_len``, the last one padded (a leftover single token too), while a whole
    chunk fits the context, and decode steps for the rest. These are the calls onnxruntime-genai
    makes on an ``npuq export --genai shared`` folder (docs/design.md §11), so both compute the
    same logits."""
    steps = []
    single = n_tokens == 1
    while n_tokens > 0:
        n_real = min(prefill_len, n_tokens)
        if prefill_len > 1 and not single and n_past + prefill_len <= context:
            steps.append((prefill_len, n_real))
        else:
            n_real = 1
            steps.append((1, 1))
        n_past += n_real
        n_tokens -= n_real
    return steps


def run_programs(cfg: ModelConfig, graphs: dict[int, Any], context: int, tokens: torch.Tensor,
                 batched: Any = None) -> torch.Tensor:
    """Logits (B, T, V) of each row of ``tokens`` fed from an empty cache through ``graphs``
    (decode and prefill at batch 1), the way a device runs them. ``batched``: the prefill
    program at a batch of several rows (a PT2E program; its batch is its tokens input's): rows
    whose feed is prefill chunks only go through it that many at a time (the last group padded
    with copies of its last row), so a chunk reads the weights once for all of them. Each row
    still takes the same calls, at the same cache slots, as on its own."""
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (B, T), got shape {tuple(tokens.shape)}")
    if tokens.shape[1] > context:
        raise NpuqError(f"{tokens.shape[1]} tokens exceed the programs' context of {context}: shorten the input")
    if all(isinstance(g, PartChain) and g.in_turn for g in graphs.values()):
        return run_in_turn(cfg, graphs, context, tokens)
    rows, start = [], 0
    prefill_len = max(graphs)
    if batched is not None and all(ar_len == prefill_len for ar_len, _ in
                                   feed_schedule(0, tokens.shape[1], prefill_len, context)):
        size = tokens_shape(batched)[0]
        while tokens.shape[0] - start >= 2:  # one row left over goes alone: padding it costs more
            group = tokens[start : start + size]
            padded = torch.cat([group, group[-1:].expand(size - group.shape[0], -1)])
            runner = StaticRunner(cfg, {prefill_len: batched}, context, batch=size, device=tokens.device)
            rows.append(runner.feed_rows(padded)[: group.shape[0]])
            start += group.shape[0]
    for row in tokens[start:]:  # a fresh tensor per row: torch's lazy backend (the device tests) breaks on row views
        rows.append(StaticRunner(cfg, graphs, context, device=tokens.device).feed(row.tolist()))
    return torch.cat(rows, dim=0)


class PartChain:
    """The programs of a model quantized in parts (:func:`npuq.calibrate.graphs.part_graph`), or
    the graphs of a sharded export (:func:`npuq.lower.ort.load_export`), called as one program:
    (tokens, mask, positions, K caches, V caches) → (logits, K news, V news). Each part gets the
    hidden states the one before it returned and its own layers' caches, as a device runs
    context binaries in sequence.

    ``in_turn``: :func:`run_programs` runs such chains part by part instead (:func:`run_in_turn`),
    releasing each part's programs (their ``release()``, where they have one) before the next
    part runs, so a scoring run holds one part in memory, not the model. Called as one program
    (every generation step needs every part), such a chain keeps a part loaded only while
    memory allows (:class:`Residency`, shared by the chains of one model): the parts that do not
    fit are read again at each call."""

    def __init__(self, layers: Sequence[tuple[int, int]], programs: Sequence[Any], in_turn: bool = False,
                 residency: Residency | None = None):
        if len(layers) != len(programs) or not layers:
            raise ValueError(f"{len(programs)} programs for {len(layers)} parts")
        self.layers, self.programs, self.in_turn = tuple(layers), tuple(programs), in_turn
        self.num_layers = self.layers[-1][1]
        self.residency = residency or Residency()
        self.resident: dict[int, bool] = {}  # in turn: part → kept loaded between calls (decided on its first call)

    @property
    def empty_cache(self) -> tuple[float, ...] | None:
        """What the parts' empty cache slots hold (:class:`StaticRunner`), K of every layer then
        V, when the parts say (exported graphs that take codes); else None."""
        fills = [getattr(p, "empty_cache", None) for p in self.programs]
        if any(f is None for f in fills):
            return None
        k = [x for (first, end), f in zip(self.layers, fills) for x in f[: end - first]]
        v = [x for (first, end), f in zip(self.layers, fills) for x in f[end - first :]]
        return (*k, *v)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *caches: torch.Tensor):
        L = self.num_layers
        if len(caches) != 2 * L:
            raise ValueError(f"expected {2 * L} cache tensors (K then V per layer), got {len(caches)}")
        k_out: list[torch.Tensor] = []
        v_out: list[torch.Tensor] = []
        for k, ((first, end), program) in enumerate(zip(self.layers, self.programs)):
            n = end - first
            before = available_memory() if self.in_turn and k not in self.resident else 0
            out = program(x, mask, positions, *caches[first:end], *caches[L + first : L + end])
            if self.in_turn:
                if k not in self.resident:
                    self.resident[k] = self.residency.stays(max(0, before - available_memory()))
                if not self.resident[k]:
                    release(program)
                    release_freed_memory()  # back to the system now: the next part's footprint is its own
            x = out[0]
            k_out += out[1 : 1 + n]
            v_out += out[1 + n : 1 + 2 * n]
        return (x, *k_out, *v_out)


class Residency:
    """Which parts of a model run in turn stay loaded when every call needs every part (a
    generation step), shared by the model's chains (its prefill and decode graphs read the same
    weights). A part's footprint is the available memory its first call took (its programs read,
    weights dequantized, buffers); it stays while this process may still use twice the largest
    footprint seen, room to read another part that size beside it. Decided once per part, so
    the kept parts stay and the others are read again at each call (released, and the memory
    handed back to the system, after each); the logits are the same either way."""

    def __init__(self) -> None:
        self.largest = 0  # bytes

    def stays(self, footprint: int) -> bool:
        self.largest = max(self.largest, footprint)
        return USABLE_FRACTION * available_memory() > 2 * self.largest


class _PartTurn:
    """Part ``layers`` of a chain, called by a :class:`StaticRunner` as if it were the whole
    decoder (:func:`run_in_turn`): it takes the hidden states the part before it returned for
    the same call (``inputs``, in call order; None for the first part, which takes the token
    ids), keeps what it returns in ``outputs``, and gives zeros for the other layers' news
    (their cache slots are never read by this part)."""

    def __init__(self, program: Any, layers: tuple[int, int], num_layers: int, inputs: list[torch.Tensor] | None):
        self.program, (self.first, self.end), self.L = program, layers, num_layers
        self.inputs, self.outputs = inputs, []
        fill = getattr(program, "empty_cache", None)
        if fill is not None:
            n, before, after = self.end - self.first, (0.0,) * self.first, (0.0,) * (num_layers - self.end)
            self.empty_cache = (*before, *fill[:n], *after, *before, *fill[n:], *after)

    def __call__(self, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, *caches: torch.Tensor):
        L, first, end, n = self.L, self.first, self.end, self.end - self.first
        x = tokens if self.inputs is None else self.inputs[len(self.outputs)]
        out = self.program(x, mask, positions, *caches[first:end], *caches[L + first : L + end])
        self.outputs.append(out[0])
        k_none, v_none = torch.zeros_like(out[1]), torch.zeros_like(out[1 + n])
        return (out[0], *[k_none] * first, *out[1 : 1 + n], *[k_none] * (L - end),
                *[v_none] * first, *out[1 + n : 1 + 2 * n], *[v_none] * (L - end))


def run_in_turn(cfg: ModelConfig, chains: dict[int, PartChain], context: int, tokens: torch.Tensor) -> torch.Tensor:
    """What :func:`run_programs` returns for ``chains`` (one :class:`PartChain` per ar_len),
    computed part-major: every row's calls through the first part, then through the second on
    the hidden states the first returned, and so on, each part's programs released when it is
    done. Every call sees the inputs and cache it sees in the chained run (the same schedule,
    the same slots): the same logits, bit for bit."""
    first = next(iter(chains.values()))
    if any(c.layers != first.layers for c in chains.values()):
        raise ValueError("the chains of one model must have the same parts")
    received: list[dict[int, list[torch.Tensor] | None]] = [dict.fromkeys(chains) for _ in range(tokens.shape[0])]
    rows: list[torch.Tensor] = []
    for k, layers in enumerate(first.layers):
        rows = []
        for r, row in enumerate(tokens):
            turns = {ar: _PartTurn(c.programs[k], layers, first.num_layers, received[r][ar]) for ar, c in chains.items()}
            rows.append(StaticRunner(cfg, turns, context, device=tokens.device).feed(row.tolist()))
            received[r] = {ar: t.outputs for ar, t in turns.items()}
        for c in chains.values():
            release(c.programs[k])
    return torch.cat(rows, dim=0)


def release(program: Any) -> None:
    """Drop what a program read on demand (its ``release()``, where it has one)."""
    drop = getattr(program, "release", None)
    if drop is not None:
        drop()


def tokens_shape(program: Any) -> tuple[int, ...]:
    """The (batch, ar_len) of a static PT2E program (or of the first of a :class:`PartChain`):
    the shape of its tokens input (of a later part's hidden states, their first two sizes)."""
    if isinstance(program, PartChain):
        program = program.programs[0]
    known = getattr(program, "tokens_shape", None)  # a program read on demand says it without being read
    if isinstance(known, tuple):
        return known
    first = next(n for n in program.graph.nodes if n.op == "placeholder")
    return tuple(first.meta["val"].shape[:2])
