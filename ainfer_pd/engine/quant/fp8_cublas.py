"""Blockwise-FP8 GEMMs through cuBLASLt: torch's ``F.scaled_mm`` with 1 x 128 activation groups and
128 x 128 weight blocks, the checkpoints' format (DeepSeek-V3's), on Hopper.

Why: the engine's Triton FP8 GEMM (:func:`.fp8_ops.fp8_gemm`) loses to cuBLASLt at every measured size
(H100, torch 2.11, f20a8d9, ``benchmarks/fp8_dense_sweep.py``; the activation quantization included):
the Qwen3 shape's QKV (2048 -> 5120) 0.0183 / 0.0537 / 0.0938 ms at 64 / 2,048 / 4,096 rows against
0.0196 / 0.0750 / 0.1430, O (4096 -> 2048) 0.0236 / 0.0487 / 0.0866 against 0.0268 / 0.0624 / 0.1120.
From 2,048 rows it also beats bf16 cuBLAS on QKV (0.0615 / 0.1204 ms). Below 64 rows nothing was
measured, so the Triton plans keep those.

cuBLASLt reads the activation scales outer-major (the token dimension contiguous) and the weight
scales as [nb(K), nb(N)]; both GEMM dimensions must be whole 128-blocks. Whether this torch reaches
the kernel on this device is probed once, eagerly (:func:`cublas_blockwise_works`: never inside a
graph capture), against the torch oracle; where it does not, the Triton GEMM runs.
"""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from ..tma import has_tma
from .fp8 import BLOCK, dequantize_blockwise, dequantize_token_groups, quantize_blockwise, quantize_token_groups

log = logging.getLogger(__name__)

CUBLAS_MIN_ROWS = 64
"""The fewest rows the cuBLASLt GEMM takes (the smallest measured; below it the Triton plans)."""
_OUT_DTYPES = (torch.bfloat16, torch.float16)


def fits(rows: int, k: int, n: int, out_dtype: torch.dtype) -> bool:
    """Whether a [rows, k] x [n, k]^T blockwise GEMM goes to cuBLASLt (the shape rules above)."""
    return rows >= CUBLAS_MIN_ROWS and k % BLOCK == 0 and n % BLOCK == 0 and out_dtype in _OUT_DTYPES


def scaled_mm_blockwise(xq: Tensor, xs: Tensor, w_q: Tensor, w_scale: Tensor, out_dtype: torch.dtype) -> Tensor:
    """(xq [M, K] e4m3 * xs [M, nb(K)]) (w_q [N, K] e4m3 * w_scale [nb(N), nb(K)])^T -> [M, N] out_dtype."""
    sa = xs.t().contiguous().t()
    st = F.ScalingType
    return F.scaled_mm(xq, w_q.t(), sa, st.BlockWise1x128, w_scale.t(), st.BlockWise128x128,
                       output_dtype=out_dtype)


def _supported(device: torch.device) -> str | None:
    """Why this torch and device cannot take the blockwise GEMM, or None."""
    if not has_tma(device):                   # Hopper or newer: the one home of that test
        return f"device {device} is not a CUDA device of compute capability 9.0 or newer"
    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no F.scaled_mm"
    return None


@functools.cache
def cublas_blockwise_works(device: torch.device) -> bool:
    """Whether :func:`scaled_mm_blockwise` runs on ``device`` and matches the dequantized oracle (one
    256 x 512 x 256 GEMM, once per device; never call it inside a graph capture)."""
    why = _supported(device)
    if why is None:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(CUBLAS_MIN_ROWS * 4, 512, device=device, generator=g)
            w_q, w_s = quantize_blockwise(torch.randn(256, 512, device=device, generator=g) / 512 ** 0.5)
            xq, xs = quantize_token_groups(x.to(torch.bfloat16))
            y = scaled_mm_blockwise(xq, xs, w_q, w_s, torch.bfloat16).float()
            ref = dequantize_token_groups(xq, xs) @ dequantize_blockwise(w_q, w_s).t()
            gap = float((y - ref).abs().max()) / max(float(ref.abs().max()), 1e-6)
            why = None if gap <= 1e-2 else f"off the oracle by {gap:.2e} of its largest value"
        except (RuntimeError, ValueError, TypeError) as exc:
            why = f"{type(exc).__name__}: {str(exc)[:200]}"
    if why is not None:
        log.info("FP8 dense GEMMs on the Triton kernel: cuBLASLt blockwise FP8 not usable (%s)", why)
    return why is None
