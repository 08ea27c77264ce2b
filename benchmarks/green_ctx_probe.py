"""Probe (H200): does torch's CUDA green-context API exist in this image, and do a cuBLAS GEMM and
a Triton kernel run on a stream of a green context with part of the SMs? Prints what it finds;
the next lever for D's slowdown beside P (an SM partition for the P stream) depends on it.

    python benchmarks/green_ctx_probe.py [--sms 66]
"""
from __future__ import annotations

import argparse
import time

import torch


def _stream_of(ctx, index: int):
    if hasattr(ctx, "Stream"):
        return ctx.Stream(), "ctx.Stream()"
    ctx.set_context()
    try:
        return torch.cuda.Stream(device=index), "torch.cuda.Stream() under set_context"
    finally:
        ctx.pop_context()


def _time(fn, stream, n: int = 20) -> float:
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, default=66)
    a = ap.parse_args()
    print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
          "SMs", torch.cuda.get_device_properties(0).multi_processor_count)
    try:
        from torch.cuda import green_contexts as gc
    except ImportError as e:
        print("NO torch.cuda.green_contexts:", e)
        return 0
    G = gc.GreenContext
    print("GreenContext members:", [m for m in dir(G) if not m.startswith("_")])
    try:
        ctx = G.create(num_sms=a.sms, device_id=0)
    except TypeError:
        ctx = G.create(a.sms, 0)
    s, how = _stream_of(ctx, 0)
    print("green stream via", how)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    full = torch.cuda.Stream()
    t_full = _time(lambda: x @ x, full)
    t_green = _time(lambda: x @ x, s)
    print(f"GEMM 8192^3 bf16: full {t_full:.3f} ms, green({a.sms} SMs) {t_green:.3f} ms, ratio {t_green / t_full:.2f}")
    import triton
    import triton.language as tl

    @triton.jit
    def _add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(y_ptr + i, tl.load(x_ptr + i, mask=m) + 1, mask=m)

    v = torch.zeros(1 << 26, device="cuda", dtype=torch.float32)
    w = torch.empty_like(v)
    run = lambda: _add[(triton.cdiv(v.numel(), 1024),)](v, w, v.numel(), BLOCK=1024)  # noqa: E731
    try:
        t_tf, t_tg = _time(run, full), _time(run, s)
        ok = bool((w == 1).all())
        print(f"Triton add 256 MB: full {t_tf:.3f} ms, green {t_tg:.3f} ms, ratio {t_tg / t_tf:.2f}, correct {ok}")
    except Exception as e:  # noqa: BLE001 (a probe: report whatever fails)
        print("Triton on the green stream FAILED:", repr(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
