"""Launchers of the blockwise-FP8 Triton kernels (:mod:`.fp8_kernels`): activation quantization,
the FP8 linear layer and the FP8 fused MoE. Formats and torch oracles: :mod:`.fp8`.

No launcher reads a device value on the host: ``fused_experts_fp8`` builds the fused MoE's
expert-aligned layout on the device (:func:`..fused_moe.align_blocks_triton`) and its shapes
depend only on T, k and the weights, so it is captured inside CUDA graphs like
:func:`..fused_moe.fused_experts`. Weights must be K-contiguous (``[.., N, K]`` with stride 1 on K,
as loaded) and carry their 128 x 128 block scales.

Shape legend: T = tokens, k = top-k, N = T * k (token, slot) rows, D = hidden, I = expert
intermediate, E = experts, nb(n) = ceil(n / 128).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ..fused_moe import align_blocks_triton
from ..fused_moe.plan import GemmPlan, MoEPlan
from ..model.moe import Routing
from .fp8 import BLOCK, FP8, blocks, check_scale, w13_scale_shape
from .fp8_plan import check_fp8_plan, fp8_gemm_plan, fp8_moe_plan, fuses_act_quant

__all__ = ["fp8_gemm", "fp8_linear", "fused_experts_fp8", "launch_fp8_down", "launch_fp8_gate_up",
           "per_token_group_quant"]

_QUANT_ROWS = 8
"""Tokens per program of the activation quantization (one 128-column group each)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _exact_cast() -> bool:
    """Under the interpreter the kernels round to the e4m3 grid before casting (its float32 ->
    float8 cast is wrong: see :mod:`.fp8_kernels`); on the GPU the cast is native."""
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    from .fp8_kernels import fp8_gemm_kernel
    M, K = x_q.shape
    N = w_q.shape[0]
    _require(w_q.shape[1] == K, f"fp8_gemm: x has K={K}, the weight {tuple(w_q.shape)}")
    _require(tuple(x_scale.shape) == (M, blocks(K)), f"fp8_gemm: x_scale {tuple(x_scale.shape)} for x {(M, K)}")
    check_scale("fp8_gemm weight", w_q.shape, w_scale.shape)
    for name, t in (("x_q", x_q), ("x_scale", x_scale), ("w_q", w_q), ("w_scale", w_scale)):
        _require_k_contiguous(name, t)
    out = torch.empty(M, N, dtype=out_dtype, device=x_q.device)
    if M == 0 or N == 0:
        return out
    g = plan or fp8_gemm_plan(M)
    check_fp8_plan(g)
    fp8_gemm_kernel[(_cdiv(M, g.block_m) * _cdiv(N, g.block_n),)](
        x_q, x_scale, w_q, w_scale, bias if bias is not None else out, out, M, N, K,
        x_q.stride(0), x_scale.stride(0), w_q.stride(0), w_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m,
        GROUP=BLOCK, num_warps=g.num_warps, num_stages=g.num_stages)
    return out


def fp8_linear(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None,
               plan: GemmPlan | None = None) -> Tensor:
    """The FP8 linear layer (:func:`.fp8.fp8_linear_reference` on the GPU): x [..., K] quantized in
    1 x 128 groups, times w_q [N, K] float8 with w_scale [nb(N), nb(K)] (+ bias [N]) -> [..., N]
    in x's dtype. Two launches (quantize, GEMM)."""
    lead, K = x.shape[:-1], x.shape[-1]
    xq, xs = per_token_group_quant(x.reshape(-1, K))
    return fp8_gemm(xq, xs, w_q, w_scale, bias, x.dtype, plan).view(*lead, w_q.shape[0])


def _moe_launch(kernel, layout: tuple[Tensor, Tensor, Tensor], g: GemmPlan, ncols: int, ptrs: tuple,
                num_pairs: int, num_k: int, strides: tuple, **meta) -> None:
    """One expert GEMM over the aligned row blocks (``ncols`` output columns, ``num_k`` reduced)."""
    sorted_ids = layout[0]
    P = sorted_ids.numel()
    check_fp8_plan(g)
    kernel[(_cdiv(P, g.block_m) * _cdiv(ncols, g.block_n),)](
        *layout, *ptrs, num_pairs, P, num_k, ncols, *strides,
        BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, GROUP_M=g.group_m, GROUP=BLOCK,
        num_warps=g.num_warps, num_stages=g.num_stages, **meta)


def launch_fp8_gate_up(x_q: Tensor, x_scale: Tensor, w13_q: Tensor, w13_scale: Tensor,
                       layout: tuple[Tensor, Tensor, Tensor], top_k: int, g: GemmPlan) -> tuple[Tensor, Tensor]:
    """act = silu(x W_gate^T) * (x W_up^T) for every (token, slot) row, quantized in 1 x 128 groups:
    x_q [T, D] + x_scale [T, nb(D)], w13_q [E, 2I, D] + w13_scale [E, 2 nb(I), nb(D)] ->
    (act_q [N, I] float8, act_scale [N, nb(I)] float32). A plan of block_n 128 quantizes in the
    kernel; any other writes float32 act and quantizes it in a second launch."""
    from .fp8_kernels import fp8_moe_gate_up_kernel
    N, inter = x_q.shape[0] * top_k, w13_q.shape[1] // 2
    fused = fuses_act_quant(g)
    act = torch.empty(N, inter, dtype=FP8 if fused else torch.float32, device=x_q.device)
    act_s = torch.empty(N, blocks(inter), dtype=torch.float32, device=x_q.device) if fused else act
    strides = (x_q.stride(0), x_scale.stride(0), w13_q.stride(0), w13_q.stride(1), w13_scale.stride(0),
               w13_scale.stride(1), act.stride(0), act_s.stride(0))
    _moe_launch(fp8_moe_gate_up_kernel, layout, g, inter, (x_q, x_scale, w13_q, w13_scale, act, act_s),
                N, x_q.shape[1], strides, TOPK=top_k, FUSE_QUANT=fused, EXACT=_exact_cast())
    return (act, act_s) if fused else per_token_group_quant(act)


def launch_fp8_down(act_q: Tensor, act_scale: Tensor, w2_q: Tensor, w2_scale: Tensor, rows: Tensor,
                    layout: tuple[Tensor, Tensor, Tensor], topw: Tensor, g: GemmPlan) -> None:
    """rows [N, D] = topw[pair] * (act_q [N, I] + act_scale [N, nb(I)]) @ (w2_q [E, D, I] + w2_scale
    [E, nb(D), nb(I)])[e]^T for every pair, in rows' dtype; topw [N] the flat top-k weights."""
    from .fp8_kernels import fp8_moe_down_kernel
    strides = (act_q.stride(0), act_scale.stride(0), w2_q.stride(0), w2_q.stride(1), w2_scale.stride(0),
               w2_scale.stride(1), rows.stride(0))
    _moe_launch(fp8_moe_down_kernel, layout, g, rows.shape[1], (act_q, act_scale, w2_q, w2_scale, rows, topw),
                rows.shape[0], act_q.shape[1], strides)


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
                      plan: MoEPlan | None = None) -> Tensor:
    """Routed experts in blockwise FP8 (:func:`.fp8.experts_fp8_reference` on the GPU): x [T, D],
    w13_q [E, 2I, D] float8 + w13_scale [E, 2 nb(I), nb(D)], w2_q [E, D, I] float8 + w2_scale
    [E, nb(D), nb(I)] -> [T, D] in x's dtype. Launches: the layout (2), x's quantization, gate_up,
    act's quantization (unless the gate_up plan does it in its epilogue), down, and the sum of each
    token's k rows (in slot order: a token's output does not depend on its batch)."""
    T, D = x.shape
    k = routing.topk_idx.shape[1]
    E = w13_q.shape[0]
    _check_experts(x, w13_q, w13_scale, w2_q, w2_scale)
    N = T * k
    if N == 0:
        return torch.zeros_like(x)
    plan = plan or fp8_moe_plan(N, E)
    _require(plan.gate_up.block_m == plan.down.block_m, "both GEMMs walk the same aligned blocks")
    layout = align_blocks_triton(routing, plan.block_m)
    x_q, x_s = per_token_group_quant(x)
    act_q, act_s = launch_fp8_gate_up(x_q, x_s, w13_q, w13_scale, layout, k, plan.gate_up)
    rows = torch.empty(N, D, dtype=x.dtype, device=x.device)
    launch_fp8_down(act_q, act_s, w2_q, w2_scale, rows, layout, routing.topk_weights.reshape(-1).contiguous(), plan.down)
    return rows.view(T, k, D).sum(dim=1)          # float32 accumulation, one rounding
