"""Fused MoE: routing layout, permutation and the grouped expert GEMMs without round trips.

``fused_experts`` replaces the reference ``experts_local`` (gather ``[N, D]`` rows, grouped
GEMM into ``[N, 2I]``, SwiGLU, grouped GEMM, scatter): it builds the block-aligned expert
layout on the device (no host sync, so it is captured inside decode graphs) and runs two
Triton kernels that read the tokens in place and write each (token, slot) row once.

Shape legend: T = tokens, k = top-k, N = T * k, D = hidden, I = expert intermediate,
E = experts, P = padded sorted length.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..moe import Routing
from .plan import GemmPlan, MoEPlan, moe_plan

__all__ = ["GemmPlan", "MoEPlan", "align_blocks", "fused_experts", "moe_plan"]


def align_blocks(r: Routing, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """Expert-sorted pair ids padded per expert to multiples of ``block_m``.

    Returns ``sorted_ids [P]`` int32 (sentinel N for padding), ``block_expert [P / block_m]``
    int32 and ``num_post [1]`` (padded rows in use). P = N + min(E, N) * (block_m - 1) is fixed
    for a given N, so the shapes never depend on device values.
    """
    flat = r.topk_idx.reshape(-1)
    N = flat.numel()
    E = r.counts.numel()
    dev = flat.device
    counts = r.counts
    padded = torch.div(counts + (block_m - 1), block_m, rounding_mode="floor") * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = r.offsets.to(torch.int64) - counts
    e_sorted = flat.index_select(0, r.order)
    rank = torch.arange(N, device=dev) - start.index_select(0, e_sorted)
    dest = pad_start.index_select(0, e_sorted) + rank
    P = N + min(E, N) * (block_m - 1)
    P = -(-P // block_m) * block_m
    sorted_ids = torch.full((P,), N, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, r.order.to(torch.int32))
    starts = torch.arange(0, P, block_m, device=dev, dtype=torch.int64)
    block_expert = torch.searchsorted(pad_end, starts, right=True).clamp_(max=E - 1).to(torch.int32)
    return sorted_ids, block_expert, pad_end[-1:]


def fused_experts(x: Tensor, r: Routing, w13: Tensor, w2: Tensor, plan: MoEPlan | None = None) -> Tensor:
    """Routed experts: x [T, D], w13 [E, D, 2I], w2 [E, I, D] -> [T, D]."""
    from .kernels import moe_down_kernel, moe_gate_up_kernel
    T, D = x.shape
    k = r.topk_idx.shape[1]
    E, _, I2 = w13.shape
    I = I2 // 2
    N = T * k
    if N == 0:
        return torch.zeros_like(x)
    fp32 = x.dtype == torch.float32
    plan = plan or moe_plan(N, E, fp32)
    g1, g2 = plan.gate_up, plan.down
    assert g1.block_m == g2.block_m, "both GEMMs walk the same aligned blocks"
    sorted_ids, block_expert, num_post = align_blocks(r, g1.block_m)
    P = sorted_ids.numel()
    x = x.contiguous()
    act = torch.empty(N, I, dtype=x.dtype, device=x.device)
    grid1 = (triton_cdiv(P, g1.block_m) * triton_cdiv(I, g1.block_n),)
    moe_gate_up_kernel[grid1](
        x, w13, act, sorted_ids, block_expert, num_post, N, P, D, I,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0),
        TOPK=k, BLOCK_M=g1.block_m, BLOCK_N=g1.block_n, BLOCK_K=g1.block_k, GROUP_M=g1.group_m, IEEE=fp32,
        num_warps=g1.num_warps, num_stages=g1.num_stages)
    rows = torch.empty(N, D, dtype=x.dtype, device=x.device)
    topw = r.topk_weights.reshape(-1).contiguous()
    grid2 = (triton_cdiv(P, g2.block_m) * triton_cdiv(D, g2.block_n),)
    moe_down_kernel[grid2](
        act, w2, rows, sorted_ids, block_expert, num_post, topw, N, P, I, D,
        act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), rows.stride(0),
        BLOCK_M=g2.block_m, BLOCK_N=g2.block_n, BLOCK_K=g2.block_k, GROUP_M=g2.group_m, IEEE=fp32,
        num_warps=g2.num_warps, num_stages=g2.num_stages)
    return rows.view(T, k, D).sum(dim=1, dtype=torch.float32).to(x.dtype)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
