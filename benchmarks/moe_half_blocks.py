"""Candidate expert GEMMs of the fused MoE whose last row block of an expert may be a half block,
for the sweep (``python benchmarks/kernel_sweep.py --sections moehalf2048,moehalf4096,moehalf8192``
on a GPU host), not the engine's.

Why try it: the prefill plan's row blocks are 128 pairs, and every expert's run is padded to a
multiple of 128, so with the Qwen3 shape's random routing the expert GEMMs multiply 1.46 / 1.24 /
1.13x the pairs at 2K / 4K / 8K tokens (128 / 256 / 512 rows an expert on average); 64-row blocks
pad to 1.23 / 1.12 / 1.06x but measured no faster (each weight tile serves half the rows). At 4K the
two expert GEMMs are ~37 of the prefill's 73 ms (H100, ee81de8), so the padding is ~7 ms of it.
Here an expert's run is padded to a multiple of 64 only: its full 128-row blocks run as before, and
a last block of 64 rows runs a [64, K] tile (on 8 warps Triton puts the two warpgroups side by side
on N, so no warpgroup multiplies padding). One launch either way; the layout is a block table
(``BLOCK_START``, ``BLOCK_EXPERT``, ``BLOCK_HALF``; the blocks in use in ``NUM_BLOCKS``) of a fixed
length, so it captures in a CUDA graph. The layout here is built with torch ops (the sweep times the
GEMMs; an engine version would build it in the align kernel).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ainfer_pd.engine.fused_moe import GemmPlan
from ainfer_pd.engine.fused_moe.kernels import _tile_ids, down_rows, gate_up_rows
from ainfer_pd.engine.fused_moe.kernels_tma import gate_up_tma_rows
from ainfer_pd.engine.model.moe import Routing


def half_block_layout(r: Routing, block_m: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(sorted_ids [P + block_m], block_start [MB], block_expert [MB], block_half [MB], num_blocks [1]):
    each expert's pairs from ``block_start`` of its blocks, its run padded to a multiple of block_m / 2
    (sentinel N), ``block_half`` 1 for a last block of block_m / 2 rows. MB = the most blocks any routing
    of N pairs needs, so no shape depends on device values."""
    flat = r.topk_idx.reshape(-1)
    N, E, dev = flat.numel(), r.counts.numel(), flat.device
    h = block_m // 2
    c = r.counts.to(torch.int64)
    padded = (c + h - 1) // h * h
    pstart = torch.cumsum(padded, 0) - padded
    nblk = (c + block_m - 1) // block_m
    bend = torch.cumsum(nblk, 0)
    MB = (N + E * (block_m - 1)) // block_m
    b = torch.arange(MB, device=dev)
    e = torch.searchsorted(bend, b, right=True).clamp_(max=E - 1)
    j = b - (bend.index_select(0, e) - nblk.index_select(0, e))
    block_start = (pstart.index_select(0, e) + j * block_m).to(torch.int32)
    block_half = ((padded.index_select(0, e) - j * block_m) <= h).to(torch.int32)
    P = N + min(E, N) * (h - 1)
    sorted_ids = torch.full((P + block_m,), N, dtype=torch.int32, device=dev)
    start = r.offsets.to(torch.int64) - c
    e_sorted = flat.index_select(0, r.order)
    rank = torch.arange(N, device=dev) - start.index_select(0, e_sorted)
    sorted_ids.scatter_(0, pstart.index_select(0, e_sorted) + rank, r.order.to(torch.int32))
    return sorted_ids, block_start, e.to(torch.int32), block_half, bend[-1:].to(torch.int32)


@triton.jit(do_not_specialize=["P", "MB", "num_pairs"])
def half_align_kernel(COUNTS, SORTED, BLOCK_START, BLOCK_EXPERT, BLOCK_HALF, NUM_BLOCKS, CURSOR, E, P, MB, num_pairs,
                      BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr,
                      BLOCKS_PER_STEP: tl.constexpr):
    """One program: :func:`half_block_layout`'s tables from the expert counts (the engine's
    ``moe_align_kernel`` for half blocks): each expert's first padded slot (into CURSOR, for
    ``moe_scatter_kernel``), the block table, the blocks in use, the sentinel in every sorted slot."""
    H: tl.constexpr = BLOCK_M // 2
    offs_e = tl.arange(0, E_PAD)
    emask = offs_e < E
    c = tl.load(COUNTS + offs_e, mask=emask, other=0).to(tl.int32)
    padded = (c + H - 1) // H * H
    pstart = tl.cumsum(padded, 0) - padded
    nblk = (c + BLOCK_M - 1) // BLOCK_M
    bend = tl.cumsum(nblk, 0)
    tl.store(CURSOR + offs_e, pstart, mask=emask)
    tl.store(NUM_BLOCKS, tl.sum(nblk, 0))
    for b0 in range(0, MB, BLOCKS_PER_STEP):
        offs_b = b0 + tl.arange(0, BLOCKS_PER_STEP)
        before = (bend[None, :] <= offs_b[:, None]) & emask[None, :]
        ex = tl.minimum(tl.sum(before.to(tl.int32), 1), E - 1)
        pick = offs_e[None, :] == ex[:, None]                   # one-hot: each block's expert's values
        j = offs_b - tl.sum(tl.where(pick, bend - nblk, 0), 1)
        rows_left = tl.sum(tl.where(pick, padded, 0), 1) - j * BLOCK_M
        bmask = offs_b < MB
        tl.store(BLOCK_START + offs_b, tl.sum(tl.where(pick, pstart, 0), 1) + j * BLOCK_M, mask=bmask)
        tl.store(BLOCK_EXPERT + offs_b, ex, mask=bmask)
        tl.store(BLOCK_HALF + offs_b, (rows_left <= H).to(tl.int32), mask=bmask)
    for p0 in range(0, P, FILL):
        offs_p = p0 + tl.arange(0, FILL)
        tl.store(SORTED + offs_p, tl.full([FILL], 0, tl.int32) + num_pairs, mask=offs_p < P)


def half_block_layout_triton(r: Routing, block_m: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`half_block_layout` in two launches (the order of pairs inside an expert's run differs from
    run to run, as the engine's ``align_blocks_triton``; the blocks past those in use hold stale entries
    no program reads)."""
    from ainfer_pd.engine.fused_moe.kernels import moe_scatter_kernel
    flat = r.topk_idx.reshape(-1)
    N, E, dev = flat.numel(), r.counts.numel(), flat.device
    MB = (N + E * (block_m - 1)) // block_m
    P = N + min(E, N) * (block_m // 2 - 1) + block_m
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    table = torch.empty(3, MB, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(E, dtype=torch.int32, device=dev)
    e_pad = 1 << max(0, (E - 1).bit_length())
    half_align_kernel[(1,)](r.counts, sorted_ids, table[0], table[1], table[2], num_blocks, cursor, E, P, MB, N,
                            BLOCK_M=block_m, E_PAD=e_pad, FILL=1024, BLOCKS_PER_STEP=max(1, 4096 // e_pad),
                            num_warps=4)
    moe_scatter_kernel[(triton.cdiv(N, 1024),)](flat, sorted_ids, cursor, N, BLOCK=1024, num_warps=4)
    return sorted_ids, table[0], table[1], table[2], num_blocks


@triton.jit
def _half_block(BLOCK_START, BLOCK_EXPERT, BLOCK_HALF, NUM_BLOCKS, MB, NCOLS, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """This program's block: (in use, first sorted slot, expert, half, columns, column mask)."""
    pid_m, pid_n = _tile_ids(MB, tl.cdiv(NCOLS, BLOCK_N), GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    active = pid_m < tl.load(NUM_BLOCKS)
    return (active, tl.load(BLOCK_START + pid_m), tl.load(BLOCK_EXPERT + pid_m).to(tl.int64),
            tl.load(BLOCK_HALF + pid_m), offs_n, offs_n < NCOLS)


@triton.jit(do_not_specialize=["num_pairs", "MB"])
def moe_gate_up_half_kernel(
    X, W, ACT, SORTED, BLOCK_START, BLOCK_EXPERT, BLOCK_HALF, NUM_BLOCKS,
    num_pairs, MB, K, I,
    stride_xt, stride_we, stride_wk, stride_wn, stride_an,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr,
):
    active, start, e, half, offs_n, nmask = _half_block(BLOCK_START, BLOCK_EXPERT, BLOCK_HALF, NUM_BLOCKS, MB, I,
                                                        BLOCK_N, GROUP_M)
    if not active:
        return
    if half != 0:            # the engine's tile body on 64 rows: two warpgroups side by side on N
        halves = tl.load(SORTED + start + tl.arange(0, BLOCK_M // 2))     # (a name of its own: another shape)
        gate_up_rows(X, W, ACT, halves, halves < num_pairs, e, offs_n, nmask, K, I, stride_xt, stride_we, stride_wk,
                     stride_wn, stride_an, TOPK, BLOCK_K, IEEE)
    else:
        pairs = tl.load(SORTED + start + tl.arange(0, BLOCK_M))
        gate_up_rows(X, W, ACT, pairs, pairs < num_pairs, e, offs_n, nmask, K, I, stride_xt, stride_we, stride_wk,
                     stride_wn, stride_an, TOPK, BLOCK_K, IEEE)


@triton.jit(do_not_specialize=["num_pairs", "MB"])
def moe_gate_up_half_tma_kernel(
    X, W, ACT, SORTED, BLOCK_START, BLOCK_EXPERT, BLOCK_HALF, NUM_BLOCKS,
    num_pairs, MB, E, K, I,
    stride_xt, stride_an,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr,
):
    """:func:`moe_gate_up_half_kernel` with the weight tiles through TMA descriptors (the engine's
    ``gate_up_tma_rows``)."""
    active, start, e, half, offs_n, nmask = _half_block(BLOCK_START, BLOCK_EXPERT, BLOCK_HALF, NUM_BLOCKS, MB, I,
                                                        BLOCK_N, GROUP_M)
    if not active:
        return
    if half != 0:
        halves = tl.load(SORTED + start + tl.arange(0, BLOCK_M // 2))
        gate_up_tma_rows(X, W, ACT, halves, halves < num_pairs, e, offs_n, nmask, E, K, I, stride_xt, stride_an,
                         TOPK, BLOCK_N, BLOCK_K, IEEE)
    else:
        pairs = tl.load(SORTED + start + tl.arange(0, BLOCK_M))
        gate_up_tma_rows(X, W, ACT, pairs, pairs < num_pairs, e, offs_n, nmask, E, K, I, stride_xt, stride_an,
                         TOPK, BLOCK_N, BLOCK_K, IEEE)


@triton.jit(do_not_specialize=["num_pairs", "MB"])
def moe_down_half_kernel(
    A, W, OUT, SORTED, BLOCK_START, BLOCK_EXPERT, BLOCK_HALF, NUM_BLOCKS, TOPW,
    num_pairs, MB, K, N,
    stride_an, stride_we, stride_wk, stride_wn, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
):
    active, start, e, half, offs_n, nmask = _half_block(BLOCK_START, BLOCK_EXPERT, BLOCK_HALF, NUM_BLOCKS, MB, N,
                                                        BLOCK_N, GROUP_M)
    if not active:
        return
    if half != 0:
        halves = tl.load(SORTED + start + tl.arange(0, BLOCK_M // 2))
        down_rows(A, W, OUT, TOPW, halves, halves < num_pairs, e, offs_n, nmask, K, stride_an, stride_we, stride_wk,
                  stride_wn, stride_on, BLOCK_K, IEEE)
    else:
        pairs = tl.load(SORTED + start + tl.arange(0, BLOCK_M))
        down_rows(A, W, OUT, TOPW, pairs, pairs < num_pairs, e, offs_n, nmask, K, stride_an, stride_we, stride_wk,
                  stride_wn, stride_on, BLOCK_K, IEEE)


def launch_gate_up_half(x: Tensor, w13: Tensor, act: Tensor, layout, top_k: int, g: GemmPlan) -> None:
    """act [N, I] for every pair, as :func:`ainfer_pd.engine.fused_moe.launch_gate_up`, on :func:`half_block_layout`."""
    sorted_ids, block_start, block_expert, block_half, num_blocks = layout
    MB, I = block_start.numel(), w13.shape[2] // 2
    grid = (MB * triton.cdiv(I, g.block_n),)
    moe_gate_up_half_kernel[grid](
        x, w13, act, sorted_ids, block_start, block_expert, block_half, num_blocks, act.shape[0], MB, x.shape[1], I,
        x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), act.stride(0), TOPK=top_k, BLOCK_M=g.block_m,
        BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, IEEE=x.dtype == torch.float32,
        num_warps=g.num_warps, num_stages=g.num_stages)


def launch_gate_up_half_tma(x: Tensor, w13: Tensor, act: Tensor, layout, top_k: int, g: GemmPlan) -> None:
    """:func:`launch_gate_up_half` with the weight tiles through TMA descriptors (Hopper; W13 contiguous)."""
    from ainfer_pd.engine.tma import use_tma_scratch
    sorted_ids, block_start, block_expert, block_half, num_blocks = layout
    E, K, I2 = w13.shape
    MB = block_start.numel()
    use_tma_scratch(x.device)
    grid = (MB * triton.cdiv(I2 // 2, g.block_n),)
    moe_gate_up_half_tma_kernel[grid](
        x, w13, act, sorted_ids, block_start, block_expert, block_half, num_blocks, act.shape[0], MB, E, K, I2 // 2,
        x.stride(0), act.stride(0), TOPK=top_k, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k,
        GROUP_M=g.group_m, IEEE=x.dtype == torch.float32, num_warps=g.num_warps, num_stages=g.num_stages)


def launch_down_half(act: Tensor, w2: Tensor, rows: Tensor, layout, topw: Tensor, g: GemmPlan) -> None:
    """rows [N, D] for every pair, as :func:`ainfer_pd.engine.fused_moe.launch_down`, on :func:`half_block_layout`."""
    sorted_ids, block_start, block_expert, block_half, num_blocks = layout
    MB, N = block_start.numel(), rows.shape[1]
    grid = (MB * triton.cdiv(N, g.block_n),)
    moe_down_half_kernel[grid](
        act, w2, rows, sorted_ids, block_start, block_expert, block_half, num_blocks, topw, rows.shape[0], MB,
        act.shape[1], N, act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), rows.stride(0),
        BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, IEEE=act.dtype == torch.float32,
        num_warps=g.num_warps, num_stages=g.num_stages)
