"""The dense projections in FP8 against bf16 cuBLAS, on the Qwen3-30B-A3B shape's QKV and O GEMMs
(GPU host; prints measured figures only).

``model.fp8_dense`` is off by default because the engine's Triton FP8 GEMM (``fp8_linear``) lost to
bf16 cuBLAS on the H200: 0.134 against 0.060 ms for the QKV GEMM of a 2,048-token prefill. The dense
GEMMs are ~14% of the FP8 model's 4K prefill (10.2 ms), which sits at 30-44% of its FP8 roofline
(issue 37: 50%). cuBLASLt has blockwise-scaled FP8 GEMMs on Hopper (1 x 128 activation groups,
128 x 128 weight blocks: DeepSeek-V3's format, the checkpoints' and the engine's), reached through
torch's ``scaled_mm`` / ``_scaled_mm``. Per GEMM and token count, each candidate's median time:

* ``bf16``: ``F.linear`` on the bf16 weight (cuBLAS);
* ``triton``: the engine's ``fp8_linear`` (its activation quantization included);
* ``cublas-fp8 <layout>``: the engine's activation quantization (``per_token_group_quant``) then
  ``torch.nn.functional.scaled_mm`` (or ``torch._scaled_mm`` where torch has no ``scaled_mm``) with
  blockwise scales, in each scale layout torch might want (the first that runs and matches the
  dequantized reference within 3e-2 of its largest value is timed; the others' errors are printed).

    python benchmarks/fp8_dense_sweep.py [--tokens 64,2048,4096] [--budget-s 60]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _cuda_timing import median_ms as ms  # noqa: E402

from ainfer_pd.engine.quant import fp8 as q8  # noqa: E402

# (name, K, N) of the Qwen3-30B-A3B shape: hidden 2048, 32 query heads and 4 KV heads of 128
GEMMS = (("qkv", 2048, (32 + 2 * 4) * 128), ("o", 32 * 128, 2048))


def outer_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first dimension contiguous (the layout cuBLASLt's vector scales are read in)."""
    return t.t().contiguous().t()


def cublas_fp8(xq, xs, wq, ws, layout: str):
    """One blockwise-scaled FP8 GEMM through torch: y [T, N] bf16 = (xq * xs) (wq * ws)^T."""
    sa = outer_major(xs) if "a-outer" in layout else xs
    sb = ws.t().contiguous() if "b-tc" in layout else ws.t() if "b-t" in layout else ws
    if hasattr(F, "scaled_mm") and "legacy" not in layout:
        st = F.ScalingType
        return F.scaled_mm(xq, wq.t(), sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=torch.bfloat16)
    return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


LAYOUTS = ("a-outer b-t", "a-outer b-tc", "a-outer", "a-outer b-t legacy", "a-outer b-tc legacy", "a-outer legacy",
           "b-t", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="64,2048,4096")
    ap.add_argument("--budget-s", type=float, default=60)
    a = ap.parse_args()
    from ainfer_pd.engine.quant.fp8_ops import fp8_linear, per_token_group_quant
    dev = torch.device("cuda")
    t0 = time.time()
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"fp8 dense sweep: torch {torch.__version__}, {torch.cuda.get_device_name(dev)}, "
          f"scaled_mm {'F.scaled_mm' if hasattr(F, 'scaled_mm') else 'torch._scaled_mm only'}", flush=True)
    for name, K, N in GEMMS:
        w = torch.randn(N, K, device=dev, generator=g, dtype=torch.float32) * K ** -0.5
        wq, ws = q8.quantize_blockwise(w)
        w_bf16 = q8.dequantize_blockwise(wq, ws, torch.bfloat16)
        for T in map(int, a.tokens.split(",")):
            if time.time() - t0 > a.budget_s:
                print("budget reached", flush=True)
                return
            x = torch.randn(T, K, device=dev, generator=g, dtype=torch.bfloat16)
            xq, xs = per_token_group_quant(x)
            ref = F.linear(q8.dequantize_token_groups(xq, xs, torch.float32), w_bf16.float())
            tol = 3e-2 * ref.abs().max().item()
            flops = 2 * T * K * N
            res = {"bf16": ms(lambda: F.linear(x, w_bf16)), "triton": ms(lambda: fp8_linear(x, wq, ws))}
            for lay in LAYOUTS:
                try:
                    y = cublas_fp8(xq, xs, wq, ws, lay)
                    gap = (y.float() - ref).abs().max().item()
                    if gap > tol:
                        raise ValueError(f"off the reference by {gap:.3g} (tolerance {tol:.3g})")
                except Exception as exc:  # noqa: BLE001 - a layout torch refuses is reported, the next tried
                    print(f"  {name} T={T} cublas-fp8 [{lay}]: {type(exc).__name__} {str(exc)[:160]}", flush=True)
                    continue

                def run(lay=lay):
                    cublas_fp8(*per_token_group_quant(x), wq, ws, lay)
                res[f"cublas-fp8 [{lay}]"] = ms(run)
                res[f"cublas-fp8 gemm only [{lay}]"] = ms(lambda lay=lay: cublas_fp8(xq, xs, wq, ws, lay))
                break
            base = res["bf16"]
            cells = ", ".join(f"{k} {v:.4f} ms ({base / v:.2f}x bf16, {flops / v / 1e9:.0f} TFLOP/s)"
                              for k, v in res.items())
            print(f"FIG fp8_dense {name} K={K} N={N} T={T}: {cells}", flush=True)


if __name__ == "__main__":
    main()
