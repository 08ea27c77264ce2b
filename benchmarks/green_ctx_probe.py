"""Probe (H200): does torch's CUDA green-context API exist in this image, and do a cuBLAS GEMM and
a Triton kernel run on a stream of a green context with part of the SMs? Prints what it finds;
the next lever for D's slowdown beside P (an SM partition for the P stream) depends on it.

    python benchmarks/green_ctx_probe.py [--sms 66] [--overlap 128,112,96,80] [--split 96:36,80:52,66:66]

``--overlap``: the engine's use (``device.p_stream_sms``) in small. A D-like bandwidth-bound
GEMM (16 rows against a 512 MB bf16 weight) timed alone, then beside a P-like compute-bound GEMM
loop on a whole-device stream and on green streams of each SM count; prints D's time per call
and P's throughput in each case. Also checks what the engine needs of a green stream: CUDA
events recorded on it timed against an event of the primary context, and cross-stream waits.

``--split P:D,...``: the next lever in small (D beside P is ~28% slower than alone on the trace
cell, session 12): P *and* D each on a green context. First which SMs each context's kernels run
on (a Triton kernel reads ``%smid``): are two contexts of P and D SMs disjoint, and does a CUDA
graph captured on a primary stream stay inside the green context it is replayed on? Then D's call
alone on its context, and beside the P loop on the other.
"""
from __future__ import annotations

import argparse
import time

import torch

from ainfer_pd.engine.runtime.cuda_graphs import CAPTURE_MODE


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
    ap.add_argument("--overlap", default="", help="comma-separated SM counts for the P stream's green context")
    ap.add_argument("--split", default="", help="comma-separated P:D SM counts, each phase on its own green context")
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
    if a.overlap:
        overlap(G, [int(x) for x in a.overlap.split(",")])
    if a.split:
        split(G, [tuple(int(v) for v in pair.split(":")) for pair in a.split.split(",")])
    return 0


def _events_ok(stream) -> str:
    """Engine's needs: an event on the green stream timed against a primary-context event, and a
    primary stream waiting for the green one."""
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        e0.record(stream)
        y = x @ x
        e1.record(stream)
    other = torch.cuda.Stream()
    other.wait_event(e1)
    with torch.cuda.stream(other):
        z = y.float().sum()
    torch.cuda.synchronize()
    ok = torch.allclose(z, (x @ x).float().sum(), rtol=1e-3)
    return (f"event on green stream: {ref.elapsed_time(e0):.3f} ms after the primary's, "
            f"{e0.elapsed_time(e1):.3f} ms GEMM; cross-stream wait correct {ok}")


def overlap(G, sms_list: list[int]) -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    w = torch.randn(4096, 65536, device="cuda", dtype=torch.bfloat16)     # 512 MB: D reads weights
    xd = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    xp = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)     # P: a segment's GEMMs
    wp = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    d_stream = torch.cuda.Stream()

    def d_time(n: int = 200) -> tuple:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(d_stream):
            e0.record(d_stream)
            for _ in range(n):
                xd @ w
            e1.record(d_stream)
        return e0, e1, n                       # (start, end, calls): read after a synchronize

    def run(p_stream, label: str) -> None:
        torch.cuda.synchronize()
        pe0, pe1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n_p = 0
        if p_stream is not None:
            with torch.cuda.stream(p_stream):
                pe0.record(p_stream)
                for _ in range(300):
                    xp @ wp
                n_p = 300
                pe1.record(p_stream)
        e0, e1, n = d_time()
        torch.cuda.synchronize()
        d_ms = e0.elapsed_time(e1) / n
        msg = f"  {label:>14}: D {d_ms * 1e3:7.1f} us/call"
        if n_p:
            p_ms = pe0.elapsed_time(pe1) / n_p
            msg += f", P {2 * 8192 * 4096 * 4096 / p_ms / 1e9:6.0f} TFLOP/s ({p_ms:.3f} ms/GEMM)"
        print(msg, flush=True)

    print(f"overlap (device has {total} SMs): D = 16x4096 @ 4096x65536 bf16, P = 8192x4096 @ 4096x4096 bf16")
    for _ in range(2):
        run(None, "warm-up")
    run(None, "D alone")
    run(torch.cuda.Stream(), "P full device")
    for sms in sms_list:
        if sms >= total:
            continue
        try:
            ctx = G.create(num_sms=sms, device_id=0)
        except Exception as e:  # noqa: BLE001 (a probe: report whatever fails)
            print(f"  green({sms}) FAILED: {e!r}")
            continue
        s, _ = _stream_of(ctx, 0)
        if sms == sms_list[0]:
            print(" ", _events_ok(s))
        run(s, f"P green({sms})")
        with torch.cuda.stream(s):
            pe0, pe1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            pe0.record(s)
            for _ in range(100):
                xp @ wp
            pe1.record(s)
        torch.cuda.synchronize()
        print(f"  {'':>14}  P alone on green({sms}): {pe0.elapsed_time(pe1) / 100:.3f} ms/GEMM", flush=True)


def _sm_ids(stream, graph: bool = False) -> set[int]:
    """The SMs a kernel launched on ``stream`` ran on (``graph``: captured on a primary stream,
    replayed on ``stream``). 4 programs an SM, each spinning a little so they spread."""
    import triton
    import triton.language as tl

    @triton.jit
    def _smid(out_ptr, spin, BLOCK: tl.constexpr):
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [tl.arange(0, BLOCK)], dtype=tl.int32,
                                       is_pure=False, pack=1)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(spin):
            acc = acc * 0.999 + 1.0
        tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), sm + (acc * 0).to(tl.int32))

    n = 4 * torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.full((n * 32,), -1, device="cuda", dtype=torch.int32)
    launch = lambda: _smid[(n,)](out, 20000, BLOCK=32)  # noqa: E731
    with torch.cuda.stream(torch.cuda.Stream()):
        launch()                                            # compile outside any capture
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        cap = torch.cuda.Stream()
        with torch.cuda.stream(cap), torch.cuda.graph(g, stream=cap, capture_error_mode=CAPTURE_MODE):
            launch()
        out.fill_(-1)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            g.replay()
    else:
        with torch.cuda.stream(stream):
            launch()
    torch.cuda.synchronize()
    return set(out.view(n, 32)[:, 0].tolist()) - {-1}


def _graph_on(stream, d_ids: set[int]) -> str:
    """Where a graph captured on a primary stream runs when replayed on ``stream``."""
    try:
        ids = _sm_ids(stream, graph=True)
    except Exception as e:  # noqa: BLE001 (a probe: report whatever fails)
        return f"a graph replayed on D's stream FAILED: {e!r}"
    if not ids:                                         # the kernel wrote nothing: it did not run
        return "a graph replayed on D's stream ran NO kernel (its output untouched)"
    return f"a graph replayed on D's stream on {len(ids)} SMs ({'inside' if ids <= d_ids else 'OUTSIDE'} D's)"


def _disjoint_streams(p_sms: int) -> tuple:
    """Two green-context streams on disjoint SMs through the driver API (``cuda.bindings``): one
    group of at least ``p_sms`` SMs for P and the remaining SMs for D. (torch's
    ``GreenContext.create`` takes one group of a split each time, so two of them may share SMs.)
    Returns (P stream, D stream, P's SM count, D's SM count)."""
    from cuda.bindings import driver as drv

    def ok(r):
        if r[0] != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver error {r[0]}")
        return r[1:] if len(r) > 2 else r[1]

    dev = ok(drv.cuDeviceGet(torch.cuda.current_device()))
    whole = ok(drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, rest = ok(drv.cuDevSmResourceSplitByCount(1, whole, 0, p_sms))
    streams = []
    for res in (groups[0], rest):
        desc = ok(drv.cuDevResourceGenerateDesc([res], 1))
        ctx = ok(drv.cuGreenCtxCreate(desc, dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        raw = ok(drv.cuGreenCtxStreamCreate(ctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        streams.append(torch.cuda.ExternalStream(int(raw)))
    return streams[0], streams[1], groups[0].sm.smCount, rest.sm.smCount


def split(G, pairs: list[tuple[int, int]]) -> None:
    total = torch.cuda.get_device_properties(0).multi_processor_count
    w = torch.randn(4096, 65536, device="cuda", dtype=torch.bfloat16)     # 512 MB: D reads weights
    xd = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    xp = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    wp = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    print(f"split (device has {total} SMs): P and D each on a green context; D = 16x4096 @ 4096x65536, "
          f"P = 8192x4096 @ 4096x4096 (bf16)")
    full_ids = _sm_ids(torch.cuda.Stream())
    print(f"  primary stream: kernel on {len(full_ids)} SMs")

    def d_us(stream, p_stream=None, n: int = 200) -> float:
        torch.cuda.synchronize()
        if p_stream is not None:
            with torch.cuda.stream(p_stream):
                for _ in range(400):
                    xp @ wp
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            xd @ w
            e0.record(stream)
            for _ in range(n):
                xd @ w
            e1.record(stream)
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / n * 1e3

    full = torch.cuda.Stream()
    print(f"  D alone, whole device: {d_us(full):.1f} us/call; beside P on the whole device: "
          f"{d_us(full, torch.cuda.Stream()):.1f}", flush=True)
    for p_sms, d_sms in pairs:
        try:
            pc, dc = G.create(num_sms=p_sms, device_id=0), G.create(num_sms=d_sms, device_id=0)
        except Exception as e:  # noqa: BLE001 (a probe: report whatever fails)
            print(f"  P {p_sms} / D {d_sms}: green contexts FAILED: {e!r}")
            continue
        ps, _ = _stream_of(pc, 0)
        ds, _ = _stream_of(dc, 0)
        p_ids, d_ids = _sm_ids(ps), _sm_ids(ds)
        print(f"  P {p_sms} / D {d_sms}: P's kernel on {len(p_ids)} SMs, D's on {len(d_ids)}, shared "
              f"{len(p_ids & d_ids)}; {_graph_on(ds, d_ids)}", flush=True)
        print(f"    D alone on its {d_sms}: {d_us(ds):.1f} us/call; beside P on its {p_sms}: {d_us(ds, ps):.1f}; "
              f"D whole device beside P on {p_sms}: {d_us(full, ps):.1f}", flush=True)
        try:
            ps, ds, np_, nd = _disjoint_streams(p_sms)
        except Exception as e:  # noqa: BLE001 (a probe: report whatever fails)
            print(f"    disjoint split (driver API) FAILED: {e!r}")
            continue
        p_ids, d_ids = _sm_ids(ps), _sm_ids(ds)
        print(f"    disjoint split: P {np_} SMs (kernel on {len(p_ids)}), D the other {nd} (kernel on "
              f"{len(d_ids)}), shared {len(p_ids & d_ids)}; {_graph_on(ds, d_ids)}", flush=True)
        print(f"    D alone on its {nd}: {d_us(ds):.1f} us/call; beside P on its {np_}: {d_us(ds, ps):.1f}; "
              f"D whole device beside P on {np_}: {d_us(full, ps):.1f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
