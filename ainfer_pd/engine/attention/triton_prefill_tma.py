"""The long prefill passes' attention kernel: the pass's own keys and values read through TMA tensor
descriptors, the cached prefix through the block table.

:func:`~.triton_kernels.paged_prefill_kernel` gathers every key tile through the block table
(pointer loads: a 16-token page each 16 rows), which Triton cannot hand to a TMA producer warp, so
its ``warp_specialize`` was a no-op on Hopper and its software pipelining left the softmax waiting
on each MMA (``docs/history.md``). A prefill pass's new keys are contiguous before they are paged:
the QKV prologue keeps them, roped, in the fused projection's output (``keep_k``), and this kernel
reads them there through device-side tensor descriptors (``tl.make_tensor_descriptor``) and only
the cached prefix through the block table. H100, tile 128 x 128 on 8 warps, 3 stages
(``docs/results/kernels/prefill_tma_sweep_b6cf56b_h100.txt``): a 4,096-token fresh prefill layer
0.3232 ms against the paged kernel's 0.4297, 8,192 tokens 1.0535 against 1.4499; 575 tokens on
1,500 cached 0.157 against 0.140, so only long passes take it (:func:`.plan.prefill_plan`).

Inputs are views of the fused QKV output ``[T, (H + 2 Hk) hd]``: q ``[T, H, hd]``, the own keys and
values ``[T, Hk, hd]``, each with contiguous heads (``stride(2) == 1``, ``stride(1) == hd``) and a
row stride of its own (:func:`tma_layout_ok`). Needs Hopper or newer and a 16-bit pool (an FP8
pool holds quantized keys, the own ones are not). Runs under ``TRITON_INTERPRET=1`` too.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..tma import use_tma_scratch
from .batch import ForwardBatch
from .plan import PrefillPlan
from .triton_kernels import _lean_step, _raw_scores

_LOG2E = 1.4426950408889634


@triton.jit
def _prefix_keys(q, K, V, tbl, cached, kvh, m_i, l_i, acc, scale_log2, stride_kn, stride_kh, stride_vn, stride_vh,
                 HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """The cached prefix of a sequence, through its block table ``tbl``: visible to every row (its
    first tile holds key 0)."""
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in range(0, cached, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < cached
        blk = tl.load(tbl + offs_n // PAGE, mask=nmask, other=0)
        slot = blk.to(tl.int64) * PAGE + offs_n % PAGE
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.where(nmask[None, :], _raw_scores(q, k, IEEE, False), float("-inf"))
        m_i, l_i, acc = _lean_step(s, v, m_i, l_i, acc, scale_log2, IEEE)
    return m_i, l_i, acc


@triton.jit
def _own_keys(q, k_desc, v_desc, q0, m0, qlen, kvh, m_i, l_i, acc, scale_log2, HEAD_DIM: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WS: tl.constexpr):
    """The sequence's own keys (rows ``q0 ..`` of the descriptors) for query rows ``m0 .. + BLOCK_M``."""
    # tiles every row of the query tile sees whole (key j <= row m0): no mask
    lo = ((m0 + 1) // BLOCK_N) * BLOCK_N
    for j0 in tl.range(0, lo, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([q0 + j0, kvh * HEAD_DIM])
        v = v_desc.load([q0 + j0, kvh * HEAD_DIM])
        m_i, l_i, acc = _lean_step(_raw_scores(q, k, IEEE, False), v, m_i, l_i, acc, scale_log2, IEEE)
    # the diagonal: key j <= row, and j inside the sequence (the tile may reach the next one's keys;
    # past the last row the descriptor reads zeros)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    hi = tl.minimum(m0 + BLOCK_M, qlen)
    for j0 in range(lo, hi, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        k = k_desc.load([q0 + j0, kvh * HEAD_DIM])
        v = v_desc.load([q0 + j0, kvh * HEAD_DIM])
        vis = (offs_j[None, :] <= offs_m[:, None]) & (offs_j[None, :] < qlen)
        s = tl.where(vis, _raw_scores(q, k, IEEE, False), float("-inf"))
        v = tl.where((offs_j < qlen)[:, None], v, 0.0)
        m_i, l_i, acc = _lean_step(s, v, m_i, l_i, acc, scale_log2, IEEE)
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["T", "stride_ts"])
def prefill_tma_kernel(
    Q, KN, VN, K, V, O, TABLE, QSTART, QLEN, CTX, TSEQ, TM,
    scale_log2, T,
    stride_qt, stride_knt, stride_vnt,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_ts,
    H: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WS: tl.constexpr,
):
    """Grid ``NT x H`` (query tiles of every prefill sequence, query heads), as the paged kernel's.
    ``Q`` / ``KN`` / ``VN``: rows of ``stride_qt`` / ``stride_knt`` / ``stride_vnt`` elements, the
    heads contiguous in each; ``K`` / ``V``: the layer's pool (the cached prefix)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    HK: tl.constexpr = H // GROUP
    seq = tl.load(TSEQ + t)
    m0 = tl.load(TM + t)
    q0 = tl.load(QSTART + seq)
    qlen = tl.load(QLEN + seq)
    cached = tl.load(CTX + seq) - qlen
    q_desc = tl.make_tensor_descriptor(Q, shape=[T, H * HEAD_DIM], strides=[stride_qt, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(KN, shape=[T, HK * HEAD_DIM], strides=[stride_knt, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(VN, shape=[T, HK * HEAD_DIM], strides=[stride_vnt, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    q = q_desc.load([q0 + m0, h * HEAD_DIM])          # rows past the sequence: another's, never stored
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_i, l_i, acc = _prefix_keys(q, K, V, TABLE + seq.to(tl.int64) * stride_ts, cached, kvh, m_i, l_i, acc,
                                 scale_log2, stride_kn, stride_kh, stride_vn, stride_vh, HEAD_DIM, PAGE, BLOCK_N, IEEE)
    m_i, l_i, acc = _own_keys(q, k_desc, v_desc, q0, m0, qlen, kvh, m_i, l_i, acc, scale_log2, HEAD_DIM,
                              BLOCK_M, BLOCK_N, IEEE, WS)
    out = acc / l_i[:, None]
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (q0 + offs_m).to(tl.int64)
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=(offs_m < qlen)[:, None])


def tma_layout_ok(x: Tensor) -> bool:
    """Whether ``x`` [T, heads, hd] can back a tensor descriptor over its rows: contiguous heads,
    its base and row stride on 16 bytes (TMA's alignment)."""
    es = x.element_size()
    return (x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]
            and (x.stride(0) * es) % 16 == 0 and x.data_ptr() % 16 == 0)


def prefill_tma(q: Tensor, kn: Tensor, vn: Tensor, kc: Tensor, vc: Tensor, fb: ForwardBatch, out: Tensor,
                plan: PrefillPlan, ws: bool = False) -> None:
    """``out`` [T, H, hd] = causal attention of ``q`` over each prefill sequence of ``fb``: its cached
    keys (the pool ``kc`` / ``vc`` through the block tables) and its own, ``kn`` / ``vn`` [T, Hk, hd]
    (the same roped values the pass wrote into the pool). ``plan``: the tile; ``ws``: warp-specialize
    the unmasked own-key loop (the sweep's option: no faster on the H100)."""
    T, H, hd = q.shape
    Hk = kn.shape[1]
    assert kn.shape[0] == T and vn.shape[0] == T and tma_layout_ok(q) and tma_layout_ok(kn) and tma_layout_ok(vn)
    pm = fb.build_prefill_meta(plan.block_m, plan.heavy_first)       # cached on the batch for this tile
    NT = int(pm.tile_seq.shape[0])
    if NT == 0:
        return
    use_tma_scratch(q.device)
    prefill_tma_kernel[(NT, H)](
        q, kn, vn, kc, vc, out, pm.block_table, pm.q_start, pm.q_len, pm.ctx_len, pm.tile_seq, pm.tile_m,
        _LOG2E / math.sqrt(hd), T, q.stride(0), kn.stride(0), vn.stride(0),
        kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1), out.stride(0), out.stride(1), pm.block_table.stride(0),
        H=H, GROUP=H // Hk, HEAD_DIM=hd, PAGE=fb.block_size, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        IEEE=q.dtype == torch.float32, WS=ws, num_warps=plan.num_warps, num_stages=plan.num_stages)
