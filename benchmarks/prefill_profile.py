"""Where does an in-engine P epoch spend its time? (GPU host; diagnostic for issue 3)

Runs a worker alone (no decode traffic), then times single P epochs through the public API:
a first turn of N tokens and a continuation of N new tokens on top of a retained context,
each with max_new_tokens=1, so the turn's latency is one P epoch plus one sampled token.
Prints the wall time per case, the engine's per-segment device intervals, and with
``--profile`` the top CUDA kernels of one continuation (torch.profiler).

    python benchmarks/prefill_profile.py --config configs/h200-bench.yaml --sizes 64,575,2048,8192
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import torch

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig
from ainfer_pd.tools.report import interval_stats


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/h200-bench.yaml")
    ap.add_argument("--sizes", default="64,575,2048,8192")
    ap.add_argument("--context", type=int, default=1500, help="retained context before a continuation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--graphs", action="store_true", help="capture decode graphs as the bench does")
    a = ap.parse_args()
    cfg = WorkerConfig.from_yaml(a.config).replace(**{"scheduler.policy": "normal", "device.cuda_graphs": a.graphs})
    vocab = cfg.model.vocab_size
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    async with RolloutWorker(cfg) as w:
        await w.generate(_ids(rng, 256, vocab), one)           # warm-up
        for n in [int(x) for x in a.sizes.split(",")]:
            first, cont = [], []
            for _ in range(a.repeats):
                w.recorder.intervals.clear()
                t0 = time.perf_counter()
                o = await w.generate(_ids(rng, n, vocab), one)
                first.append(time.perf_counter() - t0)
                base = await w.generate(_ids(rng, a.context, vocab), one)
                w.recorder.intervals.clear()
                t0 = time.perf_counter()
                o = await w.continue_(base.trajectory_id, _ids(rng, n, vocab), one)
                cont.append(time.perf_counter() - t0)
                await w.release(base.trajectory_id)
            print(f"N={n:5d}: first turn {1e3 * statistics.median(first):7.1f} ms, continuation on "
                  f"{a.context} {1e3 * statistics.median(cont):7.1f} ms (cached {o.num_cached_tokens})", flush=True)
            print("    last continuation: " + interval_stats(w.recorder.intervals, top=8), flush=True)
        if a.profile and torch.cuda.is_available():
            from torch.profiler import ProfilerActivity, profile
            base = await w.generate(_ids(rng, a.context, vocab), one)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                await w.continue_(base.trajectory_id, _ids(rng, 575, vocab), one)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
