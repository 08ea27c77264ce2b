"""The prefill expert GEMM gate_up with its weight tiles through TMA tensor descriptors (Hopper).

:func:`~.kernels.moe_gate_up_kernel` reads an expert's ``W13`` tiles with pointer loads. An expert's
weights are one contiguous ``[K, 2I]`` matrix, so the B operand can be a device-side tensor
descriptor (a 3-D one over ``[E, K, 2I]``, which zero fills past ``K`` as the pointer loads' masks
do); the A operand stays a gather of each pair's token row (TMA has no row gather). H100, 4,096
tokens of the Qwen3-30B-A3B shape (``docs/results/kernels/tma_candidates_sweep_ee81de8_h100.txt``):
0.4488 ms a layer on tile 128 x 128 x 64, 8 warps, 4 stages, against the pointer kernel's best
0.4806 (128 x 128 x 32, 4 stages; with the K step of 64 its 4 stages do not fit in shared memory); 2,048
tokens 0.3326 against 0.3429; 8,192 tokens 0.8410 against 0.8002, slower, so the plan takes it up to
256 rows an expert (``plan.TMA_MAX_ROWS_PER_EXPERT``; ``tma_sweep_180baf4_h100.txt``).
The down GEMM through descriptors was no faster at any tile (0.2821 against 0.2791 ms), so it keeps
the pointer kernel. Runs under ``TRITON_INTERPRET=1`` too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tma import use_tma_scratch
from .kernels import _dot_pair, _expert_block
from .plan import GemmPlan


@triton.jit
def gate_up_tma_rows(X, W, ACT, pairs, rmask, e, offs_n, nmask, E, K, I, stride_xt, stride_an,
                     TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """gate_up of one row block (``pairs``, ``rmask``; its rows their length) of expert ``e`` with the
    weight tiles through a descriptor over W13 [E, K, 2I] (contiguous; ``I`` a multiple of ``BLOCK_N``: a
    column tile never straddles the two halves)."""
    w_desc = tl.make_tensor_descriptor(W, shape=[E, K, 2 * I], strides=[K * 2 * I, 2 * I, 1],
                                       block_shape=[1, BLOCK_K, BLOCK_N])
    n0 = tl.min(offs_n, axis=0)
    tok = (pairs // TOPK).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + offs_k[None, :]
    ei = e.to(tl.int32)
    acc_g = tl.zeros([pairs.shape[0], BLOCK_N], tl.float32)
    acc_u = tl.zeros([pairs.shape[0], BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        bg = w_desc.load([ei, k0, n0]).reshape(BLOCK_K, BLOCK_N)
        bu = w_desc.load([ei, k0, n0 + I]).reshape(BLOCK_K, BLOCK_N)
        acc_g, acc_u = _dot_pair(a, bg, bu, acc_g, acc_u, IEEE)
        a_ptr += BLOCK_K
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptr = ACT + pairs.to(tl.int64)[:, None] * stride_an + offs_n[None, :]
    tl.store(out_ptr, act.to(ACT.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "P"])
def moe_gate_up_tma_kernel(
    X, W, ACT, SORTED, BLOCK_EXPERT, NUM_POST,
    num_pairs, P, E, K, I,
    stride_xt, stride_an,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr,
):
    """``ACT[pair] = silu(x[tok] @ W13[e, :, :I]) * (x[tok] @ W13[e, :, I:])`` (:func:`gate_up_tma_rows`)."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, I,
                                                           BLOCK_M, BLOCK_N, GROUP_M, False)
    if not active:
        return
    gate_up_tma_rows(X, W, ACT, pairs, rmask, e, offs_n, nmask, E, K, I, stride_xt, stride_an, TOPK, BLOCK_N,
                     BLOCK_K, IEEE)


def launch_gate_up_tma(x: Tensor, w13: Tensor, act: Tensor, layout: tuple[Tensor, Tensor, Tensor], top_k: int,
                       g: GemmPlan) -> None:
    """act [N, I] for every pair, as :func:`~ainfer_pd.engine.fused_moe.launch_gate_up` (aligned layout only)."""
    E, K, I2 = w13.shape
    sorted_ids, block_expert, num_post = layout
    P = sorted_ids.numel()
    use_tma_scratch(x.device)
    grid = (triton.cdiv(P, g.block_m) * triton.cdiv(I2 // 2, g.block_n),)
    moe_gate_up_tma_kernel[grid](
        x, w13, act, sorted_ids, block_expert, num_post, act.shape[0], P, E, K, I2 // 2, x.stride(0), act.stride(0),
        TOPK=top_k, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
        IEEE=x.dtype == torch.float32, num_warps=g.num_warps, num_stages=g.num_stages)
