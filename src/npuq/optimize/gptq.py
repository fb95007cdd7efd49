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


def gptq_codes(
    weight: torch.Tensor,
    gram: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    damp: float = 0.01,
    block: int = 128,
    act_order: bool = False,
) -> torch.Tensor:
    """Integer codes (O, I) for ``weight`` (O, I) with ``scale`` (O,) or (O, I / block_size).

    ``gram`` is XᵀX (I, I) of the layer's calibration inputs; ``damp`` is added to its
    diagonal as a fraction of the mean diagonal (the published default, 1%). ``act_order``
    rounds the columns in order of decreasing input energy (diagonal of H), the published
    "act-order" heuristic; the scales are fixed beforehand, so any order keeps the format.
    """
    O, I = weight.shape
    q = qmax_for(bits)
    W = weight.detach().double().clone()
    H = gram.detach().double().clone()
    dead = torch.diagonal(H) == 0  # inputs never seen: any rounding is as good; keep H invertible
    H[dead, dead] = 1.0
    H += torch.eye(I, dtype=H.dtype, device=H.device) * damp * torch.diagonal(H).mean()
    col_scale = scale.double().repeat_interleave(I // scale.shape[1], dim=1) if scale.dim() == 2 else \
        scale.double().unsqueeze(1).expand(O, I)  # (O, I)
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True)
        W, H, col_scale = W[:, perm], H[perm][:, perm], col_scale[:, perm]
    # Upper Cholesky factor of H⁻¹: row j holds the error-propagation weights of column j.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(O, I, dtype=torch.float64, device=W.device)
    for i1 in range(0, I, block):
        i2 = min(i1 + block, I)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        H1 = Hinv[i1:i2, i1:i2]
        for j in range(i2 - i1):
            s = col_scale[:, i1 + j]
            w = W1[:, j]
            c = torch.clamp(torch.round(w / s), -q, q)
            codes[:, i1 + j] = c
            err = (w - c * s) / H1[j, j]
            W1[:, j:] -= err.unsqueeze(1) * H1[j, j:].unsqueeze(0)
            E1[:, j] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    if act_order:
        codes = codes[:, torch.argsort(perm)]
    return codes.to(torch.int8)


@dataclass(frozen=True)
class GptqOptions:
    """GPTQ's choices beyond the grid (``npuq quantize --weight-rounding gptq``); :meth:`codes`
    is :func:`gptq_codes` under them. npuq's default orders the columns (act-order): on
    SmolLM2-135M at 4 bits it cuts GPTQ's perplexity loss (bench/accuracy.py, README)."""

    act_order: bool = True
    damp: float = 0.01
    block: int = 128

    def codes(self, weight: torch.Tensor, gram: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
        return gptq_codes(weight, gram, scale, bits, damp=self.damp, block=self.block, act_order=self.act_order)
