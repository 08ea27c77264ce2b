"""sleep / wake_up times and memory (issue 15; issue 34 item 9: each under 5 s on the Qwen3 shape).

On the GPU host (the figure of record, H200, Qwen3-30B-A3B shape):

    python benchmarks/sleep_wake_bench.py --config configs/qwen3-30b-a3b-shape.yaml --out sleep_wake.json

What it measures, each with the device memory after it (``torch.cuda`` reserved / allocated, and
``nvidia-smi``) and the pinned host buffer, and whether the greedy outputs after the wake equal
those before:

* ``sleep(1)`` / ``wake_up()``: the KV pool and the decode graphs (recaptured at wake);
* ``sleep(2, keep_weights=True)`` twice: the first allocates (page-locks) the host buffer, the
  second reuses it (item 9: a fresh buffer at every sleep took 29 s; ``--reserve`` pins it first,
  timed as ``reserve_sleep_buffer_s``, so neither sleep pays for it); ``wake_up`` split into
  ``wake_up(["weights"])`` and ``wake_up(["kv_cache"])`` (KV pool + graph recapture);
* ``sleep(2, keep_weights=False)`` (vLLM's level 2: weights dropped), then what verl's hybrid
  sync does: ``wake_up(["weights"])``, a complete ``update_weights`` of host buckets (a naive
  engine's) and of an async generator of them (the nccl-style engines'), ``wake_up(["kv_cache"])``.

``--config configs/tiny-cpu.yaml`` runs the same on CPU (a smoke run: memory figures are 0).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402

GiB = 1 << 30
TARGET_S = 5.0


def smi_mib() -> int | None:
    """This process's GPU memory as nvidia-smi reports it (MiB), None if it lists no processes."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        pid, used = (x.strip() for x in line.split(","))
        if int(pid) == os.getpid():
            return int(used)
    total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20).stdout.strip()
    return int(total.splitlines()[0]) if total else None


def mem(w) -> dict:
    host = round(w.engine.residency.host_bytes() / GiB, 3)
    if not torch.cuda.is_available() or w.engine.device.kind != "cuda":
        return {"reserved_GiB": 0.0, "allocated_GiB": 0.0, "nvidia_smi_MiB": None, "host_buffer_GiB": host}
    torch.cuda.synchronize()
    return {"reserved_GiB": round(torch.cuda.memory_reserved() / GiB, 3),
            "allocated_GiB": round(torch.cuda.memory_allocated() / GiB, 3), "nvidia_smi_MiB": smi_mib(),
            "host_buffer_GiB": host}


async def turns(w, prompts):
    outs = await asyncio.gather(*(w.generate(p, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
                                  for p in prompts))
    for o in outs:
        await w.release(o.trajectory_id)
    return [o.token_ids for o in outs]


async def timed(res: dict, key: str, aw) -> None:
    t = time.perf_counter()
    await aw
    res[key] = round(time.perf_counter() - t, 3)


def buckets(named: list, bucket_bytes: int) -> list[list]:
    out, cur, size = [], [], 0
    for n, t in named:
        cur.append((n, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def pinned_views(buf: torch.Tensor, named) -> list:
    """(name, copy of the parameter) for every parameter, each a view into ``buf`` (the kept
    host buffer of sleep level 2, pinned on CUDA)."""
    out, off = [], 0
    for n, p in named:
        nbytes = p.numel() * p.element_size()
        view = buf[off:off + nbytes].view(p.dtype).view(p.shape)
        view.copy_(p.detach())
        out.append((n, view))
        off += -(-nbytes // 256) * 256
    return out


async def agen(items):
    for b in items:
        yield b
        await asyncio.sleep(0)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--out", default=None)
    ap.add_argument("--bucket-mb", type=int, default=512, help="bucket size of the level-2 syncs (verl's default)")
    ap.add_argument("--reserve", action="store_true", help="pin the host buffer before the first sleep(2)")
    ap.add_argument("--skip-dropped", action="store_true", help="skip sleep(2, keep_weights=False) and its syncs")
    args = ap.parse_args()
    cfg = WorkerConfig.from_yaml(args.config)
    if cfg.device.device != "cpu":
        cfg = cfg.replace(**{"scheduler.policy": "normal", "cache.num_blocks": 4096, "device.graph_batch_sizes": [1, 4, 16],
                             "device.graph_max_context": 2048, "scheduler.max_prefill_tokens": 2048})
    rng = random.Random(0)
    prompts = [[rng.randrange(2, cfg.model.vocab_size) for _ in range(rng.randrange(100, 900))] for _ in range(8)]
    res: dict = {"config": args.config, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    t0 = time.perf_counter()
    async with RolloutWorker(cfg) as w:
        res["start_s"] = round(time.perf_counter() - t0, 2)
        before = await turns(w, prompts)
        res["awake"] = mem(w)
        print("awake", res["awake"], flush=True)

        async def check(tag: str) -> None:
            res[f"awake_after_{tag}"] = mem(w)
            res[f"outputs_equal_after_{tag}"] = await turns(w, prompts) == before
            print(f"{tag}:", {k: v for k, v in res.items() if tag in k}, flush=True)
            if args.out:                  # what is measured so far survives a run cut short
                Path(args.out).write_text(json.dumps(res, indent=1))

        # level 1: the KV pool and the graphs
        await timed(res, "sleep1_s", w.sleep(1))
        res["asleep1"] = mem(w)
        await timed(res, "wake1_s", w.wake_up())
        await check("sleep1")
        # level 2, weights kept in pinned host memory: the first sleep allocates the buffer, the next
        # reuses it; --reserve pins it beforehand (worker.reserve_sleep_buffer), so no sleep pays for it
        if args.reserve:
            await timed(res, "reserve_sleep_buffer_s", w.reserve_sleep_buffer())
        for cycle in (1, 2):
            tag = f"sleep2_keep_{cycle}"
            await timed(res, f"{tag}_s", w.sleep(2, keep_weights=True))
            res[f"asleep_{tag}"] = mem(w)
            await timed(res, f"{tag}_wake_weights_s", w.wake_up(["weights"]))
            await timed(res, f"{tag}_wake_kv_s", w.wake_up(["kv_cache"]))
            res[f"{tag}_wake_s"] = round(res[f"{tag}_wake_weights_s"] + res[f"{tag}_wake_kv_s"], 3)
            await check(tag)
        res["host_buffer_allocations"] = w.engine.residency.host_allocations
        if not args.skip_dropped:
            # level 2, weights dropped (vLLM's level 2); the sync refills them, as verl's hybrid mode does
            # the trainer's side of a hybrid sync: the weights in page-locked host memory. Staged in
            # the worker's own kept pinned buffer (a second 61 GB pageable copy ended the process on
            # the H200's 128 GB host), as views laid out like residency's (256-byte aligned)
            t = time.perf_counter()
            host = pinned_views(w.engine.residency.reserve_host_buffer(), w.model.named_parameters())
            res["host_copy_for_sync_s"] = round(time.perf_counter() - t, 3)
            res["host_pinned"] = bool(host and host[0][1].is_pinned())
            bks = buckets(host, args.bucket_mb << 20)
            res["sync_buckets"] = len(bks)
            await timed(res, "sleep2_drop_s", w.sleep(2, keep_weights=False))
            res["asleep_sleep2_drop"] = mem(w)
            await timed(res, "sleep2_drop_wake_weights_s", w.wake_up(["weights"]))
            await timed(res, "sync_host_buckets_s", w.update_weights(iter(bks)))
            res["after_sync"] = mem(w)
            # an async generator of the same buckets (the nccl-style engines' form): each tensor is
            # copied to the device as it arrives (staging: one more copy of the weights until the
            # last bucket), so it runs here, before the KV pool is back
            try:
                await timed(res, "sync_async_buckets_s", w.update_weights(agen(bks)))
                res["after_async_sync"] = mem(w)
            except Exception as exc:          # noqa: BLE001 - reported (e.g. out of device memory for the staging)
                res["sync_async_buckets_error"] = repr(exc)[:300]
            await timed(res, "sleep2_drop_wake_kv_s", w.wake_up(["kv_cache"]))
            await check("sleep2_drop")
            del host, bks
        res["graphs_after_wake"] = len(w.engine.runner.graphs.graphs) if w.engine.runner.graphs else 0
    res["targets"] = {
        "sleep2_keep_2_s<5": res["sleep2_keep_2_s"] < TARGET_S,
        "sleep2_keep_2_wake_s<5": res["sleep2_keep_2_wake_s"] < TARGET_S,
        "sleep2_drop_s<5": res.get("sleep2_drop_s", 0) < TARGET_S,
        "asleep2_reserved<=1GiB": res["asleep_sleep2_keep_2"]["reserved_GiB"] <= 1.0,
    }
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
