"""Rotations folded into the weights (QuaRot / SpinQuant style, no training): 4-bit weights
whose input channels carry no outliers.

References: S. Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs"
(NeurIPS 2024, arXiv:2404.00456); Z. Liu et al., "SpinQuant: LLM Quantization with Learned
Rotations" (ICLR 2025, arXiv:2405.16406). npuq folds only the rotations that need no extra op
in the graph, R1 and R2 in SpinQuant's names, with random (not learned) matrices; the online
Hadamards (QuaRot's on the down projection input and on Q/K, SpinQuant's R3/R4) would add ops
to the static graph and are not done.

**R1, the residual stream.** The residual stream h (a row vector of hidden size n) is carried
as h·R1 for one orthogonal R1 of the whole model:

- embedding table E → E·R1 (rows; Gemma's sqrt(hidden) scaling is a scalar and commutes);
- every pre-norm (``input_layernorm`` → q/k/v, ``post_attention_layernorm`` → gate/up in
  Llama-style blocks, Gemma's ``pre_feedforward_layernorm`` → gate/up, the final ``norm`` →
  lm head): its gamma g is first folded into the input side of the linears that read it,
  W → W·diag(g), and set to ones; then those linears' input side is rotated, W → W·diag(g)·R1;
- the linears that write the residual (``o_proj``, ``down_proj``) rotate their output side,
  W → R1ᵀ·W, and their bias b → R1ᵀ·b (``o_bias`` models);
- q/k/v outputs are not rotated by R1, so Qwen2's q/k/v biases stay as they are, while the
  scales of the weights and inputs they are added to shrink: their int32 codes then need the
  weight scale raised at quantization (npuq.quant.bias, docs/design.md §1 and §12).

Why this is exact. RMSNorm(x) = x / sqrt(mean(x²) + eps) ⊙ g. For an orthogonal Q over the
*full* vector that is normalised, ‖xQ‖ = ‖x‖, so mean((xQ)²) = mean(x²) (eps sits inside the
same square root and does not change), hence RMSNorm_{g=1}(xQ) = RMSNorm_{g=1}(x)·Q. With a
gamma, (xQ / r) ⊙ g = (x / r ⊙ g)·Q for every x only if diag(g) commutes with Q; for a dense Q
(every entry of a normalised Hadamard matrix is ±1/√n) that means g is a constant vector. So
a norm is rotation-invariant exactly when (1) it normalises over the whole hidden dimension
that Q rotates (never a per-head norm), and (2) its gamma is all-equal — which is made true by
folding gamma into the next linear layers, possible only when every reader of the norm's
output is a linear layer (a pre-norm). The residual adds are linear and commute with Q.
Gemma's "(1 + w)" gamma is no special case here: npuq's loader already added the 1
(``undo_norm_offset`` in ``npuq.models``), so the decoder's RMSNorm weight is the real gamma
and folding it sets the stored weight to ones.

**Gemma 3 (sandwich norms).** ``post_attention_layernorm`` and ``post_feedforward_layernorm``
read the block *output* (o_proj / down_proj) and feed the residual add directly, with no linear
layer after them to take a folded gamma or to apply R1. With the residual rotated their input
is rotated too, and by the condition above the result is exact only if each post-norm's gamma
is all-equal. Real Gemma checkpoints never have that, so :func:`rotate_model` then skips R1 for
the whole model (it cannot be applied to only some layers: the residual has one basis) and says
so in the report; R2 still applies. If every post-norm gamma is all-equal, R1 is applied and is
exact (the tests check both cases).

**R2, per head between v and o.** The value head vectors (head_dim D) are carried as v·R2 for
one orthogonal D×D R2 per layer: ``v_proj``'s output side per KV head, W_kv → R2ᵀ·W_kv, its
bias b_kv → R2ᵀ·b_kv (Qwen2); ``o_proj``'s input side per query head, W_h → W_h·R2 (query heads
sharing a KV head, GQA, see the same R2). Exact because between v and o there is only
attention's weighted sum over tokens (and the cache concat), which acts on the token axis and
commutes with a right multiplication on the head axis; no norm touches v (Qwen3's and Gemma's
per-head norms are on q and k only). R2 never touches q/k: their per-head norms (Qwen3, Gemma)
and RoPE do not commute with an arbitrary rotation. The V cache holds rotated values; prefill
and decode write and read it in the same basis.

**Tied embeddings.** After folding the final norm's gamma, the lm head (E·diag(g)·R1) differs
from the rotated table (E·R1), so the model is untied: npuq's decoder always holds the lm head
as its own parameter (docs/design.md §2; a shared Parameter would be split here), and
``model.config.tie_word_embeddings`` becomes False so that an artifact's recorded config says
what its weights are.

**The matrices.** A randomised Hadamard matrix R = diag(s)·H/√n, s random ±1 from ``seed``
(x·R = (x ⊙ s)·H: the signs mix before H, as in QuaRot).
Hidden sizes of real models are rarely powers of two (576 = 9·64, 640, 896 = 7·128, 1152,
1536), so H is a Kronecker product H_m ⊗ H_{2^k} of a Paley Hadamard matrix of order m
(Paley I: m = q + 1 for a prime q ≡ 3 mod 4, e.g. 12, 20; Paley II: m = 2(q + 1) for a prime
q ≡ 1 mod 4, e.g. 28, 36) and a Sylvester one: 576 = 36·16, 640 = 20·32, 896 = 28·32,
1152 = 36·32, 1536 = 12·128. A Hadamard matrix spreads one outlier channel evenly over all n
channels (every entry has the same magnitude), which a random orthogonal matrix does only on
average. Sizes no such product reaches fall back to a Haar-random orthogonal matrix (QR of a
seeded Gaussian, signs fixed by R's diagonal); the report names which was used.

**Applying R1.** Up to hidden size DENSE_MAX (1024) R1 is a dense float64 matrix; above it, a
product with R costs hidden multiply-adds per weight (3.6 k for a 7B), so it is applied by its
structure instead (:class:`Rotor`: the signs, then the Paley factor and two Sylvester factors
along three axes), the same matrix to float64 rounding (tests/optimize/test_rotate.py).

**Numerics.** Every product is computed in float64 and stored back in the weight's dtype, so
the rotated model differs from the original by one rounding of each stored weight (fp32: 6e-8
relative) and by the summation order of its matmuls: logits agree within ~1e-6 relative on the
tiny test models (tests/optimize/test_rotate.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
import time
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RotationReport", "Rotation", "Rotor", "rotation_operator", "hadamard_factors", "hadamard_matrix", "random_orthogonal", "rotation_matrix", "plan_rotation",
           "rotate_layers", "rotate_model", "rotate_streamed", "rotate_as"]

DENSE_MAX = 1024  # hidden sizes up to this are rotated by the dense matrix: no faster structured (576: 0.16 s vs 0.13 s)
_ROW_CHUNK = 8192  # rows of the embedding table / lm head rotated at a time (float64 copies stay small)


@dataclass(frozen=True)
class RotationReport:
    """What :func:`rotate_model` did. ``r1`` / ``r2``: applied; ``*_matrix``: how the matrix was
    built; ``r1_skipped``: why R1 was not applied although asked for (None otherwise)."""

    seed: int
    r1: bool
    r2: bool
    r1_matrix: str | None
    r2_matrix: str | None
    r1_skipped: str | None
    folded_norms: int  # RMSNorm gammas folded into the next linears (now ones)
    rotated_linears: int  # linear layers with at least one side rotated
    untied: bool  # the model had tied embeddings and no longer has
    seconds: float

    def describe(self) -> str:
        parts = [f"R1 {self.r1_matrix}" if self.r1 else None, f"R2 {self.r2_matrix}" if self.r2 else None]
        done = " and ".join(p for p in parts if p) or "nothing"
        text = (f"rotated {done} (seed {self.seed}): {self.folded_norms} norm gammas folded, "
                f"{self.rotated_linears} linear layers rotated in {self.seconds:.1f} s")
        return text + (f"; R1 not applied: {self.r1_skipped}" if self.r1_skipped else "")


# --------------------------------------------------------------------------- matrices
def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    i = 2
    while i * i <= q:
        if q % i == 0:
            return False
        i += 1
    return True


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j - i) with χ the quadratic character mod the prime q."""
    chi = torch.full((q,), -1.0, dtype=torch.float64)
    chi[0] = 0.0
    for a in range(1, q):
        chi[a * a % q] = 1.0
    idx = (torch.arange(q).unsqueeze(0) - torch.arange(q).unsqueeze(1)) % q
    return chi[idx]


def _paley(m: int) -> tuple[torch.Tensor, str] | None:
    """A Hadamard matrix of order m from Paley's constructions with a prime q, or None."""
    q = m - 1
    if q % 4 == 3 and _is_prime(q):  # Paley I: I + [[0, 1ᵀ], [-1, Q]], Q antisymmetric
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1.0, -1.0, _jacobsthal(q)
        return torch.eye(m, dtype=torch.float64) + s, f"paley1(q={q})"
    if m % 2 == 0:
        q = m // 2 - 1
        if q % 4 == 1 and _is_prime(q):  # Paley II: C = [[0, 1ᵀ], [1, Q]] symmetric conference matrix
            c = torch.zeros(m // 2, m // 2, dtype=torch.float64)
            c[0, 1:], c[1:, 0], c[1:, 1:] = 1.0, 1.0, _jacobsthal(q)
            a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)  # where C is 0 (the diagonal)
            b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)  # times C's ±1 entries
            return torch.kron(c, b) + torch.kron(torch.eye(m // 2, dtype=torch.float64), a), f"paley2(q={q})"
    return None


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_factors(n: int) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """(A, B, how) with A a Paley (or 1×1) and B a Sylvester (or 1×1) ±1 matrix whose Kronecker
    product A ⊗ B is an n×n Hadamard matrix, float64; None when n is not 2^k times a Paley order
    (prime q). Prefers the smallest Paley factor (pure Sylvester for powers of two)."""
    if n < 1:
        raise ValueError(f"matrix size must be positive, got {n}")
    one = torch.ones(1, 1, dtype=torch.float64)
    two = n & -n  # largest power of two dividing n
    m = n // two
    while m <= n:
        if m == 1:
            return one, _sylvester(n), f"sylvester({n})"
        found = _paley(m)
        if found is not None:
            h, how = found
            if m == n:
                return h, one, how
            return h, _sylvester(n // m), f"{how} x sylvester({n // m})"
        if (n // m) % 2:
            return None
        m *= 2
    return None


def hadamard_matrix(n: int) -> tuple[torch.Tensor, str] | None:
    """(H, how) with H an n×n ±1 matrix, H·Hᵀ = n·I, float64 (:func:`hadamard_factors`' product);
    None when no such matrix is constructed."""
    found = hadamard_factors(n)
    if found is None:
        return None
    a, b, how = found
    return torch.kron(a, b), how


def random_orthogonal(n: int, generator: torch.Generator) -> torch.Tensor:
    """A Haar-random n×n orthogonal matrix (QR of a Gaussian, signs fixed by R's diagonal), float64."""
    a = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()).double())


@dataclass(frozen=True)
class Rotor:
    """An orthogonal n×n matrix R applied without forming it where it has structure: the
    randomised Hadamard diag(s)·(A ⊗ B)/√n (:func:`hadamard_factors`), or a dense R. A row y
    (length n = m·b) seen as an m×b matrix Y has y·(A ⊗ B) = Aᵀ·Y·B, and B, a Sylvester matrix,
    is itself S(p) ⊗ S(b/p) with p ≈ √b: three small products along three axes cost
    m + p + b/p multiply-adds per element instead of n (Qwen2.5-7B's 3584 = 28·8·16: 52 instead
    of 3584). float64 throughout."""

    n: int
    signs: torch.Tensor | None = None  # (n,) ±1
    a: torch.Tensor | None = None  # (m, m)
    b: torch.Tensor | None = None  # (b, b)
    dense: torch.Tensor | None = None  # (n, n), where there is no Hadamard structure

    def right(self, x: torch.Tensor) -> torch.Tensor:
        """x·R for x (..., n), float64."""
        if self.dense is not None:
            return x @ self.dense.to(x.device)
        a, b = self.a.to(x.device), self.b.shape[0]
        p = 1 << ((b.bit_length() - 1) // 2)  # Sylvester(b) = Sylvester(p) ⊗ Sylvester(b / p), p ≈ √b
        lead = x.shape[:-1]
        y = (x * self.signs.to(x.device)).reshape(*lead, a.shape[0], b)
        if a.shape[0] > 1:
            y = a.T @ y  # along the Paley axis
        y = y.reshape(*lead, a.shape[0], p, b // p)
        y = _sylvester(p).to(x.device) @ y @ _sylvester(b // p).to(x.device)  # (symmetric)
        return y.reshape(x.shape) / self.n**0.5

    def left_t(self, w: torch.Tensor) -> torch.Tensor:
        """Rᵀ·w for w (n, k), float64: what the output side of a linear layer takes."""
        if self.dense is not None:
            return self.dense.to(w.device).T @ w
        return self.right(w.T).T

    def matrix(self) -> torch.Tensor:
        """R itself, (n, n) float64."""
        return self.right(torch.eye(self.n, dtype=torch.float64))


def rotation_operator(n: int, generator: torch.Generator) -> tuple[Rotor, str]:
    """(R, how): the randomised Hadamard diag(s)·H/√n with random signs s, or a random
    orthogonal matrix when no Hadamard matrix of order n is constructed. RᵀR = I."""
    found = hadamard_factors(n)
    if found is None:
        return Rotor(n, dense=random_orthogonal(n, generator)), f"random orthogonal (QR, n={n})"
    a, b, how = found
    signs = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64).double() * 2 - 1
    # diag(s)·H, not H·diag(s): the latter only flips the signs of the rotated channels, which
    # changes no scale of any per-channel or per-block format, so the seed would do nothing.
    if n <= DENSE_MAX:  # as fast dense, and the rotated weights of the models measured so far stay as they were
        return Rotor(n, dense=signs.unsqueeze(1) * torch.kron(a, b) / n**0.5), f"randomized hadamard {how}"
    return Rotor(n, signs, a, b), f"randomized hadamard {how}"


def rotation_matrix(n: int, generator: torch.Generator) -> tuple[torch.Tensor, str]:
    """:func:`rotation_operator` as a dense (n, n) float64 matrix."""
    rotor, how = rotation_operator(n, generator)
    return rotor.matrix(), how


# --------------------------------------------------------------------------- folding
def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def _rotate_input(linear: nn.Linear, rot: Rotor, gamma: torch.Tensor | None) -> None:
    """W → W·diag(gamma)·rot (rows in chunks, float64)."""
    w = linear.weight
    g = None if gamma is None else gamma.detach().to(w.device, torch.float64)
    with torch.no_grad():
        for start in range(0, w.shape[0], _ROW_CHUNK):
            rows = w[start : start + _ROW_CHUNK].double()
            if g is not None:
                rows = rows * g
            w[start : start + _ROW_CHUNK] = rot.right(rows).to(w.dtype)


def _rotate_output(linear: nn.Linear, rot: Rotor) -> None:
    """W → rotᵀ·W and b → rotᵀ·b: the layer's output y becomes y·rot."""
    _set(linear.weight, rot.left_t(linear.weight.double()))
    if linear.bias is not None:
        _set(linear.bias, rot.right(linear.bias.double()))


def _uniform(gamma: torch.Tensor) -> bool:
    return bool((gamma == gamma.flatten()[0]).all())


_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


def _sandwich_obstacle(gammas: list[tuple[str, torch.Tensor]]) -> str | None:
    """Why R1 would not be exact for a sandwich-norm model, given its post-norms' (name, gamma),
    or None when every post-norm gamma is all-equal."""
    bad = [name for name, gamma in gammas if not _uniform(gamma)]
    if not bad:
        return None
    return (f"sandwich norms: {len(bad)} post-attention/post-FFN RMSNorm(s) (first {bad[0]}) read the rotated block "
            "output and feed the residual with no linear after them, and their gamma is not all-equal, so "
            "RMSNorm(x R1) != RMSNorm(x) R1; the residual stream is left unrotated")


@dataclass(frozen=True)
class Rotation:
    """The matrices of one rotation of a whole model, made once (:func:`plan_rotation`) and
    folded into its weights layer by layer (:func:`rotate_layers`)."""

    seed: int
    r1: Rotor | None  # (hidden, hidden); None: no R1
    r2: tuple[torch.Tensor, ...] | None  # one (head_dim, head_dim) float64 per layer; None: no R2
    r1_how: str | None
    r2_how: str | None
    r1_skipped: str | None

    def report(self, cfg, seconds: float, untied: bool) -> RotationReport:
        """What folding this rotation into every layer of a model of config ``cfg`` does."""
        L = cfg.num_layers
        rotated = 7 * L + 1 if self.r1 is not None else 2 * L if self.r2 is not None else 0  # q k v gate up o down (+ head)
        return RotationReport(
            seed=self.seed, r1=self.r1 is not None, r2=self.r2 is not None, r1_matrix=self.r1_how,
            r2_matrix=self.r2_how, r1_skipped=self.r1_skipped, folded_norms=2 * L + 1 if self.r1 is not None else 0,
            rotated_linears=rotated, untied=untied, seconds=seconds)


def plan_rotation(cfg, gamma: Callable[[str], torch.Tensor], *, seed: int = 0, r1: bool = True,
                  r2: bool = False) -> Rotation:
    """The matrices of R1 and R2 for a model of config ``cfg``, drawn from ``seed``: R1 first,
    then one R2 per layer in order. R1 is left out (and why said) for a sandwich-norm model whose
    post-norm gammas are not all-equal; ``gamma(name)`` reads the weight ``name`` for that check."""
    skipped = None
    if r1 and getattr(cfg, "sandwich_norms", False):
        names = [f"layers.{i}.{norm}" for i in range(cfg.num_layers) for norm in _POST_NORMS]
        skipped = _sandwich_obstacle([(name, gamma(f"{name}.weight")) for name in names])
    gen = torch.Generator().manual_seed(int(seed))
    rot = r1_how = rot2 = r2_how = None
    if r1 and skipped is None:
        rot, r1_how = rotation_operator(cfg.hidden_size, gen)
    if r2:
        made = [rotation_matrix(cfg.head_dim, gen) for _ in range(cfg.num_layers)]
        rot2, r2_how = tuple(m for m, _ in made), made[0][1]
    return Rotation(int(seed), rot, rot2, r1_how, r2_how, skipped)


def _untie(model: nn.Module, rotation: Rotation) -> bool:
    """After R1 a tied model's head differs from its table: its config says untied from then on."""
    untied = rotation.r1 is not None and model.config.tie_word_embeddings
    if untied:
        model.config = dataclasses.replace(model.config, tie_word_embeddings=False)
    return untied


def rotate_layers(model: nn.Module, rotation: Rotation, first: int, end: int, *, embed: bool, head: bool) -> None:
    """Fold ``rotation`` into layers first … end - 1 of a StaticDecoder's weights, in place, and
    into its embedding table (``embed``) and final norm and lm head (``head``). Each weight goes
    through the same products whether the model is rotated whole or part by part."""
    # (where the part's weights are: a streamed model's others are on the meta device)
    device = (model.layers[first].self_attn.q_proj if first < end else model.embed_tokens).weight.device
    rot = rotation.r1
    if rot is not None and embed:
        emb = model.embed_tokens.weight
        with torch.no_grad():
            for s in range(0, emb.shape[0], _ROW_CHUNK):
                emb[s : s + _ROW_CHUNK] = rot.right(emb[s : s + _ROW_CHUNK].double()).to(emb.dtype)

    def fold(norm: nn.Module, readers: list[nn.Linear]) -> None:
        gamma = norm.weight.detach().clone()
        for linear in readers:
            _rotate_input(linear, rot, gamma)
        _set(norm.weight, torch.ones_like(norm.weight))

    D, KV, H = model.config.head_dim, model.config.num_kv_heads, model.config.num_heads
    for i in range(first, end):
        layer = model.layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        if rot is not None:
            fold(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj])
            fold(layer.pre_feedforward_layernorm if layer.sandwich else layer.post_attention_layernorm,
                 [mlp.gate_proj, mlp.up_proj])
            # (sandwich post-norms: all-equal gamma, checked by the caller; a scalar gamma commutes with R1)
            _rotate_output(attn.o_proj, rot)
            _rotate_output(mlp.down_proj, rot)
        if rotation.r2 is not None:
            rot2 = rotation.r2[i].to(device)
            v, o = attn.v_proj, attn.o_proj
            wv = v.weight.double().view(KV, D, -1)
            _set(v.weight, (rot2.T @ wv).reshape(KV * D, -1))  # each KV head's output → v_head·R2
            if v.bias is not None:
                _set(v.bias, (v.bias.double().view(KV, D) @ rot2).reshape(-1))
            wo = o.weight.double().view(o.weight.shape[0], H, D)
            _set(o.weight, (wo @ rot2).reshape(o.weight.shape[0], H * D))  # each query head's input ← R2ᵀ
    if rot is not None and head:
        fold(model.norm, [model.lm_head])


def rotate_model(model: nn.Module, *, seed: int = 0, r1: bool = True, r2: bool = False) -> RotationReport:
    """Fold rotations into a float :class:`~npuq.models.decoder.StaticDecoder`, in place; the
    model computes the same logits (to float rounding) in every mode. See the module docstring
    for what R1 and R2 are and when each is exact (Gemma 3: R1 only with all-equal post-norm
    gammas, otherwise skipped and reported)."""
    start = time.perf_counter()
    cfg = model.config
    rotation = plan_rotation(cfg, lambda name: model.get_parameter(name).detach(), seed=seed, r1=r1, r2=r2)
    if rotation.r1 is not None and model.lm_head.weight is model.embed_tokens.weight:
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())  # give the head its own
    rotate_layers(model, rotation, 0, cfg.num_layers, embed=True, head=True)
    return rotation.report(cfg, time.perf_counter() - start, _untie(model, rotation))


def rotate_streamed(model: nn.Module, *, seed: int = 0, r1: bool = True, r2: bool = False) -> RotationReport:
    """:func:`rotate_model` for a :class:`~npuq.models.stream.StreamedDecoder`: the matrices are
    made now (the sandwich-norm check reads the post-norm gammas only) and each part's weights
    are rotated as they are read (:meth:`~npuq.models.stream.StreamedDecoder.resident_part`),
    the same products as the resident model's, so the weights are the same bit for bit."""
    start = time.perf_counter()
    cfg = model.config
    rotation = plan_rotation(cfg, model.read, seed=seed, r1=r1, r2=r2)
    L = cfg.num_layers
    model.transform = lambda skeleton, first, end: rotate_layers(skeleton, rotation, first, end, embed=first == 0,
                                                                 head=end == L)
    return rotation.report(cfg, time.perf_counter() - start, _untie(model, rotation))


def rotate_as(model: nn.Module, record: dict) -> RotationReport:
    """Fold into ``model`` the rotations a :class:`RotationReport` (as recorded in an artifact's
    config.json) says were folded: the same seed and choices give the same matrices."""
    return rotate_model(model, seed=record["seed"], r1=record["r1"], r2=record["r2"])
