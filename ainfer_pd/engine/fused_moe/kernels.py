"""Triton kernels of the fused MoE: grouped expert GEMMs over expert-sorted (token, slot) rows.

Shape legend: T = tokens, k = top-k, N = T * k (token, slot) rows ("pairs", row id
``token * k + slot``), D = hidden, I = expert intermediate, E = experts, P = padded sorted
length. ``SORTED [P]`` lists pair ids grouped by expert, each expert's run padded to a multiple
of BLOCK_M with the sentinel N; ``BLOCK_EXPERT [P / BLOCK_M]`` is the expert of each block;
``NUM_POST [1]`` the padded length actually used (blocks beyond it exit at once).

* ``moe_gate_up_kernel``: ``ACT[pair] = silu(x[tok] @ W13[e, :, :I]) * (x[tok] @ W13[e, :, I:])``,
  both halves accumulated in one program (the [N, 2I] intermediate never exists), x read in
  place through the token id of each pair (no [N, D] gather).
* ``moe_down_kernel``: ``OUT[pair] = w[pair] * ACT[pair] @ W2[e]``; the caller sums the k rows
  of each token in a fixed order (a token's output does not depend on its batch).

Row counts (``num_pairs``, ``P``) are ``do_not_specialize``: no recompilation per batch size.
Programs are grouped ``GROUP_M`` row blocks at a time (the usual L2 swizzle), so an expert's
weight tiles are read from HBM once per group of its row blocks.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_ids(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, NCOLS, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, DIRECT: tl.constexpr):
    """This program's row block and column tile: (in use, expert, pair ids, row mask, columns,
    column mask). Blocks past NUM_POST hold only padding (the caller exits). ``DIRECT``: row block
    ``m`` is pair ``m`` alone and ``BLOCK_EXPERT`` the routing's flat expert ids (no layout: P is
    ``num_pairs * BLOCK_M``, SORTED and NUM_POST are not read)."""
    pid_m, pid_n = _tile_ids(tl.cdiv(P, BLOCK_M), tl.cdiv(NCOLS, BLOCK_N), GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if DIRECT:                        # one branch is compiled: one return, one set of types
        active = pid_m < num_pairs
        pairs = pid_m + tl.zeros([BLOCK_M], tl.int32)
        rmask = tl.arange(0, BLOCK_M) == 0
    else:
        active = pid_m * BLOCK_M < tl.load(NUM_POST)
        pairs = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int32)
        rmask = pairs < num_pairs
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    if DIRECT:                        # a padding row's pair (expert -1, :func:`softmax_topk_kernel`): nothing
        active = active & (e >= 0)
    return active, e, pairs, rmask, offs_n, offs_n < NCOLS


@triton.jit
def _dot_pair(a, bg, bu, acc_g, acc_u, IEEE: tl.constexpr):
    """gate_up's step: ``a`` into both halves' accumulators (IEEE: float32's exact products)."""
    if IEEE:
        acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
        acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
    else:
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
    return acc_g, acc_u


@triton.jit
def gate_up_rows(X, W, ACT, pairs, rmask, e, offs_n, nmask, K, I,
                 stride_xt, stride_we, stride_wk, stride_wn, stride_an,
                 TOPK: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """gate_up of one row block: ``pairs`` [rows] (``rmask``: the real ones) of expert ``e``, columns
    ``offs_n`` (``nmask``) of both halves; the tile's rows are ``pairs``' length."""
    tok = (pairs // TOPK).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = X + tok[:, None] * stride_xt + offs_k[None, :]
    g_ptr = W + e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    u_ptr = g_ptr + I * stride_wn
    acc_g = tl.zeros([pairs.shape[0], offs_n.shape[0]], tl.float32)
    acc_u = tl.zeros([pairs.shape[0], offs_n.shape[0]], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        bg = tl.load(g_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        bu = tl.load(u_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc_g, acc_u = _dot_pair(a, bg, bu, acc_g, acc_u, IEEE)
        a_ptr += BLOCK_K
        g_ptr += BLOCK_K * stride_wk
        u_ptr += BLOCK_K * stride_wk
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptr = ACT + pairs.to(tl.int64)[:, None] * stride_an + offs_n[None, :]
    tl.store(out_ptr, act.to(ACT.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "P"])
def moe_gate_up_kernel(
    X, W, ACT, SORTED, BLOCK_EXPERT, NUM_POST,
    num_pairs, P, K, I,
    stride_xt, stride_we, stride_wk, stride_wn, stride_an,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr,
):
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, I,
                                                           BLOCK_M, BLOCK_N, GROUP_M, DIRECT)
    if not active:
        return
    gate_up_rows(X, W, ACT, pairs, rmask, e, offs_n, nmask, K, I, stride_xt, stride_we, stride_wk, stride_wn,
                 stride_an, TOPK, BLOCK_K, IEEE)


@triton.jit
def down_rows(A, W, OUT, TOPW, pairs, rmask, e, offs_n, nmask, K,
              stride_an, stride_we, stride_wk, stride_wn, stride_on,
              BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """down of one row block: ``OUT[pair] = w[pair] * ACT[pair] @ W2[e]`` for ``pairs`` (``rmask``)."""
    prow = pairs.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + prow[:, None] * stride_an + offs_k[None, :]
    b_ptr = W + e * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros([pairs.shape[0], offs_n.shape[0]], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K * stride_wk
    w = tl.load(TOPW + prow, mask=rmask, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    tl.store(OUT + prow[:, None] * stride_on + offs_n[None, :], acc.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "P"])
def moe_down_kernel(
    A, W, OUT, SORTED, BLOCK_EXPERT, NUM_POST, TOPW,
    num_pairs, P, K, N,
    stride_an, stride_we, stride_wk, stride_wn, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr, DIRECT: tl.constexpr,
):
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, N,
                                                           BLOCK_M, BLOCK_N, GROUP_M, DIRECT)
    if not active:
        return
    down_rows(A, W, OUT, TOPW, pairs, rmask, e, offs_n, nmask, K, stride_an, stride_we, stride_wk, stride_wn,
              stride_on, BLOCK_K, IEEE)


@triton.jit(do_not_specialize=["P", "num_pairs"])
def moe_align_kernel(
    COUNTS, SORTED, BLOCK_EXPERT, NUM_POST, CURSOR,
    E, P, num_pairs,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, FILL: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr,
):
    """One program: per-expert padded starts (into CURSOR), the expert of every row block, the
    padded length in use, and the sentinel in every sorted slot (``moe_scatter_kernel`` fills)."""
    offs_e = tl.arange(0, E_PAD)
    emask = offs_e < E
    c = tl.load(COUNTS + offs_e, mask=emask, other=0).to(tl.int32)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    tl.store(CURSOR + offs_e, end - padded, mask=emask)
    tl.store(NUM_POST, tl.sum(padded, 0))
    nb = P // BLOCK_M
    for b0 in range(0, nb, BLOCKS_PER_STEP):
        offs_b = b0 + tl.arange(0, BLOCKS_PER_STEP)
        before = (end[None, :] <= (offs_b * BLOCK_M)[:, None]) & emask[None, :]
        ex = tl.minimum(tl.sum(before.to(tl.int32), 1), E - 1)
        tl.store(BLOCK_EXPERT + offs_b, ex, mask=offs_b < nb)
    for p0 in range(0, P, FILL):
        offs_p = p0 + tl.arange(0, FILL)
        tl.store(SORTED + offs_p, tl.full([FILL], 0, tl.int32) + num_pairs, mask=offs_p < P)


@triton.jit(do_not_specialize=["num_pairs"])
def moe_scatter_kernel(TOPK_IDX, SORTED, CURSOR, num_pairs, BLOCK: tl.constexpr):
    """Each (token, slot) pair takes the next slot of its expert's padded run (atomic cursor).
    Which pairs share a row block varies from run to run; no result depends on it (rows of a
    block are computed independently). A padding row's pairs (expert -1) take none. The cursor's
    atomics are relaxed: only the slots they hand out matter, and the next launch sees every store."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(TOPK_IDX + offs, mask=offs < num_pairs, other=-1)
    m = e >= 0
    dest = tl.atomic_add(CURSOR + e, 1, mask=m, sem="relaxed")
    tl.store(SORTED + dest, offs, mask=m)


@triton.jit(do_not_specialize=["E", "pad_slot"])
def softmax_topk_kernel(LOGITS, TOPK_W, TOPK_IDX, COUNTS, SLOTS, E, stride_l, pad_slot,
                        K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, NORM: tl.constexpr,
                        HAS_PAD: tl.constexpr):
    """One token: softmax (float32) over its E router logits, the top K by repeated max (ties:
    the lowest expert id first; descending, as ``torch.topk``), weights renormalised over the K
    when NORM, and one count per chosen expert (atomic). Replaces the softmax, top-k (select
    and sort), sum, divide, cast and scatter-add launches of the torch router. HAS_PAD: a token
    whose KV slot (SLOTS) is ``pad_slot`` is a padding row of a graph bucket or a replica: its
    K pairs get expert -1 and weight 0 and count nowhere, so no expert runs for it. The K counts
    are one relaxed vector atomic after the choice (Triton's default, acq_rel, fenced each of K
    scalar atomics in turn: ~7.5 us a layer at 64 tokens on the H100, most of the kernel)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    emask = offs < E
    x = tl.load(LOGITS + t * stride_l + offs, mask=emask, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(emask, p, 0.0)
    p = p / tl.sum(p, 0)
    kk = tl.arange(0, K_PAD)
    wv = tl.zeros([K_PAD], tl.float32)
    iv = tl.zeros([K_PAD], tl.int64)
    for j in tl.static_range(K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where((p == best) & emask, offs, E_PAD), 0)
        wv = tl.where(kk == j, best, wv)
        iv = tl.where(kk == j, idx.to(tl.int64), iv)
        p = tl.where(offs == idx, -1.0, p)
    if NORM:
        wv = wv / tl.sum(wv, 0)
    kmask = kk < K
    if HAS_PAD:
        live = tl.load(SLOTS + t) != pad_slot
        wv = tl.where(live, wv, 0.0)
        iv = tl.where(live, iv, -1)
    # one relaxed vector atomic; a padding row's -1 and a NaN row's out-of-range choice count nowhere
    tl.atomic_add(COUNTS + iv, 1, mask=kmask & (iv >= 0) & (iv < E), sem="relaxed")
    tl.store(TOPK_W + t * K + kk, wv.to(TOPK_W.dtype.element_ty), mask=kmask)
    tl.store(TOPK_IDX + t * K + kk, iv, mask=kmask)


@triton.jit
def moe_sum_kernel(ROWS, IDS, RES, OUT, D, stride_r, stride_res, stride_o, TOPK: tl.constexpr, BLOCK_D: tl.constexpr,
                   HAS_IDS: tl.constexpr, HAS_RES: tl.constexpr):
    """``OUT[t] = sum_j ROWS[t * TOPK + j]``: each token's k expert rows added in slot order in
    float32, rounded once to OUT's dtype (a token's output depends neither on its batch nor on run
    order). ``HAS_IDS``: a pair whose expert ``IDS[t * TOPK + j]`` is -1 (a padding row's, routed
    nowhere: its row was never written) adds 0. ``HAS_RES``: ``RES[t]`` (the residual stream) is added to
    the sum before the rounding (no add launch after the experts). Program (token, column block). torch's sum over
    [T, k, D] took ~6 us at 64 tokens (a generic reduction's launch) and ~61 us at 4,096 (74% of
    its bytes' time) on the H100."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < D
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(TOPK):
        mj = m
        if HAS_IDS:
            mj = m & ((offs * 0 + tl.load(IDS + t * TOPK + j)) >= 0)     # (a vector: the interpreter's masks)
        acc += tl.load(ROWS + (t * TOPK + j) * stride_r + offs, mask=mj, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(RES + t * stride_res + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_o + offs, acc.to(OUT.dtype.element_ty), mask=m)
