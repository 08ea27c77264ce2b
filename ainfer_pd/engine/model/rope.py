"""Rotary position embedding as transformers computes it for the supported architectures.

Half-split layout (transformers' ``rotate_half``) over the first ``rotary_dim`` dims of each
head; the remaining ``head_dim - rotary_dim`` dims pass through unrotated (glm4_moe's
``partial_rotary_factor``: its ``apply_rotary_pos_emb`` slices ``q[..., :rotary_dim]`` and applies
``rotate_half`` to that slice, i.e. pairs (j, j + rotary_dim / 2), not interleaved pairs).
Frequencies ``theta ** (-2j / rotary_dim)``; cos / sin computed in float32, then cast.

Shape legend: T = tokens, h = heads, hd = head dim, r = rotary dim.
"""
from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(positions: Tensor, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos / sin [T, r / 2] of ``positions`` for a rotary width of ``rotary_dim`` (= head dim
    unless the rotary embedding is partial)."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=torch.float32) / rotary_dim))
    ang = positions.to(torch.float32).unsqueeze(-1) * inv          # [T, r/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, h, hd] with its first r = 2 * cos.shape[-1] dims rotated (half-split over those r)."""
    half = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)                      # [T, 1, r/2]
    if 2 * half == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c, rest), dim=-1)
