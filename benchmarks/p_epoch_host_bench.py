"""A P epoch's wall time against its GPU busy time (GPU host), and where the host time goes.

For each ``(n, cached)``: a trajectory of ``cached`` prompt tokens is prefilled (not measured), then
continued with ``n`` observation tokens and one new token, alone on the engine (policy normal, no D
beside it): the engine's own ``p_epoch_s`` of that continuation (summed over its epochs, when the P
budget cuts it in two) is the **wall** time. The same pass
through ``ModelRunner.forward_fb`` gives:

* ``busy_ms``: the sum of its CUDA kernels' device time (torch profiler), the **device** time;
* ``host_ms``: how long the host takes to enqueue it, timed with the device kept busy beforehand (a
  long sleep kernel), so the launch queue never waits for the device: pure host time;
* ``host_us_per_layer``: ``host_ms`` over the layers.

``--cprofile`` prints the top host functions (own time) of one enqueue of the first case.

    python benchmarks/p_epoch_host_bench.py [--config configs/qwen3-30b-a3b-shape.yaml] [--cases 512:2048,2048:4096,8192:8192]
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd import RolloutWorker, SamplingParams  # noqa: E402
from ainfer_pd.tools.options import load_config  # noqa: E402
from ainfer_pd.engine.attention import ForwardBatch, PrefillSeq  # noqa: E402
from ainfer_pd.phase import Phase, PhaseContext  # noqa: E402


def _delta_sum(m: dict, m0: dict, key: str) -> tuple[float, int]:
    """(sum, count) of ``key`` samples recorded between the snapshots ``m0`` and ``m``."""
    return m.get(f"{key}_sum", 0.0) - m0.get(f"{key}_sum", 0.0), m.get(f"{key}_count", 0) - m0.get(f"{key}_count", 0)


def _prefill_fb(runner, n: int, cached: int) -> ForwardBatch:
    dev, bs = runner.device, runner.kv.block_size
    ctx = n + cached
    nb = -(-ctx // bs)
    blocks = torch.arange(nb, dtype=torch.int64) % runner.kv.alloc.num_blocks
    slots = (blocks.repeat_interleave(bs) * bs + torch.arange(bs).repeat(nb))[:ctx]
    return ForwardBatch(torch.randint(2, runner.cfg.model.vocab_size, (n,), device=dev),
                        torch.arange(cached, ctx, device=dev), slots[cached:].to(dev),
                        [PrefillSeq(0, n, ctx, block_ids=blocks)], None, torch.tensor([n - 1], device=dev),
                        block_size=bs)


def forward_figures(runner, n: int, cached: int, reps: int = 5) -> dict:
    from torch.profiler import ProfilerActivity, profile
    ctx = PhaseContext(Phase.PREFILL, None)
    fb = _prefill_fb(runner, n, cached)

    def step():
        fb.prefill_meta = None
        return runner.forward_fb(fb, ctx)
    with torch.inference_mode():
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
        hosts = []
        for _ in range(reps):
            torch.cuda.synchronize()
            torch.cuda._sleep(int(5e8))            # ~1 s of device work ahead: the launches never wait
            t0 = time.perf_counter()
            step()
            hosts.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
    host = min(hosts)
    return {"busy_ms": round(busy, 2), "host_ms": round(host, 2),
            "host_us_per_layer": round(host * 1e3 / runner.cfg.model.num_layers, 1)}


def host_profile(runner, n: int, cached: int, top: int) -> str:
    ctx = PhaseContext(Phase.PREFILL, None)
    fb = _prefill_fb(runner, n, cached)
    prof = cProfile.Profile()
    with torch.inference_mode():
        fb.prefill_meta = None
        runner.forward_fb(fb, ctx)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e8))
        prof.enable()
        fb.prefill_meta = None
        runner.forward_fb(fb, ctx)
        prof.disable()
        torch.cuda.synchronize()
    import io
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


async def engine_epochs(w: RolloutWorker, n: int, cached: int, reps: int) -> dict:
    rng = random.Random(n * 7 + cached)
    V = w.cfg.model.vocab_size
    one = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    walls, epochs = [], 0
    for _ in range(reps):
        o = await w.generate([rng.randrange(2, V) for _ in range(cached)], one)
        m0 = w.metrics()
        o2 = await w.continue_(o.trajectory_id, [rng.randrange(2, V) for _ in range(n)], one)
        m = w.metrics()
        total, epochs = _delta_sum(m, m0, "p_epoch_s")     # a continuation over the P budget takes 2 epochs
        walls.append(total * 1e3)
        await w.release(o2.trajectory_id)
    return {"epoch_wall_ms": round(statistics.median(walls), 2), "epoch_wall_all_ms": [round(x, 2) for x in walls],
            "epochs": epochs}


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--cases", default="512:2048,2048:4096,8192:8000,575:1500")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cprofile", type=int, default=0, help="top N host functions of the first case")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cfg = load_config(a.config, ["scheduler.policy=normal", *a.set])
    cases = [tuple(int(x) for x in c.split(":")) for c in a.cases.split(",")]
    rows = []
    print(f"{'n':>6} {'cached':>6} {'wall_ms':>8} {'busy_ms':>8} {'host_ms':>8} {'us/layer':>8} {'wall/busy':>9}", flush=True)
    async with RolloutWorker(cfg) as w:
        warm = await w.generate([2 + i for i in range(64)], SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
        await w.release(warm.trajectory_id)
        for n, cached in cases:
            r = {"n": n, "cached": cached, **await engine_epochs(w, n, cached, a.reps)}
            r.update(await asyncio.to_thread(forward_figures, w.engine.runner, n, cached))
            r["wall_busy"] = round(r["epoch_wall_ms"] / r["busy_ms"], 3)
            rows.append(r)
            print(f"{n:>6} {cached:>6} {r['epoch_wall_ms']:>8.2f} {r['busy_ms']:>8.2f} {r['host_ms']:>8.2f} "
                  f"{r['host_us_per_layer']:>8.1f} {r['wall_busy']:>9.3f}", flush=True)
        if a.cprofile:
            print(await asyncio.to_thread(host_profile, w.engine.runner, *cases[0], a.cprofile), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"config": a.config, "rows": rows,
                                           "machine": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
