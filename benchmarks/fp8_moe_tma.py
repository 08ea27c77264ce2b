"""Candidate FP8 expert GEMMs of the fused MoE at prefill sizes whose e4m3 weight tiles come through
TMA tensor descriptors, for the sweep (``python benchmarks/kernel_sweep.py --sections fp8moetma4096``
on a GPU host), not the engine's.

Why try it: the FP8 prefill misses its target (30.5 / 34.5 / 40.5% of the FP8 roofline at 2K / 4K /
8K on the H100, gate at 5f58c4c; target 50%), and its experts run at bf16's speed (gate-up 0.333 ms
a layer at 4K, down 0.226: ~620 / 460 TFLOP/s against the e4m3 peak). Their weight tiles are
pointer loads (:func:`ainfer_pd.engine.quant.fp8_kernels._b_tile`); an expert's weights are one
contiguous [N, K] e4m3 matrix, so they can be descriptor loads (3-D [E, N, K]: zero fill past an
expert's K), K-major as Hopper's e4m3 wgmma wants both operands. Everything else is the engine's:
the gathered activation rows and their per-row scales (:func:`_a_tile`, :func:`_scale_at`), the
weight tile's one scale per K step, the epilogues. Prefill's operand order only (no swap_ab).

Device-side descriptors need Triton's scratch allocator, a per-context setting: the launchers set
it before each launch (:func:`~ainfer_pd.engine.attention.triton_prefill_tma.use_tma_scratch`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ainfer_pd.engine.attention.triton_prefill_tma import use_tma_scratch
from ainfer_pd.engine.fused_moe import layout_rows, triton_cdiv
from ainfer_pd.engine.fused_moe.kernels import _expert_block
from ainfer_pd.engine.quant.fp8 import BLOCK, FP8, blocks
from ainfer_pd.engine.quant.fp8_kernels import _a_tile, _scale_at, _scaled, _store_act
from ainfer_pd.engine.quant.fp8_ops import _exact_cast
from ainfer_pd.engine.quant.fp8_plan import Fp8MoEPlan, fuses_act_quant


@triton.jit
def _w_tile(w_desc, e, n0, k0, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_K, BLOCK_N] of expert ``e``'s rows n0.. at K step k0 (a K-major view)."""
    return tl.trans(w_desc.load([e, n0, k0]).reshape(BLOCK_N, BLOCK_K))


@triton.jit(do_not_specialize=["num_pairs", "P"])
def fp8_moe_gate_up_tma_kernel(
    SORTED, BLOCK_EXPERT, NUM_POST, X, XS, W, WS, ACT, ACTS,
    num_pairs, P, E, K, I,
    stride_xt, stride_xst, stride_wse, stride_wsn, stride_an, stride_asn,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, GROUP: tl.constexpr, FUSE_QUANT: tl.constexpr, EVEN_K: tl.constexpr, EXACT: tl.constexpr,
):
    """ACT[pair, n] = silu(g) * u, g / u = x_q[tok] . W[e, n] / W[e, I + n] with the block scales;
    W [E, 2I, K] e4m3 contiguous, WS [E, 2 nb(I), nb(K)]."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, I,
                                                           BLOCK_M, BLOCK_N, GROUP_M, False)
    if not active:
        return
    w_desc = tl.make_tensor_descriptor(W, shape=[E, 2 * I, K], strides=[2 * I * K, K, 1],
                                       block_shape=[1, BLOCK_N, BLOCK_K])
    n0 = tl.min(offs_n, axis=0)
    ei = e.to(tl.int32)
    tok = (tl.where(rmask, pairs, 0) // TOPK).to(tl.int64)
    a_rows, as_rows = X + tok * stride_xt, XS + tok * stride_xst
    gs_row = WS + e * stride_wse + (n0 // GROUP) * stride_wsn
    us_row = gs_row + tl.cdiv(I, GROUP) * stride_wsn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sa, sg, su = _scale_at(as_rows, 0, K, GROUP), _scale_at(gs_row, 0, K, GROUP), _scale_at(us_row, 0, K, GROUP)
    for k0 in range(0, K, BLOCK_K):
        a, sa = _a_tile(a_rows, rmask, sa, k0, K, False, BLOCK_K, EVEN_K, EXACT)
        pg = tl.dot(a, _w_tile(w_desc, ei, n0, k0, BLOCK_N, BLOCK_K))
        pu = tl.dot(a, _w_tile(w_desc, ei, n0 + I, k0, BLOCK_N, BLOCK_K))
        nk = k0 + BLOCK_K
        sa_next, sg_next, su_next = _scale_at(as_rows, nk, K, GROUP), _scale_at(gs_row, nk, K, GROUP), \
            _scale_at(us_row, nk, K, GROUP)
        acc_g += _scaled(pg, sa, sg, False)
        acc_u += _scaled(pu, sa, su, False)
        sa, sg, su = sa_next, sg_next, su_next
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    _store_act(act, ACT, ACTS, pairs.to(tl.int64), rmask, offs_n.to(tl.int64), nmask, stride_an, stride_asn,
               FUSE_QUANT, GROUP, EXACT)


@triton.jit(do_not_specialize=["num_pairs", "P"])
def fp8_moe_down_tma_kernel(
    SORTED, BLOCK_EXPERT, NUM_POST, A, AS, W, WS, ROWS, TOPW,
    num_pairs, P, E, K, N,
    stride_an, stride_asn, stride_wse, stride_wsn, stride_rn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GROUP: tl.constexpr, EVEN_K: tl.constexpr, EXACT: tl.constexpr,
):
    """ROWS[pair, n] = topw[pair] * act_q[pair] . W[e, n] with the block scales, in ROWS' dtype;
    W [E, N, K] e4m3 contiguous (N = D, K = I), WS [E, nb(N), nb(K)]."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, N,
                                                           BLOCK_M, BLOCK_N, GROUP_M, False)
    if not active:
        return
    w_desc = tl.make_tensor_descriptor(W, shape=[E, N, K], strides=[N * K, K, 1], block_shape=[1, BLOCK_N, BLOCK_K])
    n0 = tl.min(offs_n, axis=0)
    ei = e.to(tl.int32)
    prow = pairs.to(tl.int64)
    arow = tl.where(rmask, pairs, 0).to(tl.int64)
    a_rows, as_rows = A + arow * stride_an, AS + arow * stride_asn
    bs_row = WS + e * stride_wse + (n0 // GROUP) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sa, sb = _scale_at(as_rows, 0, K, GROUP), _scale_at(bs_row, 0, K, GROUP)
    for k0 in range(0, K, BLOCK_K):
        a, sa = _a_tile(a_rows, rmask, sa, k0, K, False, BLOCK_K, EVEN_K, EXACT)
        p = tl.dot(a, _w_tile(w_desc, ei, n0, k0, BLOCK_N, BLOCK_K))
        sa_next, sb_next = _scale_at(as_rows, k0 + BLOCK_K, K, GROUP), _scale_at(bs_row, k0 + BLOCK_K, K, GROUP)
        acc += _scaled(p, sa, sb, False)
        sa, sb = sa_next, sb_next
    w = tl.load(TOPW + prow, mask=rmask, other=0.0).to(tl.float32)
    tl.store(ROWS + prow[:, None] * stride_rn + offs_n.to(tl.int64)[None, :],
             (acc * w[:, None]).to(ROWS.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


def launch_fp8_gate_up_tma(x_q, x_scale, w13_q, w13_scale, layout, top_k: int, plan: Fp8MoEPlan):
    """As :func:`ainfer_pd.engine.quant.fp8_ops.launch_fp8_gate_up` for a prefill plan (x quantized
    first, no swap, no fold, aligned layout): (act_q, act_scale), act quantized in the epilogue of a
    block_n-128 gate_up, else by a launch of its own."""
    from ainfer_pd.engine.quant.fp8_ops import per_token_group_quant
    g = plan.gate_up
    E, I2, K = w13_q.shape
    N, inter = x_q.shape[0] * top_k, I2 // 2
    assert w13_q.is_contiguous() and not plan.swap_ab and not plan.quant_x_on_load and inter % g.block_n == 0
    fused = fuses_act_quant(plan)
    act = torch.empty(N, inter, dtype=FP8 if fused else torch.float32, device=x_q.device)
    act_s = torch.empty(N, blocks(inter), dtype=torch.float32, device=x_q.device) if fused else act
    P = layout_rows(layout, g.block_m, False)
    use_tma_scratch(x_q.device)
    fp8_moe_gate_up_tma_kernel[(triton_cdiv(P, g.block_m) * triton_cdiv(inter, g.block_n),)](
        *layout, x_q, x_scale, w13_q, w13_scale, act, act_s, N, P, E, K, inter,
        x_q.stride(0), x_scale.stride(0), w13_scale.stride(0), w13_scale.stride(1), act.stride(0), act_s.stride(0),
        TOPK=top_k, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, GROUP=BLOCK,
        FUSE_QUANT=fused, EVEN_K=K % g.block_k == 0, EXACT=_exact_cast(), num_warps=g.num_warps,
        num_stages=g.num_stages)
    return (act, act_s) if fused else per_token_group_quant(act)


def launch_fp8_down_tma(act_q, act_scale, w2_q, w2_scale, rows, layout, topw, plan: Fp8MoEPlan) -> None:
    """As :func:`ainfer_pd.engine.quant.fp8_ops.launch_fp8_down` for a prefill plan (act quantized, no
    swap, no fold, aligned layout)."""
    g = plan.down
    E, N, K = w2_q.shape
    assert w2_q.is_contiguous() and act_scale is not None
    P = layout_rows(layout, g.block_m, False)
    use_tma_scratch(act_q.device)
    fp8_moe_down_tma_kernel[(triton_cdiv(P, g.block_m) * triton_cdiv(N, g.block_n),)](
        *layout, act_q, act_scale, w2_q, w2_scale, rows, topw, rows.shape[0], P, E, K, N,
        act_q.stride(0), act_scale.stride(0), w2_scale.stride(0), w2_scale.stride(1), rows.stride(0),
        BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, GROUP=BLOCK,
        EVEN_K=K % g.block_k == 0, EXACT=_exact_cast(), num_warps=g.num_warps, num_stages=g.num_stages)
