"""Launchers of the blockwise-FP8 Triton kernels (:mod:`.fp8_kernels`): activation quantization,
the FP8 linear layer and the FP8 fused MoE. Formats and torch oracles: :mod:`.fp8`.

No launcher reads a device value on the host: ``fused_experts_fp8`` builds the fused MoE's
expert-aligned layout on the device (:func:`..fused_moe.align_blocks_triton`) and its shapes
depend only on T, k and the weights, so it is captured inside CUDA graphs like
:func:`..fused_moe.fused_experts`. Where activations are quantized (by a launch of their own or
by the GEMM that reads them) is the plan's choice (:mod:`.fp8_plan`); the bytes are the same. Weights must be K-contiguous (``[.., N, K]`` with stride 1 on K,
as loaded) and carry their 128 x 128 block scales.

Shape legend: T = tokens, k = top-k, N = T * k (token, slot) rows, D = hidden, I = expert
intermediate, E = experts, nb(n) = ceil(n / 128).
"""
from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from ..fused_moe import align_blocks_triton, direct_layout, layout_rows, moe_sum
from ..fused_moe.plan import GemmPlan, MoEPlan
from ..model.moe import Routing
from . import fp8_cublas
from .fp8 import BLOCK, FP8, blocks, check_scale, w13_scale_shape
from .fp8_plan import (Fp8MoEPlan, as_fp8_moe_plan, check_fp8_moe_plan, check_fp8_plan, fp8_gemm_plan, fp8_moe_plan,
                       fuses_act_quant)

__all__ = ["fp8_gemm", "fp8_linear", "fused_experts_fp8", "launch_fp8_down", "launch_fp8_gate_up",
           "per_token_group_quant", "select_fp8_linear"]

_QUANT_ROWS = 8
"""Tokens per program of the activation quantization (one 128-column group each)."""
_LINEAR_ON_LOAD_ROWS = 0      # on load measured 3.4-6.6x slower at one row on the H200 (e244292): off
"""``fp8_linear`` quantizes x inside the GEMM (no quantization launch) up to this many rows."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _exact_cast() -> bool:
    """Under the interpreter the kernels round to the e4m3 grid before casting (its float32 ->
    float8 cast is wrong: see :mod:`.fp8_kernels`); on the GPU the cast is native."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _fold_supported() -> bool:
    """Down's k-slot fold reads each row's atomic count in every thread of the row's layout: Triton
    before 3.5 returned a tensor atomic's result only to the thread that issued it (triton-lang/
    triton#7402, fixed by #7460), the others saw 0 and never summed."""
    import triton
    return _exact_cast() or tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 5)


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _require_k_contiguous(name: str, t: Tensor) -> None:
    _require(t.stride(-1) == 1, f"{name}: the last (K) dimension must be contiguous, got strides {t.stride()}")


def per_token_group_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, K] (bf16 / fp16 / fp32) -> (q [T, K] float8_e4m3fn, scale [T, nb(K)] float32): one
    scale per token per 128 columns, ``scale = max(amax / 448, 1e-12)`` (as
    :func:`.fp8.quantize_token_groups`, bit for bit)."""
    from .fp8_kernels import token_group_quant_kernel
    T, K = x.shape
    q = torch.empty(T, K, dtype=FP8, device=x.device)
    s = torch.empty(T, blocks(K), dtype=torch.float32, device=x.device)
    if T and K:
        x = x if x.stride(-1) == 1 else x.contiguous()
        token_group_quant_kernel[(_cdiv(T, _QUANT_ROWS), blocks(K))](
            x, q, s, T, K, x.stride(0), q.stride(0), s.stride(0),
            ROWS=_QUANT_ROWS, GROUP=BLOCK, EXACT=_exact_cast(), num_warps=4)
    return q, s


def fp8_gemm(x_q: Tensor, x_scale: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, plan: GemmPlan | None = None) -> Tensor:
    """Block-FP8 GEMM: x_q [M, K] float8 + x_scale [M, nb(K)], w_q [N, K] float8 + w_scale
    [nb(N), nb(K)] (+ bias [N]) -> y [M, N] in ``out_dtype`` (float32 accumulation)."""
    M, K = x_q.shape
    _require(tuple(x_scale.shape) == (M, blocks(K)), f"fp8_gemm: x_scale {tuple(x_scale.shape)} for x {(M, K)}")
    _require_k_contiguous("x_scale", x_scale)
    return _gemm(x_q, x_scale, w_q, w_scale, bias, out_dtype, plan)


def _gemm(a: Tensor, a_scale: Tensor | None, w_q: Tensor, w_scale: Tensor, bias: Tensor | None,
          out_dtype: torch.dtype, plan: GemmPlan | None) -> Tensor:
    """:func:`fp8_gemm`, or with ``a_scale`` None: a [M, K] float, quantized in the kernel."""
    from .fp8_kernels import fp8_gemm_kernel
    M, K = a.shape
    N = w_q.shape[0]
    _require(w_q.shape[1] == K, f"fp8_gemm: x has K={K}, the weight {tuple(w_q.shape)}")
    check_scale("fp8_gemm weight", w_q.shape, w_scale.shape)
    for name, t in (("x", a), ("w_q", w_q), ("w_scale", w_scale)):
        _require_k_contiguous(name, t)
    out = torch.empty(M, N, dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    g = plan or fp8_gemm_plan(M)
    on_load = a_scale is None
    check_fp8_plan(g, on_load)
    s = a if on_load else a_scale
    fp8_gemm_kernel[(_cdiv(M, g.block_m) * _cdiv(N, g.block_n),)](
        a, s, w_q, w_scale, bias if bias is not None else out, out, M, N, K,
        a.stride(0), 0 if on_load else s.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
        GROUP=BLOCK, ON_LOAD=on_load, EVEN_K=K % g.block_k == 0, EXACT=_exact_cast(), num_warps=g.num_warps,
        num_stages=g.num_stages)
    return out


def fp8_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None,
               plan: GemmPlan | None = None, quant_on_load: bool | None = None, cublas: bool = False) -> Tensor:
    """The FP8 linear layer (:func:`.fp8.fp8_linear_reference` on the GPU): x [..., K] quantized in
    1 x 128 groups, times w_q [N, K] float8 with w_scale [nb(N), nb(K)] (+ bias [N]) -> [..., N]
    in x's dtype. With ``cublas`` (only where :func:`.fp8_cublas.cublas_blockwise_works`) the shapes
    :func:`.fp8_cublas.fits` takes run on cuBLASLt after the quantization launch. Otherwise one
    Triton launch when x is quantized inside the GEMM (``quant_on_load``; by default up to 16 rows,
    with a plan of block_k 128: each N tile re-quantizes the rows it reads), else two (quantize,
    GEMM). The same bytes either way."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if cublas and plan is None and fp8_cublas.fits(x2.shape[0], K, w_q.shape[0], x.dtype):
        y = fp8_cublas.scaled_mm_blockwise(*per_token_group_quant(x2), w_q, w_scale, x.dtype)
        if bias is not None:
            y += bias
        return y.view(*lead, w_q.shape[0])
    g = plan or fp8_gemm_plan(x2.shape[0])
    if quant_on_load is None:
        quant_on_load = x2.shape[0] <= _LINEAR_ON_LOAD_ROWS and g.block_k == BLOCK
    if quant_on_load:
        y = _gemm(x2 if x2.stride(-1) == 1 else x2.contiguous(), None, w_q, w_scale, bias, x.dtype, g)
    else:
        y = fp8_gemm(*per_token_group_quant(x2), w_q, w_scale, bias, x.dtype, g)
    return y.view(*lead, w_q.shape[0])


def select_fp8_linear(device: torch.device):
    """The FP8 linear layer an FP8 model's dense projections call on ``device``: :func:`fp8_linear` on
    cuBLASLt where it probes good (once, here: call it before any graph capture), else on Triton."""
    return functools.partial(fp8_linear, cublas=True) if fp8_cublas.cublas_blockwise_works(device) else fp8_linear


def _moe_launch(kernel, layout: tuple[Tensor, Tensor, Tensor], g: GemmPlan, ncols: int, ptrs: tuple,
                sizes: tuple, strides: tuple, direct: bool = False, **meta) -> None:
    """One expert GEMM over the aligned row blocks (``ncols`` output columns; ``direct``: one block a
    pair, :func:`..fused_moe.direct_layout`): sizes = (pairs, K reduced, NCNT), the kernel's sizes
    with ``P`` and ``ncols`` filled in; K steps unmasked when block_k divides K."""
    P = layout_rows(layout, g.block_m, direct)
    num_pairs, num_k, ncnt = sizes
    kernel[(_cdiv(P, g.block_m) * _cdiv(ncols, g.block_n),)](
        *layout, *ptrs, num_pairs, P, num_k, ncols, ncnt, *strides,
        BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, GROUP=BLOCK,
        EVEN_K=num_k % g.block_k == 0, EXACT=_exact_cast(), DIRECT=direct, num_warps=g.num_warps,
        num_stages=g.num_stages, **meta)


def launch_fp8_gate_up(x: Tensor, x_scale: Tensor | None, w13_q: Tensor, w13_scale: Tensor,
                       layout: tuple[Tensor, Tensor, Tensor], top_k: int, plan: Fp8MoEPlan,
                       counters: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """act = silu(x W_gate^T) * (x W_up^T) for every (token, slot) row: x [T, D] float with
    x_scale None (``plan.quant_x_on_load``: quantized in the kernel), or x_q [T, D] float8 with
    x_scale [T, nb(D)]; w13_q [E, 2I, D] + w13_scale [E, 2 nb(I), nb(D)]. Returns (act [N, I]
    float32, None) when ``plan.quant_act_on_load`` (down quantizes it), else (act_q [N, I] float8,
    act_scale [N, nb(I)]): quantized in the epilogue of a block_n-128 gate_up or by a second
    launch. ``counters`` [T, NCNT] int32 (``plan.fold_sum``): zeroed here for down's fold."""
    from .fp8_kernels import fp8_moe_gate_up_kernel
    g = plan.gate_up
    N, inter = x.shape[0] * top_k, w13_q.shape[1] // 2
    fused = fuses_act_quant(plan)
    act = torch.empty(N, inter, dtype=FP8 if fused else torch.float32, device=x.device)
    act_s = torch.empty(N, blocks(inter), dtype=torch.float32, device=x.device) if fused else act
    xs = x if x_scale is None else x_scale
    cnt = counters if counters is not None else act_s
    ncnt = counters.shape[1] if counters is not None else 0
    strides = (x.stride(0), 0 if x_scale is None else xs.stride(0), w13_q.stride(0), w13_q.stride(1),
               w13_scale.stride(0), w13_scale.stride(1), act.stride(0), act_s.stride(0))
    _moe_launch(fp8_moe_gate_up_kernel, layout, g, inter, (x, xs, w13_q, w13_scale, act, act_s, cnt),
                (N, x.shape[1], ncnt), strides, plan.direct, TOPK=top_k, ON_LOAD=x_scale is None, FUSE_QUANT=fused,
                FOLD=counters is not None, NCNT_PAD=max(1, 1 << max(0, ncnt - 1).bit_length()), SWAP_AB=plan.swap_ab)
    if fused:
        return act, act_s
    return (act, None) if plan.quant_act_on_load else per_token_group_quant(act)


def launch_fp8_down(act: Tensor, act_scale: Tensor | None, w2_q: Tensor, w2_scale: Tensor, rows: Tensor,
                    layout: tuple[Tensor, Tensor, Tensor], topw: Tensor, g: GemmPlan, top_k: int,
                    fold: tuple[Tensor, Tensor] | None = None, swap_ab: bool = False, direct: bool = False) -> None:
    """rows [N, D] = topw[pair] * act[pair] @ (w2_q [E, D, I] + w2_scale [E, nb(D), nb(I)])[e]^T for
    every pair, in rows' dtype: act [N, I] float32 quantized in the kernel (act_scale None), or
    float8 with act_scale [N, nb(I)]; topw [N] the flat top-k weights. ``fold`` = (counters [T,
    NCNT] zeroed by gate_up, out [T, D]): out[token] = the sum of its k rows too (rows float32).
    ``swap_ab``: the weight tile is the MMA's M side (:attr:`.fp8_plan.Fp8MoEPlan.swap_ab`)."""
    from .fp8_kernels import fp8_moe_down_kernel
    cnt, out = fold if fold is not None else (rows, rows)
    ncnt = cnt.shape[1] if fold is not None else 0
    strides = (act.stride(0), 0 if act_scale is None else act_scale.stride(0), w2_q.stride(0), w2_q.stride(1),
               w2_scale.stride(0), w2_scale.stride(1), rows.stride(0), out.stride(0))
    _moe_launch(fp8_moe_down_kernel, layout, g, rows.shape[1],
                (act, act if act_scale is None else act_scale, w2_q, w2_scale, rows, topw, cnt, out),
                (rows.shape[0], act.shape[1], ncnt), strides, direct, TOPK=top_k, ON_LOAD=act_scale is None,
                FOLD=fold is not None, SWAP_AB=swap_ab)


def _check_experts(x: Tensor, w13_q: Tensor, w13_scale: Tensor, w2_q: Tensor, w2_scale: Tensor) -> None:
    """The routed experts' FP8 layout (:mod:`.fp8`) for x [T, D]; a mismatch is a ValueError."""
    E, I2, D = w13_q.shape
    inter = I2 // 2
    _require(D == x.shape[1] and I2 % 2 == 0, f"w13 {tuple(w13_q.shape)} for x {tuple(x.shape)}: want [E, 2I, D]")
    _require(tuple(w2_q.shape) == (E, D, inter), f"w2 {tuple(w2_q.shape)}: want [E, D, I] = {(E, D, inter)}")
    _require(tuple(w13_scale.shape) == w13_scale_shape(E, inter, D),
             f"w13_scale {tuple(w13_scale.shape)}: want {w13_scale_shape(E, inter, D)}")
    check_scale("w2", w2_q.shape, w2_scale.shape)
    for name, t in (("w13_q", w13_q), ("w13_scale", w13_scale), ("w2_q", w2_q), ("w2_scale", w2_scale)):
        _require_k_contiguous(name, t)
    _require(w13_q.dtype == FP8 and w2_q.dtype == FP8, f"expert weights must be {FP8}, got {w13_q.dtype}, {w2_q.dtype}")


def fused_experts_fp8(x: Tensor, routing: Routing, w13_q: Tensor, w13_scale: Tensor, w2_q: Tensor, w2_scale: Tensor,
                      plan: MoEPlan | Fp8MoEPlan | None = None, residual: Tensor | None = None) -> Tensor:
    """Routed experts in blockwise FP8 (:func:`.fp8.experts_fp8_reference` on the GPU): x [T, D],
    w13_q [E, 2I, D] float8 + w13_scale [E, 2 nb(I), nb(D)], w2_q [E, D, I] float8 + w2_scale
    [E, nb(D), nb(I)] -> [T, D] in x's dtype (+ ``residual`` [T, D]: in moe_sum's float32 sum, or added
    after down's fold). ``plan``: :func:`.fp8_plan.fp8_moe_plan` by default;
    a plain MoEPlan is the separate-launch path (:func:`.fp8_plan.as_fp8_moe_plan`).

    Launches: the layout (2; none for a direct plan, a token alone), gate_up, down, and the sum of each
    token's k rows (in slot order: a token's output does not depend on its batch); plus x's quantization unless gate_up quantizes
    on load, act's unless down does or gate_up's epilogue does, minus the sum when down folds it."""
    T, D = x.shape
    k = routing.topk_idx.shape[1]
    _check_experts(x, w13_q, w13_scale, w2_q, w2_scale)
    N = T * k
    if N == 0:
        return torch.zeros_like(x) if residual is None else residual.clone()
    p = fp8_moe_plan(N, w13_q.shape[0], tokens=T) if plan is None else as_fp8_moe_plan(plan)
    check_fp8_moe_plan(p)
    _require(not p.fold_sum or _fold_supported(), "fold_sum needs Triton >= 3.5 (tensor atomics' results broadcast)")
    layout = direct_layout(routing) if p.direct else align_blocks_triton(routing, p.block_m)
    x = x if x.stride(-1) == 1 else x.contiguous()
    xa, xs = (x, None) if p.quant_x_on_load else per_token_group_quant(x)
    counters = torch.empty(T, _cdiv(D, p.down.block_n), dtype=torch.int32, device=x.device) if p.fold_sum else None
    act, act_s = launch_fp8_gate_up(xa, xs, w13_q, w13_scale, layout, k, p, counters)
    # padding rows' pairs run nowhere (routing.padded): their rows are never written; the sum (the
    # fold's, or moe_sum's) skips them
    rows = torch.empty(N, D, dtype=torch.float32 if p.fold_sum else x.dtype, device=x.device)
    topw = routing.topk_weights.reshape(-1).contiguous()
    if p.fold_sum:                   # a padding row's pairs never arrive: its sum is never written
        out = torch.zeros_like(x) if routing.padded else torch.empty_like(x)
        launch_fp8_down(act, act_s, w2_q, w2_scale, rows, layout, topw, p.down, k, (counters, out), p.swap_ab, p.direct)
        return out if residual is None else out.add_(residual)
    launch_fp8_down(act, act_s, w2_q, w2_scale, rows, layout, topw, p.down, k, swap_ab=p.swap_ab, direct=p.direct)
    return moe_sum(rows, T, k, ids=routing.topk_idx if routing.padded else None, residual=residual)   # one rounding
