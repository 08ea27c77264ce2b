"""A candidate varlen prefill attention kernel, for the sweep (``kernel_sweep.py --sections
prefilltma``), not the engine's: the pass's own keys and values are read through TMA tensor
descriptors over the contiguous K / V of the pass (the QKV prologue's output), the cached prefix
through the block table as :func:`~ainfer_pd.engine.attention.triton_kernels.paged_prefill_kernel`
reads every key.

Why try it: the engine's kernel gathers every key tile through the block table (pointer loads: a
16-token page each 16 rows), which Triton cannot hand to a TMA producer warp, so its
``warp_specialize`` was a no-op on Hopper and its software pipelining left the softmax waiting on
each MMA (``docs/history.md``); it runs at 2.2-2.6x its FLOP bound (4K: 0.4255 ms a layer on the
H100). A prefill pass's new keys are contiguous before they are paged, and they are all of a
fresh prompt's keys (the 4K / 8K passes of the gate). If this wins, the engine's P pass keeps its
roped K / V contiguous for the kernel and the plan takes it; if not, ``docs/history.md`` says by
how much.

Device-side descriptors need Triton's scratch allocator: :func:`use_torch_allocator` (once).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ainfer_pd.engine.attention.triton_kernels import _lean_step, _raw_scores

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["T", "stride_ts"])
def prefill_tma_kernel(
    Q, KN, VN, K, V, O, TABLE, QSTART, QLEN, CTX, TSEQ, TM,
    scale_log2, T,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_ot, stride_oh, stride_ts,
    H: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, WS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    HK: tl.constexpr = H // GROUP
    seq = tl.load(TSEQ + t)
    m0 = tl.load(TM + t)
    q0 = tl.load(QSTART + seq)
    qlen = tl.load(QLEN + seq)
    cached = tl.load(CTX + seq) - qlen
    q_desc = tl.make_tensor_descriptor(Q, shape=[T, H * HEAD_DIM], strides=[H * HEAD_DIM, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(KN, shape=[T, HK * HEAD_DIM], strides=[HK * HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(VN, shape=[T, HK * HEAD_DIM], strides=[HK * HEAD_DIM, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    q = q_desc.load([q0 + m0, h * HEAD_DIM])          # rows past the sequence: another's, never stored
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # the cached prefix, through the block table: visible to every row (its first tile holds key 0)
    tbl = TABLE + seq.to(tl.int64) * stride_ts
    for n0 in range(0, cached, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < cached
        blk = tl.load(tbl + offs_n // PAGE, mask=nmask, other=0)
        slot = blk.to(tl.int64) * PAGE + offs_n % PAGE
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        s = tl.where(nmask[None, :], _raw_scores(q, k, IEEE, False), float("-inf"))
        m_i, l_i, acc = _lean_step(s, v, m_i, l_i, acc, scale_log2, IEEE)
    # the pass's own keys through TMA: tiles every row of this query tile sees whole (key j <= row m0)
    lo = ((m0 + 1) // BLOCK_N) * BLOCK_N
    for j0 in tl.range(0, lo, BLOCK_N, warp_specialize=WS):
        k = k_desc.load([q0 + j0, kvh * HEAD_DIM])
        v = v_desc.load([q0 + j0, kvh * HEAD_DIM])
        m_i, l_i, acc = _lean_step(_raw_scores(q, k, IEEE, False), v, m_i, l_i, acc, scale_log2, IEEE)
    # the diagonal: key j <= row, and j inside the sequence (the tile may reach the next one's keys)
    hi = tl.minimum(m0 + BLOCK_M, qlen)
    for j0 in range(lo, hi, BLOCK_N):
        offs_j = j0 + tl.arange(0, BLOCK_N)
        k = k_desc.load([q0 + j0, kvh * HEAD_DIM])
        v = v_desc.load([q0 + j0, kvh * HEAD_DIM])
        vis = (offs_j[None, :] <= offs_m[:, None]) & (offs_j[None, :] < qlen)
        s = tl.where(vis, _raw_scores(q, k, IEEE, False), float("-inf"))
        v = tl.where((offs_j < qlen)[:, None], v, 0.0)
        m_i, l_i, acc = _lean_step(s, v, m_i, l_i, acc, scale_log2, IEEE)
    out = acc / l_i[:, None]
    rows = (q0 + offs_m).to(tl.int64)
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=(offs_m < qlen)[:, None])


def use_torch_allocator() -> None:
    """Triton's scratch for device-side tensor descriptors, from torch's allocator."""
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def prefill_tma(q, kn, vn, kc, vc, fb, out, block_m: int = 128, block_n: int = 128, num_warps: int = 8,
                num_stages: int = 2, ws: bool = False) -> None:
    """``out`` [T, H, hd] = causal attention of ``q`` over each prefill sequence's cached keys (the
    pool ``kc`` / ``vc`` through ``fb``'s block tables) and its own, ``kn`` / ``vn`` [T, Hk, hd]
    (contiguous; the same values the pass writes into the pool)."""
    T, H, hd = q.shape
    Hk = kn.shape[1]
    assert q.is_contiguous() and kn.is_contiguous() and vn.is_contiguous()
    pm = fb.build_prefill_meta(block_m, True)          # cached on the batch for this tile height
    NT = int(pm.tile_seq.shape[0])
    if NT == 0:
        return
    prefill_tma_kernel[(NT, H)](
        q, kn, vn, kc, vc, out, pm.block_table, pm.q_start, pm.q_len, pm.ctx_len, pm.tile_seq, pm.tile_m,
        _LOG2E / math.sqrt(hd), T, kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        out.stride(0), out.stride(1), pm.block_table.stride(0),
        H=H, GROUP=H // Hk, HEAD_DIM=hd, PAGE=fb.block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32, WS=ws, num_warps=num_warps, num_stages=num_stages)
