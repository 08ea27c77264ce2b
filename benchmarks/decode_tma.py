"""A candidate paged decode attention kernel whose key and value pages come through a TMA tensor
descriptor, for the sweep (``python benchmarks/kernel_sweep.py --sections decodetma --budget-s 120``
on a GPU host), not the engine's.

Why try it: the engine's :func:`~ainfer_pd.engine.attention.triton_kernels.paged_decode_kernel`
gathers each 64-key tile as pointer loads through the block table, and decode attention is the
gate's one kernel over its target: 1.52x its KV bytes at B 32 x 2K on the H100 (5f58c4c), 1.72x
on the H200 (target 1.5x). A page of the pool is contiguous ([PAGE, hd] rows of one KV head, row
stride Hk x hd), so each page can be one descriptor load (Hopper's TMA cannot gather several pages
in one load): ``PAGES`` of them a step, each its own online-softmax update. The split layout, the
partial outputs and the merge are the engine's (:func:`~ainfer_pd.engine.attention.plan.decode_plan`,
``decode_merge_kernel``), so a row's splits are the same in both; a 16-bit pool only.

Device-side descriptors need Triton's scratch allocator (a per-context setting): the launcher sets
it before each launch (:func:`~ainfer_pd.engine.attention.triton_prefill_tma.use_tma_scratch`).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ainfer_pd.engine.attention.plan import DecodePlan
from ainfer_pd.engine.attention.triton_kernels import (_raw_scores, _softmax_step, _split_len,
                                                       decode_merge_kernel)
from ainfer_pd.engine.attention.triton_prefill_tma import use_tma_scratch

_LOG2E = 1.4426950408889634


@triton.jit
def _page(k_desc, v_desc, tbl, p0, end, kvh, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The K and V rows [PAGE, hd] of KV head ``kvh`` of the page holding key ``p0`` (a page past the
    split's ``end``: page 0's, masked whole by the caller)."""
    blk = tl.load(tbl + p0 // PAGE, mask=p0 < end, other=0).to(tl.int32)
    return k_desc.load([blk * PAGE, kvh * HEAD_DIM]), v_desc.load([blk * PAGE, kvh * HEAD_DIM])


@triton.jit
def _cat(a, b):
    """Rows of ``a`` then rows of ``b`` (both [R, C]) -> [2R, C]."""
    return tl.permute(tl.join(a, b), (2, 0, 1)).reshape(2 * a.shape[0], a.shape[1])


@triton.jit(do_not_specialize=["num_splits", "stride_tb", "S"])
def decode_tma_kernel(
    Q, K, V, TABLE, LENS, O, OP, LSE,
    scale_log2, num_splits, S,
    stride_qb, stride_qh, stride_tb, stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    HK: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    PAGES: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr,
    SINGLE: tl.constexpr, IEEE: tl.constexpr, JOIN: tl.constexpr,
):
    """Program (row b, KV head, split): the row's keys of its split, ``PAGES`` pages a step, each page
    one descriptor load of K and one of V (``JOIN``: the step's pages joined into one tile, one
    online-softmax update a step, else one a page); partial output and log-sum-exp as the engine's."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    ctx = tl.load(LENS + b).to(tl.int32)
    split = _split_len(ctx, SPLIT_KEYS, MAX_SPLITS, BLOCK_N)
    if (sp > 0) & (sp * split >= ctx):
        return
    k_desc = tl.make_tensor_descriptor(K, shape=[S, HK * HEAD_DIM], strides=[HK * HEAD_DIM, 1],
                                       block_shape=[PAGE, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V, shape=[S, HK * HEAD_DIM], strides=[HK * HEAD_DIM, 1],
                                       block_shape=[PAGE, HEAD_DIM])
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kvh * GROUP + offs_g
    gmask = offs_g < GROUP
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=gmask[:, None], other=0.0)
    start = sp * split
    end = tl.minimum(start + split, ctx)
    tbl = TABLE + b * stride_tb
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, PAGE * PAGES):
        if JOIN:                                     # the step's pages as one [PAGES x PAGE, hd] tile
            k, v = _page(k_desc, v_desc, tbl, n0, end, kvh, PAGE, HEAD_DIM)
            if PAGES >= 2:
                k1, v1 = _page(k_desc, v_desc, tbl, n0 + PAGE, end, kvh, PAGE, HEAD_DIM)
                k, v = _cat(k, k1), _cat(v, v1)
            if PAGES == 4:
                k2, v2 = _page(k_desc, v_desc, tbl, n0 + 2 * PAGE, end, kvh, PAGE, HEAD_DIM)
                k3, v3 = _page(k_desc, v_desc, tbl, n0 + 3 * PAGE, end, kvh, PAGE, HEAD_DIM)
                k, v = _cat(k, _cat(k2, k3)), _cat(v, _cat(v2, v3))
            nmask = n0 + tl.arange(0, PAGE * PAGES) < end
            qk = tl.where(nmask[None, :], _raw_scores(q, k, IEEE, False) * scale_log2, float("-inf"))
            m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, IEEE)
        else:                                        # one online-softmax update a page
            for p in tl.static_range(PAGES):
                p0 = n0 + p * PAGE
                k, v = _page(k_desc, v_desc, tbl, p0, end, kvh, PAGE, HEAD_DIM)
                nmask = p0 + tl.arange(0, PAGE) < end
                qk = tl.where(nmask[None, :], _raw_scores(q, k, IEEE, False) * scale_log2, float("-inf"))
                m_i, l_i, acc = _softmax_step(qk, v, m_i, l_i, acc, IEEE)
    safe_l = tl.where(l_i == 0.0, 1.0, l_i)
    if SINGLE:
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / safe_l[:, None]).to(O.dtype.element_ty), mask=gmask[:, None])
    else:
        tl.store(OP + b * stride_pb + heads[:, None] * stride_ph + sp * stride_ps + offs_d[None, :],
                 acc / safe_l[:, None], mask=gmask[:, None])
        tl.store(LSE + b * stride_lb + heads * stride_lh + sp, m_i + tl.log2(l_i), mask=gmask)


def decode_tma(q, kc, vc, fb, plan: DecodePlan, pages: int = 4, num_warps: int | None = None,
               num_stages: int | None = None, join: bool = False):
    """Decode attention of ``fb``'s rows (``q`` [B, H, hd]) over the pool ``kc`` / ``vc`` [S, Hk, hd]
    (contiguous, 16-bit) through its block tables -> [B, H, hd], split as ``plan`` splits."""
    d = fb.decode
    B, H, hd = q.shape
    S, Hk = kc.shape[0], kc.shape[1]
    page = d.block_size
    assert kc.is_contiguous() and vc.is_contiguous() and plan.block_n % (page * pages) == 0 and pages in (1, 2, 4)
    out = torch.empty_like(q)
    if B == 0:
        return out
    split = plan.num_splits > 1
    op = torch.empty(B, H, plan.num_splits, hd, dtype=torch.float32, device=q.device) if split else out
    lse = torch.empty(B, H, plan.num_splits, dtype=torch.float32, device=q.device) if split else out
    table = d.block_table
    G = H // Hk
    use_tma_scratch(q.device)
    decode_tma_kernel[(B, Hk, plan.num_splits)](
        q, kc, vc, table, d.ctx_lens, out, op, lse, _LOG2E / math.sqrt(hd), plan.num_splits, S,
        q.stride(0), q.stride(1), table.stride(0), out.stride(0), out.stride(1),
        op.stride(0), op.stride(1), op.stride(2) if split else 0, lse.stride(0), lse.stride(1),
        HK=Hk, GROUP=G, GROUP_PAD=max(16, 1 << (G - 1).bit_length()), HEAD_DIM=hd, PAGE=page, PAGES=pages,
        BLOCK_N=plan.block_n, SPLIT_KEYS=plan.split_keys, MAX_SPLITS=plan.max_splits, SINGLE=not split,
        IEEE=q.dtype == torch.float32, JOIN=join, num_warps=num_warps or plan.num_warps,
        num_stages=num_stages or plan.num_stages)
    if split:
        decode_merge_kernel[(B, H)](
            op, lse, out, d.ctx_lens, plan.num_splits, op.stride(0), op.stride(1), op.stride(2), lse.stride(0),
            lse.stride(1), out.stride(0), out.stride(1), HEAD_DIM=hd,
            SPLITS_PAD=1 << (plan.num_splits - 1).bit_length(), SPLIT_KEYS=plan.split_keys,
            MAX_SPLITS=plan.max_splits, BLOCK_N=plan.block_n, num_warps=4)
    return out
