"""Triton kernels of the paged attention backend: they read K/V in place through block tables.

Shape legend: B = decode rows, H = query heads, Hk = KV heads, G = H / Hk (GQA group),
hd = head dim, NS = KV splits of a decode row, NT = prefill query tiles, PAGE = block size.
The cache of one layer is ``K, V [slots, Hk, hd]``; key n of a sequence lives in slot
``table[n // PAGE] * PAGE + n % PAGE``.

* ``paged_decode_kernel`` (grid ``B x Hk x NS``): one program attends the G query heads of one
  KV head of one row over one split of its keys (flash-decoding); the G heads share every K/V
  load, so KV bytes are read once per row and KV head. With NS = 1 it writes the output, else
  a partial output and its log-sum-exp (base 2) that ``decode_merge_kernel`` combines. A verify
  pass (``WIDTH`` > 1: speculative decoding's 1 + k positions of a turn, consecutive rows) reads
  them once per turn: a group's first row attends its rows' G heads each (:func:`_verify_group`).

Integer arguments that change from batch to batch are ``do_not_specialize``: Triton would
otherwise compile a new variant for each new divisibility (0.5-0.9 s stalls inside P epochs,
seen on the H200).
* ``paged_prefill_kernel`` (grid ``NT x H``): flash-attention forward over varlen query tiles of
  every sequence of a pass, causal aligned to the end of each sequence's keys (lower right):
  query i of a sequence with ``cached`` earlier keys sees keys ``0 .. cached + i``.

Softmax runs in base 2 with the scale folded into ``scale_log2 = log2(e) / sqrt(hd)``.

An FP8 pool (``KV_FP8``, ``cache.kv_dtype: fp8_e4m3``; :mod:`.kv_fp8`): K and V tiles load as e4m3
and widen exactly to the MMA's dtype (float16 for bfloat16 queries, scaled by a power of two:
:func:`_mma_query`; else the query's dtype); the layer's scales ``KV_SCALE [2]``
(K, V; read from device memory, so graphs replay whatever they hold) fold into the scores
(``scale_log2 * k_scale``) and into the output (``acc * v_scale``, linear in V): the same math as
multiplying every element by its scale (the QKV prologue, :mod:`.prologue_kernels`, quantizes what it
stores).
These run on CUDA, and on CPU tensors under ``TRITON_INTERPRET=1`` (the CI checks their logic).
"""
from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _softmax_step(qk, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One online-softmax update (base 2) with the scores ``qk`` of a key tile (masked keys are
    -inf) and its values ``v``; rows that have seen no key yet keep m = -inf and add nothing."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _lean_step(s, v, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """:func:`_softmax_step` on unscaled scores ``s`` (masked keys -inf) for the prefill kernel: the
    scale rides the exponent's multiply-add (one op a score fewer) and the rescaled accumulator is
    the MMA's addend (H100: 0.4-3% faster than scaling first). Every row must see a key in its first
    tile, as causal prefill's rows do (key 0), so no row's maximum stays -inf."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit
def _raw_scores(q, k, IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    k = _widen(k, q, KV_FP8)
    if IEEE:
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _widen(x, like, KV_FP8: tl.constexpr):
    """A K or V tile in the dtype of ``like`` (the MMA's query tile from :func:`_mma_query`: float16
    or float32 on an FP8 pool, never bfloat16): e4m3 bytes widened exactly in one conversion, else
    as loaded."""
    if KV_FP8:
        y = x.to(like.dtype)
    else:
        y = x
    return y


@triton.jit
def _pow2(e):
    """2^e, exactly, for an int32 ``e`` in [-126, 127] (written into float32's exponent field)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mma_query(q, scale_log2, KV_FP8: tl.constexpr):
    """The query tile as the MMAs read it, and the scores' scale. On an FP8 pool with bfloat16
    queries both MMAs run in float16: e4m3 widens to float16 in one conversion per pair of
    elements, where widening to bfloat16 goes through float32 (four conversions per pair, on the
    SM's narrow conversion pipe: the FP8 decode kernel was bound by them, not by its bytes). The
    tile is scaled by 2^-e, the power of two that brings its largest magnitude under 2^15
    (e = 0 for any query under 32,768), so float16 holds every bfloat16 element exactly (bar ones
    2^29 below the largest, rounded as float16 subnormals) and the products equal bfloat16's; the
    scores' scale takes 2^e back. The probabilities then meet V in float16 (11 mantissa bits
    against bfloat16's 8). Other dtypes are left as they are."""
    qm = q
    s = scale_log2
    if KV_FP8:
        if q.dtype == tl.bfloat16:
            qf = q.to(tl.float32)
            amax = tl.max(tl.max(tl.abs(qf), 1), 0)
            e = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 14, 0)
            qm = (qf * _pow2(-e)).to(tl.float16)
            s = scale_log2 * _pow2(e)
    return qm, s


@triton.jit
def _scores(q, k, scale_log2, IEEE: tl.constexpr, KV_FP8: tl.constexpr):
    return _raw_scores(q, k, IEEE, KV_FP8) * scale_log2


@triton.jit
def _split_len(ctx, SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of each split of a row with ``ctx`` keys: SPLIT_KEYS while the row needs at most
    MAX_SPLITS of them, else the row's keys over MAX_SPLITS rounded up to BLOCK_N. A function of
    the row's own length only: the same in every batch, bucket and graph."""
    per = tl.cdiv(tl.cdiv(ctx, MAX_SPLITS), BLOCK_N) * BLOCK_N
    return tl.maximum(per, SPLIT_KEYS)


@triton.jit
def _verify_group(LENS, LEAD, b, offs_m, GROUP: tl.constexpr, WIDTH: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                  MAX_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows program ``b`` attends in a verify pass (``LEAD`` [B]: each row's offset in its group of
    consecutive rows of one turn, at most WIDTH, with lengths rising by one; 0 on a group's first row).
    A group's first row attends every row of its group whose keys split as its own do (below 16K keys
    always: the splits are SPLIT_KEYS long), its M rows being (row ``m // GROUP``, head ``m % GROUP``); a
    row that splits otherwise (or lies WIDTH or more rows past it) attends itself alone; a row its first row
    attends returns ctx 0 (nothing to do).
    Returns (each M row's batch row, attended, keys; the group's most keys, the split length)."""
    own = tl.load(LENS + b).to(tl.int32)
    split = _split_len(own, SPLIT_KEYS, MAX_SPLITS, BLOCK_N)
    off = tl.load(LEAD + b).to(tl.int32)
    first = _split_len(tl.load(LENS + b - off).to(tl.int32), SPLIT_KEYS, MAX_SPLITS, BLOCK_N)
    w = offs_m // GROUP
    rows = b + w
    inb = (offs_m < WIDTH * GROUP) & (rows < tl.num_programs(0))
    lens = tl.load(LENS + rows, mask=inb, other=0).to(tl.int32)
    lead = tl.load(LEAD + rows, mask=inb, other=-1).to(tl.int32)
    same = (lead == w) & (_split_len(lens, SPLIT_KEYS, MAX_SPLITS, BLOCK_N) == split)
    member = inb & tl.where(off > 0, w == 0, same)
    ctx = tl.max(tl.where(member, lens, 0), 0)
    ctx = tl.where((off > 0) & (off < WIDTH) & (first == split), 0, ctx)
    return rows, member, lens, ctx, split


@triton.jit(do_not_specialize=["num_splits", "stride_tb"])
def paged_decode_kernel(
    Q, K, V, TABLE, LENS, LEAD, O, OP, LSE, KV_SCALE,
    scale_log2, num_splits,
    stride_qb, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, M_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr, SINGLE: tl.constexpr,
    IEEE: tl.constexpr, KV_FP8: tl.constexpr, WIDTH: tl.constexpr = 1,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    offs_m = tl.arange(0, M_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    if WIDTH == 1:                      # one row: its G heads
        ctx = tl.load(LENS + b).to(tl.int32)
        split = _split_len(ctx, SPLIT_KEYS, MAX_SPLITS, BLOCK_N)
        heads = kvh * GROUP + offs_m
        mmask = offs_m < GROUP
        q_ptrs = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    else:                               # a verify group: up to WIDTH rows of one turn share each K / V load
        rows, mmask, lens, ctx, split = _verify_group(LENS, LEAD, b, offs_m, GROUP, WIDTH, SPLIT_KEYS, MAX_SPLITS,
                                                      BLOCK_N)
        if ctx == 0:
            return
        heads = kvh * GROUP + offs_m % GROUP
        q_ptrs = Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    if (sp > 0) & (sp * split >= ctx):
        return                          # past the row's keys: the merge reads only the row's splits
    q = tl.load(q_ptrs, mask=mmask[:, None], other=0.0)
    start = sp * split
    end = tl.minimum(start + split, ctx)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(KV_SCALE)
    q, scale_log2 = _mma_query(q, scale_log2, KV_FP8)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        blk = tl.load(TABLE + b * stride_tb + offs_n // PAGE, mask=nmask, other=0)
        slot = blk.to(tl.int64) * PAGE + offs_n % PAGE
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if WIDTH == 1:
            seen = nmask[None, :]
        else:                           # each row its own keys: a draft sees the drafts before it
            seen = nmask[None, :] & (offs_n[None, :] < lens[:, None])
        qk = tl.where(seen, _scores(q, k, scale_log2, IEEE, KV_FP8), float("-inf"))
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        m_i, l_i, acc = _softmax_step(qk, _widen(v, q, KV_FP8), m_i, l_i, acc, IEEE)
    if KV_FP8:
        acc = acc * tl.load(KV_SCALE + 1)
    safe_l = tl.where(l_i == 0.0, 1.0, l_i)
    if WIDTH == 1:
        o_rows = b * stride_ob
        p_rows = b * stride_pb
        l_rows = b * stride_lb
    else:
        o_rows = rows[:, None] * stride_ob
        p_rows = rows[:, None] * stride_pb
        l_rows = rows * stride_lb
    if SINGLE:
        out = acc / safe_l[:, None]
        tl.store(O + o_rows + heads[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mmask[:, None])
    else:
        tl.store(OP + p_rows + heads[:, None] * stride_ph + sp * stride_ps + offs_d[None, :],
                 acc / safe_l[:, None], mask=mmask[:, None])
        tl.store(LSE + l_rows + heads * stride_lh + sp, m_i + tl.log2(l_i), mask=mmask)


@triton.jit(do_not_specialize=["num_splits"])
def decode_merge_kernel(
    OP, LSE, O, LENS, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_KEYS: tl.constexpr, MAX_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Combine the partial outputs of one (row, head) over the row's own splits (split 0 always,
    then one per ``_split_len`` keys): weights 2^(lse_s - max lse). Splits past the row's keys were
    neither written nor read (before: all num_splits of the bucket, each written empty)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(LENS + b).to(tl.int32)
    split = _split_len(ctx, SPLIT_KEYS, MAX_SPLITS, BLOCK_N)
    ns = tl.minimum(tl.maximum(1, tl.cdiv(ctx, split)), num_splits)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    smask = offs_s < ns
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)                                   # an empty split 0: lse = -inf -> 0
    w = tl.where(smask, w, 0.0)
    o = tl.load(OP + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                mask=smask[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty))


@triton.jit(do_not_specialize=["stride_ts"])
def paged_prefill_kernel(
    Q, K, V, O, TABLE, QSTART, QLEN, CTX, TSEQ, TM, KV_SCALE,
    scale_log2,
    stride_qt, stride_qh,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ot, stride_oh,
    stride_ts,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seq = tl.load(TSEQ + t)
    m0 = tl.load(TM + t)
    q0 = tl.load(QSTART + seq)
    qlen = tl.load(QLEN + seq)
    ctx = tl.load(CTX + seq)
    cached = ctx - qlen
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(KV_SCALE)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mmask = offs_m < qlen
    rows = (q0 + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=mmask[:, None], other=0.0)
    q, scale_log2 = _mma_query(q, scale_log2, KV_FP8)
    tbl = TABLE + seq.to(tl.int64) * stride_ts
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # keys below `lo` are visible to every row of the tile (key <= cached + m0): no mask
    lo = ((cached + m0 + 1) // BLOCK_N) * BLOCK_N
    hi = cached + tl.minimum(m0 + BLOCK_M, qlen)
    for n0 in range(0, lo, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        blk = tl.load(tbl + offs_n // PAGE)
        slot = blk.to(tl.int64) * PAGE + offs_n % PAGE
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :])
        v = _widen(tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :]), q, KV_FP8)
        m_i, l_i, acc = _lean_step(_raw_scores(q, k, IEEE, KV_FP8), v, m_i, l_i, acc, scale_log2, IEEE)
    # the diagonal tiles: causal mask (key <= cached + row) and the end of the keys
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < ctx
        blk = tl.load(tbl + offs_n // PAGE, mask=nmask, other=0)
        slot = blk.to(tl.int64) * PAGE + offs_n % PAGE
        k = tl.load(K + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        vis = (offs_n[None, :] <= cached + offs_m[:, None]) & nmask[None, :]
        v = tl.load(V + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=nmask[:, None], other=0.0)
        qk = tl.where(vis, _raw_scores(q, k, IEEE, KV_FP8), float("-inf"))
        m_i, l_i, acc = _lean_step(qk, _widen(v, q, KV_FP8), m_i, l_i, acc, scale_log2, IEEE)
    if KV_FP8:
        acc = acc * tl.load(KV_SCALE + 1)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mmask[:, None])
