"""Triton kernels of a layer's attention prologue: the RMS norm (with the residual add) and the QKV
prologue (per-head norm, RoPE, and the KV write into the paged cache), for the paged backend
(:mod:`.triton_backend`).

An FP8 pool (``cache.kv_dtype: fp8_e4m3``; :mod:`.kv_fp8`): the QKV prologue quantizes what it stores:
``e4m3(clamp(x / scale, +-448))``, rounded to nearest even (under the interpreter, ``EXACT`` rounds on the
e4m3 grid first: its own cast is wrong, see :mod:`..quant.fp8_kernels`). These run on CUDA, and on CPU
tensors under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..quant.fp8_kernels import FP8_MAX, _e4m3_grid


@triton.jit
def _to_e4m3(x, scale, EXACT: tl.constexpr):
    """float32 x -> e4m3 ``clamp(x / scale, +-448)`` rounded to nearest even (``EXACT``: on the grid first)."""
    y = tl.math.div_rn(x, tl.zeros_like(x) + scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if EXACT:
        y = _e4m3_grid(y)
    return y.to(tl.float8e4nv)


@triton.jit
def rms_norm_kernel(
    X, RES, W, H_OUT, N_OUT,
    stride_x, stride_r, stride_h, stride_n,
    D, eps,
    HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One row: ``h = x (+ res)`` rounded to the model dtype (stored when HAS_RES), then
    ``rms_norm(h) = (h * rsqrt(mean(h^2) + eps))`` rounded, times the weight."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    m = offs < D
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(RES + row * stride_r + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + row * stride_h + offs, x, mask=m)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    y = (xf * rstd).to(N_OUT.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(N_OUT + row * stride_n + offs, (y * w).to(N_OUT.dtype.element_ty), mask=m)


@triton.jit
def _norm_rope(ptrs, w_ptr, cs_t, offs, hmask, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
               HAS_NORM: tl.constexpr, COS, SIN):
    """A tile of head vectors ``ptrs`` [heads, HEAD_DIM] (rows of ``hmask`` False are padding):
    optional RMS norm with weight, then half-split RoPE over 2 * HALF dims."""
    rot = offs < 2 * HALF
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    x = tl.load(ptrs, mask=hmask[:, None], other=0.0).to(tl.float32)
    p = tl.load(ptrs + (partner - offs)[None, :], mask=hmask[:, None] & rot[None, :], other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = x * rstd * tl.load(w_ptr + offs).to(tl.float32)[None, :]
        p = p * rstd * tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)[None, :]
    j = offs % HALF
    c = tl.load(COS + cs_t + j, mask=rot, other=1.0).to(tl.float32)[None, :]
    s = tl.load(SIN + cs_t + j, mask=rot, other=0.0).to(tl.float32)[None, :]
    lo = (offs < HALF)[None, :]
    return tl.where(lo, x * c - p * s, tl.where(rot[None, :], x * c + p * s, x))


@triton.jit
def qkv_prologue_kernel(
    Q, K, V, QW, KW, COS, SIN, SLOTS, KC, VC, KV_SCALE,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct,
    stride_kcn, stride_kch, stride_vcn, stride_vch,
    H, HK, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, QB: tl.constexpr, KB: tl.constexpr,
    HAS_NORM: tl.constexpr, KV_FP8: tl.constexpr, EXACT: tl.constexpr, KEEP_K: tl.constexpr = False,
):
    """Program (token t, j): j < cdiv(H, QB) rotates the QB query heads of block j in place; the
    programs after it rotate KB key heads each and write them, and their value heads, into the cache
    slot of token t (no [T, Hk, hd] copy); an FP8 pool gets them quantized with the layer's scales
    ``KV_SCALE`` [2]. ``KEEP_K``: the rotated key heads are stored back into K too (unquantized),
    for a prefill that reads the pass's own keys contiguous. A tile of heads a program: one head a
    program left a 4,096-token prefill waiting on ~40 waves of 1-warp programs."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    nqb = tl.cdiv(H, QB)
    offs = tl.arange(0, HEAD_DIM)
    cs_t = t * stride_ct
    if j < nqb:
        heads = j * QB + tl.arange(0, QB)
        hmask = heads < H
        ptrs = Q + t * stride_qt + heads[:, None] * stride_qh + offs[None, :]
        out = _norm_rope(ptrs, QW, cs_t, offs, hmask, eps, HEAD_DIM, HALF, HAS_NORM, COS, SIN)
        tl.store(ptrs, out.to(Q.dtype.element_ty), mask=hmask[:, None])
    else:
        # (names of their own: a value defined in both branches of a runtime `if` must keep one type)
        kh = (j - nqb) * KB + tl.arange(0, KB)
        kmask = kh < HK
        slot = tl.load(SLOTS + t).to(tl.int64)
        k_ptrs = K + t * stride_kt + kh[:, None] * stride_kh + offs[None, :]
        k_row = _norm_rope(k_ptrs, KW, cs_t, offs, kmask, eps, HEAD_DIM, HALF, HAS_NORM, COS, SIN)
        if KEEP_K:
            tl.store(k_ptrs, k_row.to(K.dtype.element_ty), mask=kmask[:, None])
        v_row = tl.load(V + t * stride_vt + kh[:, None] * stride_vh + offs[None, :], mask=kmask[:, None])
        if KV_FP8:
            k_row = _to_e4m3(k_row, tl.load(KV_SCALE), EXACT)
            v_row = _to_e4m3(v_row.to(tl.float32), tl.load(KV_SCALE + 1), EXACT)
        tl.store(KC + slot * stride_kcn + kh[:, None] * stride_kch + offs[None, :], k_row.to(KC.dtype.element_ty),
                 mask=kmask[:, None])
        tl.store(VC + slot * stride_vcn + kh[:, None] * stride_vch + offs[None, :], v_row, mask=kmask[:, None])
