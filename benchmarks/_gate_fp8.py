"""The GPU gate's FP8 part (issue 37): the blockwise-FP8 kernels against their torch oracle, and
the FP8 decode targets read from the gate's ``qwen3fp8`` model figures.

Checks: per-token-group quantization byte-equal on float32 input (the e4m3 cast and the IEEE
division), the fused MoE (decode sizes and a prefill size) and the dense GEMM within 2e-2 of
:func:`~ainfer_pd.engine.quant.fp8.experts_fp8_reference` / ``fp8_linear_reference`` (the oracle's
own distance to bf16 is reported beside), and the fused MoE replayed in a CUDA graph equal to eager.
"""
from __future__ import annotations

import torch

from _gate_cases import e4m3_steps, rel_err
from ainfer_pd.engine.model.moe import route
from ainfer_pd.engine.runtime.cuda_graphs import CAPTURE_MODE
from ainfer_pd.engine.quant.fp8 import (experts_fp8_reference, fp8_linear_reference, quantize_blockwise,
                                        quantize_token_groups, quantize_w13)
from ainfer_pd.engine.quant.fp8_cublas import CUBLAS_MIN_ROWS, cublas_blockwise_works
from ainfer_pd.engine.quant.fp8_ops import fp8_linear, fused_experts_fp8, per_token_group_quant

E, D, I, K = 128, 2048, 768, 8          # the Qwen3-30B-A3B expert shape
TOL = 2e-2


def _experts(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    gate, up = (torch.randn(E, I, D, device=dev, generator=g) * D ** -0.5 for _ in range(2))
    w13, s13 = quantize_w13(gate, up)
    w2, s2 = quantize_blockwise(torch.randn(E, D, I, device=dev, generator=g) * I ** -0.5)
    router = torch.randn(E, D, device=dev, generator=g).to(torch.bfloat16)
    return w13, s13, w2, s2, router, g


def fp8_kernel_checks(check, dev) -> None:
    x = torch.randn(4096, 1000, device=dev) * torch.logspace(-3, 3, 1000, device=dev)
    q, s = per_token_group_quant(x)
    qr, sr = quantize_token_groups(x)
    steps = e4m3_steps(q, qr)
    n_diff = int((steps > 0).sum())
    check("fp8_act_quant_matches_oracle_fp32", torch.equal(s, sr) and int(steps.max()) <= 1 and n_diff <= q.numel() * 1e-5,
          f"scales equal: {torch.equal(s, sr)}; {n_diff} of {q.numel()} e4m3 values differ, by at most "
          f"{int(steps.max())} step (the hardware cast against torch's; bound: 1 step, 1e-5 of the values)")
    w13, s13, w2, s2, router, g = _experts(dev)
    for T in (1, 64, 2048):
        xb = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        r = route(xb, router, K)
        out = fused_experts_fp8(xb, r, w13, s13, w2, s2)
        ref = torch.cat([experts_fp8_reference(xb[i:i + 64].float(), r.topk_idx[i:i + 64], r.topk_weights[i:i + 64],
                                               w13, s13, w2, s2) for i in range(0, T, 64)])   # chunks: the oracle gathers [N, I, D]
        e = rel_err(out, ref)
        check(f"fp8_moe_T{T}", e <= TOL, f"rel err {e:.2e} against the FP8 oracle (bound {TOL:.0e})")
    xb = torch.randn(64, D, device=dev, generator=g).to(torch.bfloat16)
    r = route(xb, router, K)
    eager = fused_experts_fp8(xb, r, w13, s13, w2, s2)
    box = {}
    graph = torch.cuda.CUDAGraph()
    fused_experts_fp8(xb, r, w13, s13, w2, s2)                 # warm (compile) outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
        box["o"] = fused_experts_fp8(xb, r, w13, s13, w2, s2)
    graph.replay()
    torch.cuda.synchronize()
    check("fp8_moe_graph_equals_eager", torch.equal(box["o"], eager))
    cublas = cublas_blockwise_works(torch.device(dev))
    check("fp8_cublas_blockwise_probe", cublas, "cuBLASLt blockwise FP8 (F.scaled_mm) matches the oracle: "
          "model.fp8_dense's GEMMs from 64 rows")
    for N, Kd in ((5120, 2048), (2048, 4096)):
        wq, ws = quantize_blockwise(torch.randn(N, Kd, device=dev, generator=g) * Kd ** -0.5)
        for M in (1, 64, 2048):
            xm = torch.randn(M, Kd, device=dev, generator=g).to(torch.bfloat16)
            e = rel_err(fp8_linear(xm, wq, ws), fp8_linear_reference(xm.float(), wq, ws))
            check(f"fp8_linear_N{N}_K{Kd}_M{M}", e <= TOL, f"rel err {e:.2e} against the FP8 oracle")
            if M >= CUBLAS_MIN_ROWS and cublas:
                e = rel_err(fp8_linear(xm, wq, ws, cublas=True), fp8_linear_reference(xm.float(), wq, ws))
                check(f"fp8_linear_cublas_N{N}_K{Kd}_M{M}", e <= TOL, f"rel err {e:.2e} against the FP8 oracle")
        if cublas:      # the P graphs capture model.fp8_dense's GEMMs: the cuBLASLt path replays as it ran eagerly
            eager = fp8_linear(xm, wq, ws, cublas=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode=CAPTURE_MODE):
                box["y"] = fp8_linear(xm, wq, ws, cublas=True)
            graph.replay()
            torch.cuda.synchronize()
            check(f"fp8_linear_cublas_graph_equals_eager_N{N}", torch.equal(box["y"], eager))
    torch.cuda.empty_cache()


def summarize_fp8(f: dict, target, fig=None) -> None:
    """FP8 decode against its bound (<= 1.25x) and against bf16 (tokens/s >= 1.6x) at B 64 / 128, ctx
    2K; the tokens/s also with the FP8 KV cache (issue 37: "KV as configured"; at B 64 x 2K the KV is
    ~30% of an FP8 iteration's bytes, halved by it). With ``fig``, the tokens/s ratio at the largest
    batch both models timed below 64 too (a figure, no target: on an 80 GB card the bf16 model's
    B 64 / 128 rows do not fit beside its weights, so the targets' batches have no bf16 time)."""
    if fig is not None:
        both = [B for B in (40, 32, 16)
                if f.get(f"qwen3fp8_decode_iteration_b{B}") and f.get(f"qwen3_decode_iteration_b{B}")]
        if both:
            B = both[0]
            b, q = f[f"qwen3_decode_iteration_b{B}"]["graph_ms"], f[f"qwen3fp8_decode_iteration_b{B}"]["graph_ms"]
            fig(f"fp8_over_bf16_tokens_per_s_b{B}", round(b / q, 3), f"{b} ms bf16 / {q} ms fp8, ctx 2K")
    for B in (64, 128):
        kq, b = f.get(f"qwen3fp8_kvfp8_decode_iteration_b{B}_l2048"), f.get(f"qwen3_decode_iteration_b{B}")
        if kq and b:
            speed = b["graph_ms"] / kq["graph_ms"]
            target(f"fp8_kvfp8_over_bf16_tokens_per_s_b{B}_ge_1.6", speed >= 1.6,
                   f"{speed:.2f}x ({b['graph_ms']} ms bf16 / {kq['graph_ms']} ms fp8 weights and KV)")
    for B in (64, 128):
        q, b = f.get(f"qwen3fp8_decode_iteration_b{B}"), f.get(f"qwen3_decode_iteration_b{B}")
        if not q:
            continue
        target(f"fp8_decode_iteration_b{B}_le_1.25x", q["ratio"] <= 1.25,
               f"{q['graph_ms']} ms vs FP8 bound {q['bound_ms']} ms")
        if b:
            speed = b["graph_ms"] / q["graph_ms"]
            target(f"fp8_over_bf16_tokens_per_s_b{B}_ge_1.6", speed >= 1.6,
                   f"{speed:.2f}x ({b['graph_ms']} ms bf16 / {q['graph_ms']} ms fp8)")
