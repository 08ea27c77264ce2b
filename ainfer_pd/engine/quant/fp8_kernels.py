"""Triton kernels of blockwise FP8 (e4m3): activation quantization, the dense GEMM and the fused
MoE's two expert GEMMs. The torch oracle of each is in :mod:`.fp8`; the launchers are in
:mod:`.fp8_ops`.

Formats (see :mod:`.fp8`): weights ``[.., N, K]`` float8_e4m3fn (K contiguous, Hugging Face's
layout) with one float32 scale per 128 x 128 block; activations ``[T, K]`` float8 with one float32
scale per token per 128 columns (``GROUP``). Every K step of the GEMMs covers at most one scale
column (``GROUP % BLOCK_K == 0``) and is accumulated as ``acc += dot(a, b) * a_s[:, None] *
b_s[None, :]``: the FP8 product of one step is promoted to the float32 accumulator with both
scales applied (on Hopper the fp8 MMA's own accumulation is reduced-precision, so one promotion
per <= 128 K keeps the error at the quantization's). B tiles are loaded ``[BLOCK_K, BLOCK_N]``
through transposed offsets of the ``[N, K]`` weight, so both dot operands are K-major, as
Hopper's FP8 MMA wants. A column tile lies in one weight scale row (``GROUP % BLOCK_N == 0``):
one scalar weight scale per tile and K step. Each step's scales are loaded during the step
before (:func:`_scale_at`).

Swapped operands (``SWAP_AB``, the MoE kernels): each step computes ``dot(W tile [BLOCK_N,
BLOCK_K], A tile^T)``, the transposed product, so the weight's rows are the MMA's M side: a
16-row decode block on sm_90 otherwise takes ``mma.sync`` (no e4m3 there), every weight byte
widened to float16 first; swapped it runs e4m3 ``wgmma`` (m64 per warp group). The epilogue
transposes the accumulator back once. On the H200 (Qwen3-30B-A3B, decode T 16 / 64 / 128) that
took the MoE from 1.46 / 1.38 / 1.43x to 1.41 / 1.35 / 1.40x its weight bytes: the widening was
not the main cost.

Loads carry no column mask (weight columns past N wrap to the start, ``offs_n % N``; their
results are not stored) and no K mask when ``EVEN_K`` (BLOCK_K divides K); A rows past the
block's real rows keep their row mask (a decode block is mostly padding: read, it made the H200's
decode MoE ~20% slower), their pointers clamped to a real row for the scale loads.

Fused MoE layout: the aligned rows of :mod:`..fused_moe` (``SORTED`` pair ids grouped by expert,
``BLOCK_EXPERT``, ``NUM_POST``; pair = token * TOPK + slot). ``fp8_moe_gate_up_kernel`` reads the
token's row in place (through pair // TOPK), accumulates gate and up in one program over ``w13
[E, 2I, D]`` (gate rows [0, I), up rows [I, 2I); scale rows: the gate's nb(I), then the up's) and
writes ``act = silu(g) * u``, either already quantized in 1 x 128 groups (``FUSE_QUANT``: needs
``BLOCK_N == GROUP``, one group per program row) or in float32 (for a separate quantization
launch, or for down to quantize on load). ``fp8_moe_down_kernel`` multiplies act by ``w2 [E, D,
I]`` and scales each row by its top-k weight; with ``FOLD`` it also sums each token's k rows
(:func:`_fold_slots`: the last program to count itself in for a token sums the k rows in slot
order, so the sum is the same whoever runs last; no atomic touches a value).

Quantization on load (``ON_LOAD``, :func:`_a_tile`): the GEMM reads the float A rows (x, or the
float32 act) and quantizes each K step of one whole 128-column group in registers with
:func:`_quant_tile`, the code of ``token_group_quant_kernel``: the same scale and e4m3 bytes
as the separate launch, so the same dot products (the fused MoE's paths are bit-equal).

Division is ``tl.math.div_rn`` (IEEE round to nearest), so scales and bytes equal
:func:`.fp8.quantize_token_groups` run on the CPU. On CUDA, torch's ``tensor / python_float``
multiplies by the float32 reciprocal (ATen's div_true_kernel_cuda does so for a CPU-scalar
divisor), so the oracle's ``amax / 448`` is ``amax * fl(1/448)``: one ulp off the quotient for
about half of all amaxes. With that scale x / scale crosses an e4m3 rounding midpoint for a few
values per million with float32 input, and ~2.5e-4 of the values with bf16 input (8-bit
mantissas often land exactly on a midpoint, where one ulp decides). That is the H200's 15,401
scale and 1,057 byte mismatches of 4M bf16 values (2 of 4M float32): emulated on the CPU it gives
15,499 / 987 (4 of 4M float32), every one 1 ulp / 1 e4m3 step. The amax (bf16 -> float32 is
exact) and the hardware cast (``cvt.rn.satfinite``, subnormals included) are not the cause:
``benchmarks/fp8_kernel_check.py``'s ``act_quant`` figure also compares against the oracle with
an IEEE division, where it expects no mismatch.

Under ``TRITON_INTERPRET=1`` (Triton 3.9 on CPU):
* FP8 ``tl.dot`` runs natively (the interpreter widens both operands to float16, exactly, and
  multiplies in float32), so the kernels run unchanged; no bf16 upcast is needed (and bf16
  ``tl.dot`` is itself wrong under this interpreter: it returns garbage of order 1e10).
* The float32 -> float8e4nv cast is wrong: the interpreter rounds by adding the first dropped
  bit to the 3-bit mantissa without carrying into the exponent (127.94 -> 64, not 128) and
  without ties-to-even. The constexpr ``EXACT`` (set by the launchers only when interpreting)
  first rounds to the e4m3 grid in float32 arithmetic (:func:`_e4m3_grid`), so the cast that
  follows is exact. On the GPU ``EXACT`` is False and the cast is the native round-to-nearest-
  even conversion.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..fused_moe.kernels import _expert_block, _tile_ids

FP8_MAX = tl.constexpr(448.0)
TINY = tl.constexpr(1e-12)


@triton.jit
def _e4m3_grid(v):
    """float32 v (|v| <= 448) rounded to nearest even on the e4m3 grid, still float32: 3 mantissa
    bits at or above 2^-6 (integer rounding of the float32 bits; a carry moves into the exponent),
    multiples of 2^-9 below (subnormals: float32 addition of 2^14 rounds there); v's sign bit kept
    (-0.0 stays -0.0)."""
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    sub = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, sub, normal).to(tl.int32, bitcast=True)
    sign = v.to(tl.int32, bitcast=True) & -0x80000000
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quant_tile(v, EXACT: tl.constexpr):
    """v [R, G] float32 (zeros where masked) -> (q [R, G] float8e4nv, scale [R] float32), one
    group per row: scale = max(amax / 448, 1e-12), q = clamp(v / scale, +-448) rounded to e4m3."""
    amax = tl.max(tl.abs(v), axis=1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX), TINY)
    q = tl.math.div_rn(v, tl.zeros_like(v) + scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    if EXACT:
        q = _e4m3_grid(q)
    return q.to(tl.float8e4nv), scale


@triton.jit(do_not_specialize=["T"])
def token_group_quant_kernel(X, Q, S, T, K, stride_x, stride_q, stride_s,
                             ROWS: tl.constexpr, GROUP: tl.constexpr, EXACT: tl.constexpr):
    """ROWS tokens x one group of GROUP columns: x [T, K] -> q [T, K] float8, s [T, nb(K)] float32."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    rmask = rows < T
    m = rmask[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)
    v = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    q, s = _quant_tile(v, EXACT)
    tl.store(Q + r64[:, None] * stride_q + cols[None, :], q, mask=m)
    tl.store(S + r64 * stride_s + g, s, mask=rmask)


@triton.jit
def _a_tile(a_rows, rmask, sa, k0, K, ON_LOAD: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            EXACT: tl.constexpr):
    """One K step's A operand and its per-row scale: (a [BLOCK_M, BLOCK_K] float8, s [BLOCK_M]).
    ``a_rows`` [BLOCK_M] point at in-bounds rows (the callers point masked rows at a real one, so
    the scale loads need no mask); the rows past ``rmask`` are not read (a decode block is mostly
    padding: read, its rows added a quarter to the weights' traffic and slowed decode on the
    H200), K is masked unless ``EVEN_K``. ON_LOAD: float rows, quantized here (``BLOCK_K ==
    GROUP``: the step is one whole group; zeros past K, as the oracle's padding); else float8
    rows whose scale ``sa`` the caller loaded (:func:`_scale_at`)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        a = tl.load(a_rows[:, None] + kk[None, :], mask=rmask[:, None], other=0.0)
    else:
        a = tl.load(a_rows[:, None] + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :], other=0.0)
    if ON_LOAD:
        q, s = _quant_tile(a.to(tl.float32), EXACT)
    else:
        q = a
        s = sa
    return q, s


@triton.jit
def _scale_at(cols, k0, K, GROUP: tl.constexpr):
    """The scales of K step ``k0`` (clamped into K: the loops load step k + 1's scales during step
    k, so no synchronous load waits between their MMAs; the one past the end is a spare read)."""
    return tl.load(cols + tl.minimum(k0, K - 1) // GROUP)


@triton.jit
def _b_offsets(b_rows, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """The weight tile's element offsets (int32, from the expert's first element) at K step 0:
    [BLOCK_N, BLOCK_K] with SWAP_AB, else [BLOCK_K, BLOCK_N]; ``b_rows`` [BLOCK_N] are the rows'
    offsets. Loop-invariant int32 offsets hold fewer registers than a tile of 64-bit pointers."""
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP_AB:
        offs = b_rows[:, None] + offs_k[None, :]
    else:
        offs = b_rows[None, :] + offs_k[:, None]
    return offs


@triton.jit
def _b_tile(b_base, b_offs, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """One K step of the weight (``b_base + k0 + b_offs``, K contiguous): the rows are in bounds
    (wrapped by the callers: no N mask), K is masked unless EVEN_K."""
    ptrs = b_base + k0 + b_offs
    if EVEN_K:
        b = tl.load(ptrs)
    else:
        kmask = k0 + tl.arange(0, BLOCK_K) < K
        if SWAP_AB:
            b = tl.load(ptrs, mask=kmask[None, :], other=0.0)
        else:
            b = tl.load(ptrs, mask=kmask[:, None], other=0.0)
    return b


@triton.jit
def _mma(a, b, SWAP_AB: tl.constexpr):
    """dot(a, b) [BLOCK_M, BLOCK_N], or with SWAP_AB its transpose dot(b, a^T) [BLOCK_N, BLOCK_M]
    (b [BLOCK_N, BLOCK_K]): the weight is the MMA's M side (wgmma's m64), the few token rows its
    N side, both operands K-major."""
    if SWAP_AB:
        p = tl.dot(b, tl.trans(a))
    else:
        p = tl.dot(a, b)
    return p


@triton.jit
def _scaled(p, sa, sb, SWAP_AB: tl.constexpr):
    """One K step's product (:func:`_mma`) with the token rows' scales ``sa`` [BLOCK_M] and the
    weight tile's one scale ``sb`` (a scalar: the tile lies in one 128-row scale block)."""
    s = sa * sb                       # the rows' scales first: one multiply a row, not one an element
    if SWAP_AB:
        r = p * s[None, :]
    else:
        r = p * s[:, None]
    return r


@triton.jit
def _acc_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return acc


@triton.jit
def _scaled_dot(a_rows, as_rows, rmask, b_base, b_rows, bs_row, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                ON_LOAD: tl.constexpr, EXACT: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] float32 = sum over k of (a[m, k] a_s[m, k // GROUP]) (b[n, k] b_s[n, k // GROUP]);
    with SWAP_AB its transpose [BLOCK_N, BLOCK_M] (:func:`_scaled_mma`).

    a_rows [BLOCK_M]: pointers to the rows' first K element (K contiguous); b_base + b_rows
    [BLOCK_N] (int32 offsets): the weight rows' first element, every row in bounds; as_rows: the
    rows' first scale, bs_row: the weight tile's (scale columns contiguous; one scale row for the
    tile, whose block_n divides GROUP: a scalar per K step, not a vector held per thread). ON_LOAD: A is float,
    quantized per K step (:func:`_a_tile`)."""
    b_offs = _b_offsets(b_rows, BLOCK_K, SWAP_AB)
    acc = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    sa, sb = _scale_at(as_rows, 0, K, GROUP), _scale_at(bs_row, 0, K, GROUP)
    for k0 in range(0, K, BLOCK_K):
        a, sa = _a_tile(a_rows, rmask, sa, k0, K, ON_LOAD, BLOCK_K, EVEN_K, EXACT)
        p = _mma(a, _b_tile(b_base, b_offs, k0, K, BLOCK_K, EVEN_K, SWAP_AB), SWAP_AB)
        sa_next, sb_next = _scale_at(as_rows, k0 + BLOCK_K, K, GROUP), _scale_at(bs_row, k0 + BLOCK_K, K, GROUP)
        acc += _scaled(p, sa, sb, SWAP_AB)
        sa, sb = sa_next, sb_next
    return acc


@triton.jit
def _scaled_dot_pair(a_rows, as_rows, rmask, b_base, g_rows, gs_row, u_off, us_off, K,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                     ON_LOAD: tl.constexpr, EXACT: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr):
    """:func:`_scaled_dot` against two weights sharing each A tile, the gate's (rows ``g_rows``,
    scale row ``gs_row``) and the up's (``u_off`` / ``us_off`` elements further): (acc_g, acc_u).
    Both MMAs are issued before either product is scaled."""
    g_offs = _b_offsets(g_rows, BLOCK_K, SWAP_AB)
    acc_g = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    us_row = gs_row + us_off
    sa, sg, su = _scale_at(as_rows, 0, K, GROUP), _scale_at(gs_row, 0, K, GROUP), _scale_at(us_row, 0, K, GROUP)
    for k0 in range(0, K, BLOCK_K):
        a, sa = _a_tile(a_rows, rmask, sa, k0, K, ON_LOAD, BLOCK_K, EVEN_K, EXACT)
        pg = _mma(a, _b_tile(b_base, g_offs, k0, K, BLOCK_K, EVEN_K, SWAP_AB), SWAP_AB)
        pu = _mma(a, _b_tile(b_base + u_off, g_offs, k0, K, BLOCK_K, EVEN_K, SWAP_AB), SWAP_AB)
        nk = k0 + BLOCK_K
        sa_next, sg_next, su_next = _scale_at(as_rows, nk, K, GROUP), _scale_at(gs_row, nk, K, GROUP), \
            _scale_at(us_row, nk, K, GROUP)
        acc_g += _scaled(pg, sa, sg, SWAP_AB)
        acc_u += _scaled(pu, sa, su, SWAP_AB)
        sa, sg, su = sa_next, sg_next, su_next
    return acc_g, acc_u


@triton.jit(do_not_specialize=["M"])
def fp8_gemm_kernel(A, AS, B, BS, BIAS, C, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, GROUP: tl.constexpr, ON_LOAD: tl.constexpr, EVEN_K: tl.constexpr,
                    EXACT: tl.constexpr):
    """C [M, N] = (A [M, K] * AS [M, nb(K)]) @ (B [N, K] * BS [nb(N), nb(K)])^T (+ BIAS [N]), in C's
    dtype; ON_LOAD: A is float [M, K], quantized per 128-column K step (AS unused). The tile's rows
    and columns past M / N read rows / columns wrapped into range (not stored)."""
    pid_m, pid_n = _tile_ids(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mmask = offs_m < M
    nmask = offs_n < N
    rows, cols = offs_m % M, (offs_n % N).to(tl.int32)
    acc = _scaled_dot(A + rows * stride_am, AS + rows * stride_asm, mmask, B, cols * stride_bn,
                      BS + (pid_n * BLOCK_N // GROUP) * stride_bsn, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, ON_LOAD, EXACT,
                      False, EVEN_K)
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(C + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(C.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _store_act(act, ACT, ACTS, prow, rmask, offs_n, nmask, stride_an, stride_asn,
               FUSE_QUANT: tl.constexpr, GROUP: tl.constexpr, EXACT: tl.constexpr):
    """act [BLOCK_M, BLOCK_N] float32 -> ACT rows ``prow``: quantized (one 1 x GROUP group per row,
    BLOCK_N == GROUP, its scale into ACTS [N, nb(I)]) when FUSE_QUANT, else as is (ACT float32)."""
    mask = rmask[:, None] & nmask[None, :]
    ptr = ACT + prow[:, None] * stride_an + offs_n[None, :]
    if FUSE_QUANT:
        q, s = _quant_tile(tl.where(mask, act, 0.0), EXACT)
        tl.store(ptr, q, mask=mask)
        tl.store(ACTS + prow * stride_asn + tl.min(offs_n, axis=0) // GROUP, s, mask=rmask)
    else:
        tl.store(ptr, act.to(ACT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_pairs", "P"])
def fp8_moe_gate_up_kernel(
    SORTED, BLOCK_EXPERT, NUM_POST, X, XS, W, WS, ACT, ACTS, CNT,
    num_pairs, P, K, I, NCNT,
    stride_xt, stride_xst, stride_we, stride_wn, stride_wse, stride_wsn, stride_an, stride_asn,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, GROUP: tl.constexpr, ON_LOAD: tl.constexpr, FUSE_QUANT: tl.constexpr,
    FOLD: tl.constexpr, NCNT_PAD: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, EXACT: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """ACT[pair, n] = silu(g) * u, g / u = x_q[tok] . W[e, n] / W[e, I + n] (block scales applied);
    ON_LOAD: X is the float x, quantized here (XS unused). FOLD: the first column tile's programs
    zero the NCNT fold counters of their tokens (CNT [T, NCNT], for :func:`_fold_slots`). SWAP_AB:
    the products are computed transposed (:func:`_scaled_mma`). Padding rows read token 0's row
    and columns past I wrap to the start (no masked loads; neither is stored)."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, I,
                                                           BLOCK_M, BLOCK_N, GROUP_M, DIRECT)
    if not active:
        return
    tok = (tl.where(rmask, pairs, 0) // TOPK).to(tl.int64)
    if FOLD:
        if tl.min(offs_n, axis=0) == 0:
            c = tl.arange(0, NCNT_PAD)
            tl.store(CNT + tok[:, None] * NCNT + c[None, :], tl.zeros([BLOCK_M, NCNT_PAD], tl.int32),
                     mask=rmask[:, None] & (c < NCNT)[None, :])
    n64 = offs_n.to(tl.int64)
    cols = offs_n % I
    acc_g, acc_u = _scaled_dot_pair(X + tok * stride_xt, XS + tok * stride_xst, rmask, W + e * stride_we,
                                    cols * stride_wn,
                                    WS + e * stride_wse + (tl.min(offs_n, axis=0) // GROUP) * stride_wsn, I * stride_wn,
                                    tl.cdiv(I, GROUP) * stride_wsn, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP, ON_LOAD,
                                    EXACT, SWAP_AB, EVEN_K)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    if SWAP_AB:
        act = tl.trans(act)
    _store_act(act, ACT, ACTS, pairs.to(tl.int64), rmask, n64, nmask, stride_an, stride_asn, FUSE_QUANT, GROUP, EXACT)


@triton.jit
def _fold_slots(ROWS, CNT, OUT, pairs, rmask, offs_n, nmask, NCNT, stride_rn, stride_ot,
                TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Called after this program stored its rows' tile: each row whose token's other k - 1 rows
    of this column tile are stored already (its program is the last of the token's k to count
    itself in CNT [T, NCNT]) writes OUT[token] = the token's k rows summed in slot order, float32.
    Which program sums depends on run order; the sum does not (no atomic touches a value).

    Memory order: the barrier puts every thread's row stores before the count's release (the
    count is a gpu-scope acq_rel atomic, one thread a row); the rows of other programs are read
    after its acquire, around L1 (``.cg``: an SM's L1 is not coherent with the other SMs')."""
    tl.debug_barrier()
    tok = (pairs // TOPK).to(tl.int64)
    tile = tl.min(offs_n, axis=0) // BLOCK_N
    seen = tl.atomic_add(CNT + tok * NCNT + tile, 1, mask=rmask, sem="acq_rel", scope="gpu")
    last = rmask & (seen == TOPK - 1)
    m = last[:, None] & nmask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j in tl.static_range(TOPK):
        ptr = ROWS + (tok * TOPK + j)[:, None] * stride_rn + offs_n[None, :]
        acc += tl.load(ptr, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(OUT + tok[:, None] * stride_ot + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["num_pairs", "P"])
def fp8_moe_down_kernel(
    SORTED, BLOCK_EXPERT, NUM_POST, A, AS, W, WS, ROWS, TOPW, CNT, OUT,
    num_pairs, P, K, N, NCNT,
    stride_an, stride_asn, stride_we, stride_wn, stride_wse, stride_wsn, stride_rn, stride_ot,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, GROUP: tl.constexpr, ON_LOAD: tl.constexpr, FOLD: tl.constexpr, SWAP_AB: tl.constexpr,
    EVEN_K: tl.constexpr, EXACT: tl.constexpr, DIRECT: tl.constexpr,
):
    """ROWS[pair, n] = topw[pair] * act_q[pair] . W[e, n] (block scales applied), in ROWS' dtype;
    ON_LOAD: A is the float32 act, quantized here (AS unused). FOLD: OUT[token] = the sum of its
    k rows too (:func:`_fold_slots`). SWAP_AB, padding rows, columns past N: as gate_up."""
    active, e, pairs, rmask, offs_n, nmask = _expert_block(SORTED, BLOCK_EXPERT, NUM_POST, num_pairs, P, N,
                                                           BLOCK_M, BLOCK_N, GROUP_M, DIRECT)
    if not active:
        return
    prow = pairs.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    arow = tl.where(rmask, pairs, 0).to(tl.int64)
    cols = offs_n % N
    acc = _scaled_dot(A + arow * stride_an, AS + arow * stride_asn, rmask, W + e * stride_we, cols * stride_wn,
                      WS + e * stride_wse + (tl.min(offs_n, axis=0) // GROUP) * stride_wsn, K, BLOCK_M, BLOCK_N,
                      BLOCK_K, GROUP, ON_LOAD, EXACT, SWAP_AB, EVEN_K)
    if SWAP_AB:
        acc = tl.trans(acc)
    w = tl.load(TOPW + prow, mask=rmask, other=0.0).to(tl.float32)
    tl.store(ROWS + prow[:, None] * stride_rn + n64[None, :], (acc * w[:, None]).to(ROWS.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])
    if FOLD:
        _fold_slots(ROWS, CNT, OUT, pairs, rmask, n64, nmask, NCNT, stride_rn, stride_ot, TOPK, BLOCK_M, BLOCK_N)
