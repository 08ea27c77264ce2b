"""Kernel breakdown of one captured decode-graph replay (GPU host): where a small-batch D iteration
of the Qwen3-30B-A3B shape spends its device time, against the HBM bound of its bytes.

    python benchmarks/decode_profile.py [--batches 1,64] [--ctx 5000] [--out DIR] [--set model.quantization=fp8]
Prints, per batch: the replay's wall time, the number of kernels in it, the sum of their device
times, and the top kernels by device time (name, calls, total us, us per call).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_gate import bench_ms, decode_fb  # noqa: E402

from ainfer_pd.engine.kv.kv_cache import KVCacheManager  # noqa: E402
from ainfer_pd.engine.runtime.runner import ModelRunner, RunnerSections  # noqa: E402
from ainfer_pd.phase import Phase, PhaseContext  # noqa: E402
from ainfer_pd.tools.options import load_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=5000)
    ap.add_argument("--rows", type=int, default=22)
    ap.add_argument("--out", default="")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    Bs = [int(b) for b in a.batches.split(",")]
    cfg = load_config(a.config, a.set).replace(**{"cache.num_blocks": max(Bs) * (a.ctx + 16) // 16 + 1024,
                                                  "device.device": "cuda", "device.graph_batch_sizes": Bs,
                                                  "device.graph_max_context": 8192})
    runner = ModelRunner(RunnerSections.from_config(cfg), torch.device("cuda"), KVCacheManager(cfg.cache.num_blocks, 16))
    runner.kv_cache.normal_(0, 1)
    dctx = PhaseContext(Phase.DECODE, None)
    with torch.inference_mode():
        runner.capture_decode_graphs(dctx)
        for B in Bs:
            fb = decode_fb(runner, B, a.ctx, seed=B)
            runner.graphs.try_run(fb)
            g = runner.graphs.graphs[runner.graphs.bucket(B, a.ctx)][0]
            wall = bench_ms(g.replay, 200)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                g.replay()
                torch.cuda.synchronize()
            ev = prof.key_averages()
            key = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
            rows = sorted(ev, key=lambda e: -getattr(e, key))
            n = sum(e.count for e in rows if getattr(e, key) > 0)
            busy = sum(getattr(e, key) for e in rows) / 1e3
            print(f"== B {B} ctx {a.ctx}: replay {wall:.3f} ms wall, {n} kernels, {busy:.3f} ms of kernel time", flush=True)
            for e in rows[:a.rows]:
                t = getattr(e, key)
                print(f"  {t:9.1f} us {e.count:5d} x {t / max(1, e.count):7.2f} us  {e.key[:110]}", flush=True)
            if a.out:
                Path(a.out).mkdir(parents=True, exist_ok=True)
                (Path(a.out) / f"decode_profile_b{B}.txt").write_text(ev.table(sort_by=key, row_limit=60))


if __name__ == "__main__":
    main()
