"""Candidate expert GEMMs of the fused MoE whose weight tiles come through TMA tensor descriptors,
for the sweep (``python benchmarks/kernel_sweep.py --sections moetma2048,moetma4096,moetma8192
--budget-s 200`` on a GPU host), not the engine's.

Why try it: at prefill sizes the engine's expert GEMMs (:mod:`ainfer_pd.engine.fused_moe.kernels`)
run at ~48% (gate_up, 0.431 ms a layer at 4K tokens) and ~38% (down, 0.272 ms) of the H100's bf16
peak, 45% of the 4K prefill together (gate at 5f58c4c). Their weight tiles are pointer loads, as
the paged prefill attention's keys were; that kernel gained 25-27% at 4K / 8K when the pass's own
keys came through descriptors (``prefill_tma_sweep_b6cf56b_h100.txt``). The weights of an expert
are one contiguous [K, N] matrix, so the B operand can always be a descriptor; the A operand stays
a gather of the pair's token row (Hopper's TMA has no row gather). A 3-D descriptor [E, K, N] zero
fills past an expert's K, as the pointer loads' masks do.

Device-side descriptors need Triton's scratch allocator, a per-context setting: the launchers set
it before each launch (:func:`~ainfer_pd.engine.attention.triton_prefill_tma.use_tma_scratch`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ainfer_pd.engine.attention.triton_prefill_tma import use_tma_scratch
from ainfer_pd.engine.fused_moe import GemmPlan, layout_rows, triton_cdiv
from ainfer_pd.engine.fused_moe.kernels import _expert_block


@triton.jit(do_not_specialize=["num_pairs", "P"])
def moe_gate_up_tma_kernel(
    X, W, ACT, SORTED, BLOCK_EXPERT, NUM_POST,
    num_pairs, P, E, K, I,
    stride_xt, stride_an,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr,
):
    """``ACT[pair] = silu(x[tok] @ W13[e, :, :I]) * (x[tok] @ W13[e, :, I:])``; W13 [E, K, 2I] contiguous."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, I,
                                                           BLOCK_M, BLOCK_N, GROUP_M, False)
    if not active:
        return
    w_desc = tl.make_tensor_descriptor(W, shape=[E, K, 2 * I], strides=[K * 2 * I, 2 * I, 1],
                                       block_shape=[1, BLOCK_K, BLOCK_N])
    n0 = tl.min(offs_n, axis=0)
    tok = (pairs // TOPK).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + offs_k[None, :]
    ei = e.to(tl.int32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        bg = w_desc.load([ei, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        bu = w_desc.load([ei, k0, n0 + I]).reshape(BLOCK_K, BLOCK_N)
        if IEEE:
            acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
            acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        a_ptr += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptr = ACT + pairs.to(tl.int64)[:, None] * stride_an + offs_n[None, :]
    tl.store(out_ptr, act.to(ACT.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "P"])
def moe_down_tma_kernel(
    A, W, OUT, SORTED, BLOCK_EXPERT, NUM_POST, TOPW,
    num_pairs, P, E, K, N,
    stride_an, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr,
):
    """``OUT[pair] = w[pair] * ACT[pair] @ W2[e]``; W2 [E, K, N] contiguous (K = I, N = D)."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, N,
                                                           BLOCK_M, BLOCK_N, GROUP_M, False)
    if not active:
        return
    w_desc = tl.make_tensor_descriptor(W, shape=[E, K, N], strides=[K * N, N, 1], block_shape=[1, BLOCK_K, BLOCK_N])
    n0 = tl.min(offs_n, axis=0)
    prow = pairs.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + prow[:, None] * stride_an + offs_k[None, :]
    ei = e.to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = w_desc.load([ei, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptr += BLOCK_K
    w = tl.load(TOPW + prow, mask=rmask, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    tl.store(OUT + prow[:, None] * stride_on + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


def launch_gate_up_tma(x, w13, act, layout, top_k: int, g: GemmPlan) -> None:
    """act [N, I] for every pair, as :func:`ainfer_pd.engine.fused_moe.launch_gate_up` (aligned layout only)."""
    E, K, I2 = w13.shape
    assert w13.is_contiguous() and (I2 // 2) % g.block_n == 0, "W13 [E, K, 2I] contiguous, I a multiple of block_n"
    sorted_ids, block_expert, num_post = layout
    P = layout_rows(layout, g.block_m, False)
    use_tma_scratch(x.device)
    grid = (triton_cdiv(P, g.block_m) * triton_cdiv(I2 // 2, g.block_n),)
    moe_gate_up_tma_kernel[grid](
        x, w13, act, sorted_ids, block_expert, num_post, act.shape[0], P, E, K, I2 // 2, x.stride(0), act.stride(0),
        TOPK=top_k, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
        IEEE=x.dtype == torch.float32, num_warps=g.num_warps, num_stages=g.num_stages)


def launch_down_tma(act, w2, rows, layout, topw, g: GemmPlan) -> None:
    """rows [N, D] for every pair, as :func:`ainfer_pd.engine.fused_moe.launch_down` (aligned layout only)."""
    E, K, N = w2.shape
    assert w2.is_contiguous(), "W2 [E, I, D] contiguous"
    sorted_ids, block_expert, num_post = layout
    P = layout_rows(layout, g.block_m, False)
    use_tma_scratch(act.device)
    grid = (triton_cdiv(P, g.block_m) * triton_cdiv(N, g.block_n),)
    moe_down_tma_kernel[grid](
        act, w2, rows, sorted_ids, block_expert, num_post, topw, rows.shape[0], P, E, K, N, act.stride(0),
        rows.stride(0), BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
        IEEE=act.dtype == torch.float32, num_warps=g.num_warps, num_stages=g.num_stages)
