"""Error-compensating rounding (GPTQ, Frantar et al. 2022) on the scheme's symmetric grid.

The scales are fixed beforehand (min/max or SeqMSE); GPTQ only chooses the integer codes.
Columns are rounded one at a time and the rounding error of each column is spread over the
columns not yet rounded, weighted by the inverse Hessian H⁻¹ of the layer loss
||X Wᵀ - X Qᵀ||² (H = XᵀX plus damping). The result has the same format as nearest rounding:
one integer code per weight in [-qmax, qmax] and the given per-channel (or per-block) scales.
"""

from __future__ import annotations

import torch

from npuq.optimize.seqmse import qmax_for


def gptq_codes(
    weight: torch.Tensor,
    gram: torch.Tensor,
    scale: torch.Tensor,
    bits: int,
    damp: float = 0.01,
    block: int = 128,
) -> torch.Tensor:
    """Integer codes (O, I) for ``weight`` (O, I) with ``scale`` (O,) or (O, I / block_size).

    ``gram`` is XᵀX (I, I) of the layer's calibration inputs; ``damp`` is added to its
    diagonal as a fraction of the mean diagonal (the published default, 1%).
    """
    O, I = weight.shape
    q = qmax_for(bits)
    W = weight.detach().double().clone()
    H = gram.detach().double().clone()
    dead = torch.diagonal(H) == 0  # inputs never seen: any rounding is as good; keep H invertible
    H[dead, dead] = 1.0
    H += torch.eye(I, dtype=H.dtype) * damp * torch.diagonal(H).mean()
    # Upper Cholesky factor of H⁻¹: row j holds the error-propagation weights of column j.
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    col_scale = scale.double().repeat_interleave(I // scale.shape[1], dim=1) if scale.dim() == 2 else \
        scale.double().unsqueeze(1).expand(O, I)  # (O, I)
    codes = torch.zeros(O, I, dtype=torch.float64)
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
    return codes.to(torch.int8)
