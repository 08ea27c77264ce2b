"""Weight sync over CUDA IPC vs host staging (issue 15; GPU host).

A trainer process holds bf16 weights of the rollout's model (same names and shapes) on the GPU;
the rollout worker syncs them (1) from CUDA IPC handles (``ainfer_pd.weight_transfer``: no host
copy, one device-to-device copy into the parameters), (2) host-staged: the trainer copies each
bucket to shared host memory, the worker copies host -> device. Prints seconds and GB/s of each.

    python benchmarks/ipc_sync_bench.py --config configs/qwen3-30b-a3b-shape.yaml --layers 24
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ainfer_pd import RolloutWorker, WorkerConfig  # noqa: E402
from ainfer_pd.weight_transfer import open_buckets, share_bucket  # noqa: E402

BUCKET = 1 << 30


def buckets_of(named):
    out, cur, size = [], [], 0
    for n, t in named:
        cur.append((n, t))
        size += t.numel() * t.element_size()
        if size >= BUCKET:
            out.append(cur)
            cur, size = [], 0
    return out + ([cur] if cur else [])


def trainer(names_shapes, dtype, conn):
    torch.cuda.set_device(0)
    g = torch.Generator(device="cuda").manual_seed(1)
    named = [(n, (torch.randn(s, device="cuda", generator=g) * 0.02).to(dtype)) for n, s in names_shapes]
    torch.cuda.synchronize()
    conn.send([share_bucket(b) for b in buckets_of(named)])         # (1) CUDA IPC handles
    assert conn.recv() == "ipc done"
    try:
        t = time.perf_counter()
        host = [[(n, x.to("cpu").share_memory_()) for n, x in b] for b in buckets_of(named)]
        d2h = time.perf_counter() - t
        conn.send(([share_bucket(b) for b in host], d2h))            # (2) host-staged (shared memory)
    except Exception as exc:                                         # e.g. a small /dev/shm
        conn.send((None, repr(exc)))
    assert conn.recv() == "host done"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/qwen3-30b-a3b-shape.yaml")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = WorkerConfig.from_yaml(args.config).replace(**{
        "model.num_layers": args.layers, "cache.num_blocks": 1024, "device.cuda_graphs": False,
        "device.warmup_prefill": False})
    res: dict = {"config": args.config, "layers": args.layers}
    async with RolloutWorker(cfg) as w:
        names_shapes = [(n, tuple(p.shape)) for n, p in w.model.named_parameters()]
        nbytes = sum(p.numel() * p.element_size() for p in w.model.parameters())
        res["GB"] = round(nbytes / 1e9, 2)
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=trainer, args=(names_shapes, w.model.embed.dtype, child))
        proc.start()
        handles = parent.recv()
        t = time.perf_counter()
        n = await w.update_weights(open_buckets(handles))
        torch.cuda.synchronize()
        res["ipc_s"] = round(time.perf_counter() - t, 3)
        res["ipc_GBps"] = round(nbytes / 1e9 / res["ipc_s"], 1)
        res["tensors"] = n
        del handles
        parent.send("ipc done")
        host_handles, d2h = parent.recv()
        if host_handles is None:
            res["host_staged_error"] = d2h
            parent.send("host done")
            proc.join(120)
            print(json.dumps(res), flush=True)
            return
        t = time.perf_counter()
        await w.update_weights(open_buckets(host_handles))
        torch.cuda.synchronize()
        h2d = time.perf_counter() - t
        res["host_staged_s"] = round(d2h + h2d, 3)
        res["host_d2h_s"], res["host_h2d_s"] = round(d2h, 3), round(h2d, 3)
        res["host_staged_GBps"] = round(nbytes / 1e9 / (d2h + h2d), 1)
        del host_handles
        parent.send("host done")
        proc.join(120)
    print(json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
