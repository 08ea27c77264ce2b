"""GPU timing shared by the benchmark scripts: CUDA events around ``iters`` back-to-back calls."""
import torch


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
