"""Rotary position embedding (half-split layout, as Hugging Face's ``rotate_half``).

Shape legend: T = tokens, h = heads, hd = head dim.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos / sin [T, head_dim / 2] of ``positions`` for a rotary width of ``head_dim``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv          # [T, hd/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, h, hd] rotated by the (half-split) rotary embedding."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)                      # [T, 1, hd/2]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
