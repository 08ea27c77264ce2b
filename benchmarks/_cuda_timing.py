"""GPU timing shared by the benchmark scripts: CUDA events around ``iters`` back-to-back calls, and
``triton.testing.do_bench``'s median."""
import torch

from ainfer_pd.engine.runtime.cuda_graphs import CAPTURE_MODE


def cuda_time_s(fn, iters: int, warmup: int = 3) -> float:
    """Mean seconds per call of ``fn`` on the current CUDA stream (after ``warmup`` calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def median_ms(fn, rep: int = 40) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench`` (10 warm-up calls, ``rep`` ms of runs)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def graph_of(fn):
    """``fn`` captured in a CUDA graph (warm-up on a side stream first); returns the graph. The
    capture fails if ``fn`` syncs with the host."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=CAPTURE_MODE):
        fn()
    return g
