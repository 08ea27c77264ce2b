"""sleep / wake_up on the GPU (issue 15): device memory after each level, sleep and wake times,
graph recapture cost, outputs after wake equal those before (GPU host).

    python benchmarks/sleep_wake_bench.py --config configs/qwen3-30b-a3b-shape.yaml --out sleep.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402

GiB = 1 << 30


def smi_mib() -> int | None:
    """This process's GPU memory as nvidia-smi reports it (MiB), None if it lists no processes."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    import os
    for line in out.splitlines():
        pid, mem = (x.strip() for x in line.split(","))
        if int(pid) == os.getpid():
            return int(mem)
    total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20).stdout.strip()
    return int(total.splitlines()[0]) if total else None


def mem() -> dict:
    torch.cuda.synchronize()
    return {"reserved_GiB": round(torch.cuda.memory_reserved() / GiB, 3),
            "allocated_GiB": round(torch.cuda.memory_allocated() / GiB, 3), "nvidia_smi_MiB": smi_mib()}


async def turns(w, prompts):
    outs = await asyncio.gather(*(w.generate(p, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
                                  for p in prompts))
    for o in outs:
        await w.release(o.trajectory_id)
    return [o.token_ids for o in outs]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = WorkerConfig.from_yaml(args.config).replace(**{
        "scheduler.policy": "normal", "cache.num_blocks": 4096, "device.graph_batch_sizes": [1, 4, 16],
        "device.graph_max_context": 2048, "scheduler.max_prefill_tokens": 2048})
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg.model.vocab_size) for _ in range(rng.randrange(100, 900))] for _ in range(8)]
    res: dict = {"config": args.config, "device": torch.cuda.get_device_name()}
    t0 = time.perf_counter()
    async with RolloutWorker(cfg) as w:
        res["start_s"] = round(time.perf_counter() - t0, 2)
        before = await turns(w, prompts)
        res["awake"] = mem()
        print("awake", res["awake"], flush=True)
        for level in (1, 2):
            t = time.perf_counter()
            await w.sleep(level)
            res[f"sleep{level}_s"] = round(time.perf_counter() - t, 3)
            res[f"asleep{level}"] = mem()
            print(f"sleep({level}) {res[f'sleep{level}_s']} s", res[f"asleep{level}"], flush=True)
            if level == 2:
                t = time.perf_counter()
                await w.wake_up(["weights"])
                res["wake_weights_s"] = round(time.perf_counter() - t, 3)
                t = time.perf_counter()
                await w.wake_up(["kv_cache"])
                res["wake_kv_s"] = round(time.perf_counter() - t, 3)
            else:
                t = time.perf_counter()
                await w.wake_up()
                res["wake1_s"] = round(time.perf_counter() - t, 3)
            res[f"awake_after{level}"] = mem()
            after = await turns(w, prompts)
            res[f"outputs_equal_after_sleep{level}"] = after == before
            print(f"wake after {level}:", {k: v for k, v in res.items() if k.startswith('wake')},
                  res[f"awake_after{level}"], "outputs equal:", after == before, flush=True)
        res["graphs_after_wake"] = len(w.engine.runner.graphs.graphs) if w.engine.runner.graphs else 0
    res["target_sleep2_le_1GiB"] = res["asleep2"]["reserved_GiB"] <= 1.0
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
