"""Error-compensating rounding (GPTQ, Frantar et al. 2022) on the scheme's symmetric grid.

The scales are fixed beforehand (min/max or SeqMSE); GPTQ only chooses the integer codes.
Columns are rounded one at a time and the rounding error of each column is spread over the
columns not yet rounded, weighted by the inverse Hessian H⁻¹ of the layer loss
||X Wᵀ - X Qᵀ||² (H = XᵀX plus damping). The result has the same format as nearest rounding:
one integer code per weight in [-qmax, qmax] and the given per-channel (or per-block) scales.
It runs on the device of the weight and the Gram matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from npuq.optimize.seqmse import qmax_for


DAMP = 0.1  # npuq's default damping (GptqOptions); the published default is 0.01
DAMP_DOWN = 1.0  # the MLP down projections' (GptqOptions.damp_down, docs/design.md §5)
DOWN_PROJ = ".mlp.down_proj"  # the module path's end that names a down projection in npuq's decoder
ROW_CHUNK = 1 << 20  # weights per slice of output rows in the column loop (4 MB of float32)


def damped(gram: torch.Tensor, damp: float) -> torch.Tensor:
    """H + λI in float64, λ = ``damp`` × the mean diagonal of H, with every input never seen (zero
    diagonal) held at 1 first: any weight is as good there, and H must stay invertible."""
    H = gram.detach().double().clone()
    diagonal = torch.diagonal(H)  # a view: written in place
    diagonal.masked_fill_(diagonal == 0, 1.0)
    diagonal.add_(damp * diagonal.mean())
    return H


def inverse_upper_factor(H: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """The upper triangular U with UᵀU = H_o⁻¹ for symmetric positive definite H, H_o its rows and
    columns in ``order`` (default: as they are), in H's dtype, from one Cholesky factorisation and
    one triangular solve: with P the order reversal and P H_o P = M Mᵀ (M lower),
    H_o⁻¹ = P M⁻ᵀ M⁻¹ P = (P M⁻¹ P)ᵀ (P M⁻¹ P), and P M⁻¹ P is upper triangular with a positive
    diagonal, so it is H_o⁻¹'s Cholesky factor. P H_o P is H in the reversed order, one gather.
    The usual chol(chol_inverse(chol(H))) factorises twice more: at I = 4864 (float64, 2 cores)
    1.85 s against 1.53 s, equal to 1e-16."""
    reverse = (torch.arange(H.shape[0], device=H.device) if order is None else order).flip(0)
    M = torch.linalg.cholesky(H[reverse[:, None], reverse])
    eye = torch.eye(H.shape[0], dtype=H.dtype, device=H.device)
    return torch.linalg.solve_triangular(M, eye, upper=False).flip(0, 1)


def gptq_codes(
    weight: torch.Tensor,
    gram: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    damp: float = DAMP,
    block: int = 128,
    act_order: bool = False,
) -> torch.Tensor:
    """Integer codes (O, I) for ``weight`` (O, I) with ``scale`` (O,) or (O, I / block_size).

    Output rows are rounded independently of each other, so the column loop takes a slice of
    rows at a time, held column-major: on Qwen2.5-Coder-0.5B's 151936 × 896 lm head this took
    GPTQ from 23 s to 7 s (2 cores), the column loop having been memory bound. The weights are
    updated in float32, as the published code does.

    ``gram`` is XᵀX (I, I) of the layer's calibration inputs; ``damp`` is added to its
    diagonal as a fraction of the mean diagonal (npuq's 10 %; the published default is 1 %). ``act_order``
    rounds the columns in order of decreasing input energy (diagonal of H), the published
    "act-order" heuristic; the scales are fixed beforehand, so any order keeps the format.
    """
    O, I = weight.shape
    q = qmax_for(bits)
    H = damped(gram, damp)
    perm = torch.argsort(torch.diagonal(H), descending=True) if act_order else torch.arange(I, device=H.device)
    # Upper Cholesky factor of H⁻¹ in rounding order: row j holds the error-propagation weights of
    # column j. In float64: activation Grams span orders of magnitude, and a float32 factor (1.7x
    # faster at I = 4864) took SmolLM2-135M 16a4w R1 + SeqMSE + GPTQ (damping 0.01) from 1.215x /
    # 1.760x to 1.269x / 1.851x float perplexity (builtin / prose, bench/accuracy.py); at damping
    # 0.1 it saved Qwen2.5-Coder-0.5B LPBQ ~20 s of 320 and moved its prose / code ratios from
    # 1.105x / 1.072x to 1.126x / 1.136x at the same KL divergence (0.113 / 0.074 nats).
    Hinv = inverse_upper_factor(H, perm).float()
    # Columns in rounding order, each contiguous (I, O), and the scale of each column's weights.
    Wt = weight.detach().float()[:, perm].T.contiguous()
    per_block = scale.dim() == 2
    scale_t = scale.float().T.contiguous() if per_block else scale.float()  # (blocks, O) or (O,)
    column_block = (perm // (I // scale.shape[1])).tolist() if per_block else None
    codes = torch.empty(I, O, dtype=torch.float32, device=Wt.device)
    # addr_ on a view saves the outer product's buffer (2x on the head's 8192-row slices); torch's
    # lazy backend (the stand-in device of tests/device) has no such kernel.
    in_place = Wt.device.type == "cpu"
    rows = max(1, ROW_CHUNK // block)  # output rows are rounded independently: a cache-sized slice at a time
    for r1 in range(0, O, rows):
        r2 = min(r1 + rows, O)
        W = Wt[:, r1:r2].clone()
        for i1 in range(0, I, block):
            i2 = min(i1 + block, I)
            W1, H1 = W[i1:i2], Hinv[i1:i2, i1:i2]
            E1 = torch.empty_like(W1)
            diag = torch.diagonal(H1).tolist()
            # Few ops per column, each into its destination: the loop is bound by their count.
            for j in range(i2 - i1):
                s = scale_t[column_block[i1 + j], r1:r2] if per_block else scale_t[r1:r2]
                w, err, c = W1[j], E1[j], codes[i1 + j, r1:r2]
                torch.div(w, s, out=c).round_().clamp_(-q, q)
                torch.addcmul(w, c, s, value=-1.0, out=err).div_(diag[j])
                if in_place:
                    W1[j + 1 :].addr_(H1[j, j + 1 :], err, alpha=-1.0)
                else:
                    W1[j + 1 :] -= torch.outer(H1[j, j + 1 :], err)
            W[i2:].addmm_(Hinv[i1:i2, i2:].T, E1, alpha=-1.0)
    return codes[torch.argsort(perm)].T.to(torch.int8)


@dataclass(frozen=True)
class GptqOptions:
    """GPTQ's choices beyond the grid (``npuq quantize --weight-rounding gptq``, ``--act-order``,
    ``--gptq-damp``); :meth:`codes` is :func:`gptq_codes` under them. npuq's default orders the
    columns (act-order): on SmolLM2-135M at 4 bits it cuts GPTQ's perplexity loss; and it damps
    ten times more than the published 1 %: the codes then rely less on input correlations that
    only the calibration text has (docs/design.md §5: on text of other domains SmolLM2-135M
    per-channel 16a4w R1 went from 1.73x to 1.58x float on prose, Qwen2.5-Coder-0.5B LPBQ from
    1.186x / 1.152x to 1.105x / 1.072x on prose / code). The MLP down projections, whose inputs
    are the activation product (wide, sparse, and which units fire depends on the text), damp ten
    times more again (``damp_down``): there GPTQ at 0.1 fitted the calibration text so closely
    that on other text its output error was no lower than nearest rounding's (§5)."""

    act_order: bool = True
    damp: float = DAMP
    block: int = 128
    damp_down: float = DAMP_DOWN

    def damp_for(self, name: str) -> float:
        """The damping of the layer at module path ``name``."""
        return self.damp_down if name.endswith(DOWN_PROJ) else self.damp

    def codes(self, name: str, weight: torch.Tensor, gram: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
        """:func:`gptq_codes` for the layer at module path ``name``."""
        return gptq_codes(weight, gram, scale, bits, damp=self.damp_for(name), block=self.block,
                          act_order=self.act_order)
