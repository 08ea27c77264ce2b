"""Blockwise FP8 (e4m3), the format of DeepSeek-V3-style ``fp8`` checkpoints (Qwen3-30B-A3B-FP8,
GLM-4.5-FP8) and of verl's FP8 rollout.

* Weights ``w [..., N, K]`` (out, in: Hugging Face's layout) are stored as ``q`` in
  ``float8_e4m3fn`` with one float32 ``scale_inv [..., ceil(N / 128), ceil(K / 128)]`` per 128 x 128
  block (the checkpoint's ``weight_scale_inv``): ``w[n, k] ~= q[n, k] * scale_inv[n // 128, k // 128]``.
  A partial block at the edge has its own scale.
* Activations ``x [T, K]`` are quantized on the fly in 1 x 128 groups: one scale per token per 128
  columns.

These are the torch reference functions (any device, no Triton): the oracle of the FP8 kernels
and the loader's and weight sync's quantizer.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ...errors import CheckpointError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)     # 448
BLOCK = 128
"""The block edge of weights (BLOCK x BLOCK) and the group of activations (1 x BLOCK)."""
_TINY = 1e-12


def blocks(n: int, block: int = BLOCK) -> int:
    """Blocks of ``block`` covering ``n`` (the last one may be partial)."""
    return -(-n // block)


def scale_shape(shape: tuple[int, ...] | torch.Size, block: int = BLOCK) -> tuple[int, ...]:
    """The ``scale_inv`` shape of an FP8 weight of ``shape`` [..., N, K]."""
    *lead, n, k = shape
    return (*lead, blocks(n, block), blocks(k, block))


def _padded_blocks(w: Tensor, block: int) -> tuple[Tensor, int, int]:
    """w [..., N, K] zero-padded to whole blocks, viewed [..., nb, block, kb, block] (float32)."""
    *lead, n, k = w.shape
    nb, kb = blocks(n, block), blocks(k, block)
    wp = w.float()
    if n % block or k % block:
        wp = torch.nn.functional.pad(wp, (0, kb * block - k, 0, nb * block - n))
    return wp.reshape(*lead, nb, block, kb, block), n, k


@torch.no_grad()
def quantize_blockwise(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """w [..., N, K] (any float dtype) -> (q [..., N, K] float8_e4m3fn, scale_inv [..., nb, kb] float32),
    each block scaled so its largest magnitude maps to the e4m3 maximum (448)."""
    if w.dim() < 2:
        raise ValueError(f"a blockwise FP8 weight has at least 2 dimensions, got shape {tuple(w.shape)}")
    wb, n, k = _padded_blocks(w, block)
    amax = wb.abs().amax(dim=(-3, -1), keepdim=True)                   # [..., nb, 1, kb, 1]
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=_TINY)     # a tensor divisor: IEEE division on CUDA too
    q = (wb / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    *lead, nb, _, kb, _ = wb.shape
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].contiguous()
    return q, scale.reshape(*lead, nb, kb).contiguous()


def dequantize_blockwise(q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32,
                         block: int = BLOCK) -> Tensor:
    """q [..., N, K] float8 and scale_inv [..., nb, kb] -> w [..., N, K] in ``dtype``."""
    check_scale("weight", q.shape, scale_inv.shape, block)
    *lead, n, k = q.shape
    s = scale_inv.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]
    return (q.float() * s).to(dtype)


@torch.no_grad()
def quantize_token_groups(x: Tensor, group: int = BLOCK) -> tuple[Tensor, Tensor]:
    """Activations x [T, K] -> (q [T, K] float8_e4m3fn, scale [T, ceil(K / group)] float32), one
    scale per token per ``group`` columns (1 x 128: the FP8 kernels' activation format)."""
    t, k = x.shape
    kb = blocks(k, group)
    xp = x.float()
    if k % group:
        xp = torch.nn.functional.pad(xp, (0, kb * group - k))
    xg = xp.view(t, kb, group)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=_TINY)   # not amax / 448.0: CUDA multiplies by its reciprocal
    q = (xg / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(t, kb * group)[:, :k].contiguous()
    return q, scale.view(t, kb).contiguous()


def dequantize_token_groups(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32,
                            group: int = BLOCK) -> Tensor:
    """The inverse of :func:`quantize_token_groups` (up to the e4m3 rounding)."""
    k = q.shape[-1]
    return (q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]).to(dtype)


def fp8_linear_reference(x: Tensor, q: Tensor, scale_inv: Tensor, bias: Tensor | None = None,
                         block: int = BLOCK) -> Tensor:
    """The FP8 GEMM's math in torch: x [T, K] quantized in 1 x 128 groups, times the dequantized
    weight q [N, K] (block scales), accumulated in float32 -> [T, N] in x's dtype."""
    xq, xs = quantize_token_groups(x, block)
    y = dequantize_token_groups(xq, xs, torch.float32, block) @ dequantize_blockwise(q, scale_inv, torch.float32,
                                                                                       block).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check_scale(name: str, weight_shape: tuple[int, ...] | torch.Size, scale_shape_: tuple[int, ...] | torch.Size,
                block: int = BLOCK) -> None:
    """A ``scale_inv`` whose shape is not the block grid of its weight is a :class:`CheckpointError`
    naming the tensor."""
    want = scale_shape(tuple(weight_shape), block)
    if tuple(scale_shape_) != want:
        raise CheckpointError(f"{name}: weight_scale_inv has shape {tuple(scale_shape_)}, expected {want} "
                              f"(one scale per {block} x {block} block of the weight {tuple(weight_shape)})")


# ====================================================================== routed experts in FP8
# Layout: w13 [E, 2I, D] (gate rows, then up rows: Hugging Face's gate_proj / up_proj stacked) with
# scale_inv [E, 2 nb(I), nb(D)] (the gate's block rows, then the up's: each half has its own grid,
# so a partial last block of the gate never shares a scale with the up); w2 [E, D, I] with
# scale_inv [E, nb(D), nb(I)].
def w13_scale_shape(num_experts: int, inter: int, hidden: int, block: int = BLOCK) -> tuple[int, int, int]:
    return num_experts, 2 * blocks(inter, block), blocks(hidden, block)


def quantize_w13(gate: Tensor, up: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """gate, up [E, I, D] -> (q [E, 2I, D] float8, scale_inv [E, 2 nb(I), nb(D)])."""
    qg, sg = quantize_blockwise(gate, block)
    qu, su = quantize_blockwise(up, block)
    return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)


def dequantize_w13(q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32,
                   block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """The inverse of :func:`quantize_w13`: (gate, up), each [E, I, D] in ``dtype``."""
    inter = q.shape[-2] // 2
    nb = blocks(inter, block)
    return (dequantize_blockwise(q[..., :inter, :], scale_inv[..., :nb, :], dtype, block),
            dequantize_blockwise(q[..., inter:, :], scale_inv[..., nb:, :], dtype, block))


def experts_fp8_reference(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w13: Tensor, w13_scale: Tensor,
                          w2: Tensor, w2_scale: Tensor, block: int = BLOCK) -> Tensor:
    """The FP8 fused MoE's math in torch (the kernels' oracle): x [T, D] -> [T, D] in x's dtype.

    Every (token, slot) row: x quantized in 1 x 128 groups, ``act = silu(x W_gate^T) * (x W_up^T)``
    with the dequantized block weights (float32), ``act`` quantized in 1 x 128 groups, times
    ``W_down^T``, scaled by its top-k weight; a token's k rows summed in slot order."""
    T, D = x.shape
    k = topk_idx.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    xd = dequantize_token_groups(*quantize_token_groups(x, block), torch.float32, block)     # [T, D]
    gate, up = dequantize_w13(w13, w13_scale, torch.float32, block)                          # [E, I, D]
    down = dequantize_blockwise(w2, w2_scale, torch.float32, block)                          # [E, D, I]
    flat = topk_idx.reshape(-1)
    xr = xd.repeat_interleave(k, dim=0)                                                      # [N, D]
    g = torch.bmm(gate.index_select(0, flat), xr.unsqueeze(-1)).squeeze(-1)                 # [N, I]
    u = torch.bmm(up.index_select(0, flat), xr.unsqueeze(-1)).squeeze(-1)
    act = torch.nn.functional.silu(g) * u
    act = dequantize_token_groups(*quantize_token_groups(act, block), torch.float32, block)
    rows = torch.bmm(down.index_select(0, flat), act.unsqueeze(-1)).squeeze(-1)            # [N, D]
    rows = rows * topk_weights.reshape(-1, 1).float()
    return rows.view(T, k, D).sum(dim=1).to(x.dtype)
