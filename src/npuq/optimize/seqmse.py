"""SeqMSE: choose weight-quantization scales that minimise the layer's output error.

Published form (docs/design.md §5): one multiplier m for the whole scale tensor of a layer,
minimising ||X Wᵀ - X Q(W, s·m)ᵀ||² on calibration inputs X; a coarse grid
m ∈ linspace(1/N, 1, N), then a fine grid of N points within ±1/N of the best, clipped to
[0.001, 1]. Zero points stay 0 (symmetric weights).

npuq searches per output channel (or per block of input channels) instead: the output error
of channel c only depends on row c of the weight, ||X (w_c - q_c)||² = e_cᵀ H e_c with
H = XᵀX, so every channel has its own optimum. All candidates of a layer are evaluated in one
vectorised pass from the Gram matrix H (so any number of calibration windows costs the same),
and the per-channel search also scores the layer-level optimum, so `channel` never does worse
than `layer` on the calibration loss.

The coarse grid is scanned from m = 1 down and left once every unit's loss has grown past
4x its best (:func:`_coarse_scan`): smaller scales only clip more of the weights.

For speed the loss may use a low-rank-plus-diagonal approximation of H (its top ``rank``
eigen-directions exactly, the rest through the diagonal); ``rank=None`` is exact. The search
runs on the device of the weight and the Gram matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GRANULARITIES = ("layer", "channel")


def qmax_for(bits: int) -> int:
    """Largest code of the symmetric signed grid: [-qmax, qmax] (docs/design.md §1)."""
    return 2 ** (bits - 1) - 1


def minmax_scale(weight: torch.Tensor, bits: int, block_size: int | None = None) -> torch.Tensor:
    """Symmetric min/max scale per output channel (O,) or per block (O, I / block_size)."""
    w = weight if block_size is None else weight.view(weight.shape[0], -1, block_size)
    return (w.abs().amax(dim=-1) / qmax_for(bits)).clamp_min(1e-12)


def lpbq_scale(weight: torch.Tensor, bits: int, block_size: int, scale_bits: int = 4, eps: float = 0.0) -> torch.Tensor:
    """LPBQ block scales (O, I / block_size): each block's min/max scale (at least ``eps``)
    re-quantized against a per-channel base, base_c · k_cb with base_c = max_b s_cb / 2**scale_bits
    and k_cb = ceil(s_cb / base_c) in 1 .. 2**scale_bits (rounding up never clips a weight).
    The rule of npuq.quant.observers.LpbqPerChannelObserver, as a pure function."""
    steps = 2**scale_bits
    block = (weight.view(weight.shape[0], -1, block_size).abs().amax(dim=-1) / qmax_for(bits)).clamp_min(eps)
    base = block.amax(dim=1) / steps
    k = torch.clamp(torch.ceil(block / base[:, None] - 1e-6), 1, steps)
    return base[:, None] * k


def quantize_codes(weight: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (same shape as weight) for scale (O,) or (O, blocks); round half to even."""
    q = qmax_for(bits)
    blocked = scale.dim() == 2
    w = weight.view(weight.shape[0], scale.shape[1], -1) if blocked else weight
    s = scale.unsqueeze(-1)
    return torch.clamp(torch.round(w / s), -q, q).view_as(weight)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 weights (O, I) of integer ``codes`` (O, I) on ``scale`` (O,) or (O, blocks)."""
    c = codes.float()
    c = c.view(c.shape[0], scale.shape[1], -1) if scale.dim() == 2 else c
    return (c * scale.unsqueeze(-1)).view_as(codes)


def fake_quantize(weight: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize(quantize_codes(weight, scale, bits), scale)


def top_eigen(gram: torch.Tensor, rank: int, oversample: int = 16, iterations: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``rank`` largest eigenvalues (ascending) and their eigenvectors (columns) of a symmetric
    PSD matrix, by subspace iteration from a fixed random start with Rayleigh-Ritz (Halko et al.
    2011, Algorithm 4.4): O(n² · rank) instead of a full eigendecomposition's O(n³), which took
    2-3 s per 4864-wide down projection of Qwen2.5-Coder-0.5B. Activation Gram matrices have a few
    dominant directions, so a few iterations resolve the top ones (the tests measure how closely)."""
    n = gram.shape[0]
    start = torch.randn(n, rank + oversample, generator=torch.Generator().manual_seed(0)).to(gram)
    q = torch.linalg.qr(gram @ start).Q
    for _ in range(iterations):
        q = torch.linalg.qr(gram @ q).Q
    evals, small = torch.linalg.eigh(q.T @ gram @ q)
    return evals[-rank:], q @ small[:, -rank:]


@dataclass(frozen=True)
class GramFactor:
    """H ≈ A Aᵀ + diag(d): exact when A has full rank and d = 0."""

    a: torch.Tensor  # (I, r)
    d: torch.Tensor  # (I,)

    @classmethod
    def from_gram(cls, gram: torch.Tensor, rank: int | None = None) -> "GramFactor":
        g = gram.float()
        n = g.shape[0]
        if rank is not None and 4 * rank <= n:
            evals, evecs = top_eigen(g, rank)
        else:
            evals, evecs = torch.linalg.eigh(g)  # float32: 4x faster than double at I = 1536
        evals = evals.clamp_min(0)
        if rank is not None and rank < n:
            top = evals[-rank:]
            a = evecs[:, -rank:] * top.sqrt()
            d = (torch.diagonal(g) - (a * a).sum(1)).clamp_min(0)
        else:
            a = evecs * evals.sqrt()
            d = torch.zeros(gram.shape[0], device=gram.device)
        return cls(a.float(), d.float())

    def loss(self, err: torch.Tensor, consume: bool = False) -> torch.Tensor:
        """eᵀ H e over the last dimension of err (..., I); ``consume``: err may be overwritten
        (its square is taken in place, saving a buffer as large as err)."""
        low = (err @ self.a).square_().sum(-1)
        return low + (err.square_() if consume else err.square()) @ self.d


@dataclass(frozen=True)
class SearchResult:
    multipliers: torch.Tensor  # shape of the scale: (O,) or (O, blocks)
    scale: torch.Tensor  # minmax scale × multipliers
    loss_minmax: float  # calibration loss at m = 1
    loss: float  # calibration loss at the chosen multipliers
    evaluations: int  # candidate multipliers scored per unit


def _rounding_error(w: torch.Tensor, s: torch.Tensor, qmax: int, out: torch.Tensor) -> torch.Tensor:
    """w - fake_quant(w, s), written into ``out`` (w and s broadcast to its shape). This loop is
    memory bound: four passes over one reused buffer instead of six over a new one each time."""
    torch.div(w, s, out=out)
    out.round_().clamp_(-qmax, qmax)
    return torch.addcmul(w, out, s, value=-1.0, out=out)


def _unit_losses(weight, base_scale, mult, bits, factors, block_size, chunk_elems=1 << 21):
    """Loss per unit for each row of candidate multipliers mult (K, *scale_shape) → (K, *scale_shape).

    Candidates are processed a few at a time so the error buffer stays cache-sized (~8 MB):
    16x faster than one large buffer on a 2-core machine. A layer larger than that (an lm head)
    is scored a slice of output channels at a time (the units are independent). Fixed block
    scales ``base_scale`` (O, nb) with one multiplier per channel (mult (K, O)) are scored with
    the whole H.
    """
    O, I = weight.shape
    rows = max(1, chunk_elems // I)
    if O > rows:
        return torch.cat([_unit_losses(weight[r : r + rows], base_scale[r : r + rows], mult[:, r : r + rows], bits,
                                       factors, block_size, chunk_elems) for r in range(0, O, rows)], dim=1)
    qmax = qmax_for(bits)
    step = max(1, chunk_elems // (O * I))
    buffer = torch.empty(min(step, mult.shape[0]) * O * I, device=weight.device)
    out = []
    for start in range(0, mult.shape[0], step):
        buf = buffer[: min(step, mult.shape[0] - start) * O * I]  # the candidates of this chunk
        if base_scale.dim() == 2 and mult.dim() == 2:  # LPBQ: (k, O, nb, 1), whole channels scored
            s = (base_scale.unsqueeze(0) * mult[start : start + step].unsqueeze(-1)).unsqueeze(-1)
            err = _rounding_error(weight.view(1, O, base_scale.shape[1], -1), s, qmax,
                                  buf.view(-1, O, base_scale.shape[1], I // base_scale.shape[1]))  # (k, O, nb, B)
            out.append(factors.loss(err.flatten(2), consume=True))  # (k, O)
            continue
        s = (base_scale.unsqueeze(0) * mult[start : start + step]).unsqueeze(-1)  # (k, O, 1) or (k, O, nb, 1)
        if block_size is None:
            err = _rounding_error(weight.unsqueeze(0), s, qmax, buf.view(-1, O, I))  # (k, O, I)
            out.append(factors.loss(err, consume=True))  # (k, O)
        else:
            err = _rounding_error(weight.view(1, O, -1, block_size), s, qmax,
                                  buf.view(-1, O, I // block_size, block_size))  # (k, O, nb, B)
            # Blocks are scored independently with the block-diagonal part of H.
            out.append(torch.stack([f.loss(err[:, :, b], consume=True) for b, f in enumerate(factors)], dim=-1))  # (k, O, nb)
    return torch.cat(out)


def _fine_grid(center: torch.Tensor, n: int) -> torch.Tensor:
    """n points within ±1/n of each center (any shape), clipped to [0.001, 1] → (n, *center.shape)."""
    offsets = torch.linspace(-1.0 / n, 1.0 / n, n, device=center.device).view(n, *([1] * center.dim()))
    return (center.unsqueeze(0) + offsets).clamp(0.001, 1.0)


SCAN_BATCH, SCAN_STOP = 5, 4.0


def _coarse_scan(coarse: torch.Tensor, score) -> tuple[torch.Tensor, torch.Tensor]:
    """The coarse grid's rows (n, *shape) scored from m = 1 down, SCAN_BATCH at a time, until a
    batch in which every unit's loss exceeds SCAN_STOP × its best so far: below that the scale
    clips ever more of the weights. Returns (the rows scored, their losses). On SmolLM2-135M
    (R1, every layer per channel and LPBQ, 422 searches at N = 50) the scan stopped after 40 of
    50 rows on average and no unit's best row lay below where it stopped."""
    n = coarse.shape[0]
    losses, best, low = [], None, n
    while low > 0:
        high, low = low, max(0, low - SCAN_BATCH)
        loss = score(coarse[low:high])
        losses.insert(0, loss)
        batch_best = loss.min(0).values
        best = batch_best if best is None else torch.minimum(best, batch_best)
        if bool((loss > SCAN_STOP * best).all()):
            break
    return coarse[low:], torch.cat(losses)


def seq_mse_search(
    weight: torch.Tensor,
    gram: torch.Tensor | GramFactor,
    bits: int,
    candidates: int = 50,
    granularity: str = "channel",
    block_size: int | None = None,
    rank: int | None = None,
    block_scale: torch.Tensor | None = None,
) -> SearchResult:
    """Search scale multipliers for ``weight`` (O, I) given the input Gram matrix ``gram`` (I, I).

    ``granularity`` "layer" picks one multiplier for the whole tensor (the published method),
    "channel" one per output channel (per block when ``block_size`` is set).
    ``block_scale`` (O, I / block): fixed block scales in LPBQ form (:func:`lpbq_scale`); one
    multiplier per channel ("channel") or per tensor ("layer") scales each channel's base, so
    the result keeps the form (base_c · m_c) · k_cb. The multipliers then have shape (O,).
    """
    if candidates < 1:
        raise ValueError(f"candidates must be at least 1, got {candidates}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    weight = weight.detach().float()
    base = minmax_scale(weight, bits, block_size) if block_scale is None else block_scale.float()
    if block_scale is not None:
        factors = gram if isinstance(gram, GramFactor) else GramFactor.from_gram(gram, rank)
    elif isinstance(gram, GramFactor):  # layers reading the same input (q/k/v, gate/up) share one
        if block_size is not None:
            raise ValueError("block granularity needs the Gram matrix, not a factor")
        factors = gram
    elif block_size is None:
        factors = GramFactor.from_gram(gram, rank)
    else:
        nb = weight.shape[1] // block_size
        factors = [
            GramFactor.from_gram(gram[b * block_size : (b + 1) * block_size, b * block_size : (b + 1) * block_size], rank)
            for b in range(nb)
        ]

    def score(mult):
        return _unit_losses(weight, base, mult, bits, factors, block_size)

    n = candidates
    shape = base.shape if block_scale is None else base.shape[:1]  # the shape of the multipliers
    coarse = torch.linspace(1.0 / n, 1.0, n, device=weight.device).view(n, *([1] * len(shape))).expand(n, *shape)
    coarse, coarse_loss = _coarse_scan(coarse, score)  # the last row is m = 1, the min/max baseline
    layer_best = coarse[coarse_loss.flatten(1).sum(1).argmin(), ...].flatten()[0]
    layer_fine = _fine_grid(layer_best, n).view(n, *([1] * len(shape))).expand(n, *shape)
    layer_fine_loss = score(layer_fine)
    pool_m = torch.cat([coarse, layer_fine])
    pool_loss = torch.cat([coarse_loss, layer_fine_loss])
    if granularity == "layer":
        best = pool_loss.flatten(1).sum(1).argmin()
        mult, chosen_loss = pool_m[best], pool_loss[best].sum().item()
        evaluations = len(coarse) + n
    else:
        unit_best = torch.gather(coarse, 0, coarse_loss.argmin(0, keepdim=True))[0]  # (*shape)
        fine = _fine_grid(unit_best, n)
        pool_m = torch.cat([pool_m, fine])
        pool_loss = torch.cat([pool_loss, score(fine)])
        pick = pool_loss.argmin(0, keepdim=True)
        mult, chosen_loss = torch.gather(pool_m, 0, pick)[0], torch.gather(pool_loss, 0, pick).sum().item()
        evaluations = len(coarse) + 2 * n
    return SearchResult(
        multipliers=mult.clone(),
        scale=base * (mult if block_scale is None else mult.unsqueeze(1)),
        loss_minmax=coarse_loss[-1].sum().item(),
        loss=chosen_loss,
        evaluations=evaluations,
    )
