"""RMS norm, the torch reference (the paged backends may run a fused kernel instead)."""
from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """x [..., D] normalised over its last dim in float32, rounded to x's dtype, times w [D]."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
